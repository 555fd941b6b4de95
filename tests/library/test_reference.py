"""The reference ops' two attention paths agree, and the model runs in reduced precision."""

import pytest
import torch

from ds4_torch import DS4Config, DS4ForCausalLM
from ds4_torch.kernels import reference
from oracle import randomise
from test_decode import SMALL


@pytest.mark.parametrize("T,start", [(1, [40, 9]), (1, [3, 77]), (2, [50, 60])])
def test_picked_path_equals_dense_softmax(T, start):
    """With few picks the reference gathers them (O(K) per query) instead of masking all C rows;
    both must be the same softmax, -1 picks and not-yet-visible rows included."""
    g = torch.Generator().manual_seed(T)
    B, H, D, W, C, K, rate = 2, 3, 16, 5, 40, 4, 2
    q = torch.randn(B, T, H, D, generator=g)
    ring, chunk = torch.randn(B, W, D, generator=g), torch.randn(B, T, D, generator=g)
    comp, sinks = torch.randn(B, C, D, generator=g), torch.randn(H, generator=g)
    start = torch.tensor(start)
    sel = torch.stack([torch.randperm(C, generator=g)[:K] for _ in range(B * T)]).view(B, T, K)
    sel[0, 0, -1] = -1
    assert T * K < C  # the gather path is taken
    got = reference.attention(q, ring, chunk, start, comp, sel, rate, sinks, D ** -0.5)
    probs, keys = reference.attention_probs(q, ring, chunk, start, comp, sel, rate, sinks, D ** -0.5)
    dense = torch.einsum("bhts,bsd->bthd", probs[..., :-1], keys)
    assert (got - dense).abs().max().item() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_reduced_precision_tracks_fp32(dtype):
    model = DS4ForCausalLM(DS4Config.from_dict(SMALL))
    randomise(model, 8)
    ids = torch.randint(2, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = model(ids)
    low = model.to_dtype(dtype)
    assert low.dtype == dtype and low.model.layers[0].attn_hc.fn.dtype == torch.float32  # mHC stays fp32
    cache = low.new_cache(1, 48)
    assert cache.layers[0].window.dtype == dtype
    out = torch.cat([low(ids[:, :20], cache=cache)] + [low(ids[:, t:t + 1], cache=cache) for t in range(20, 40)], 1)
    assert torch.isfinite(out).all()
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 0.3  # random weights amplify rounding; this catches dtype mix-ups, not ulps
