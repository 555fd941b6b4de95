"""DS4ForCausalLM.from_pretrained: checkpoint fingerprint, keep-quantized loading without dense weights."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ckpt_utils import (
    fp4_upstream_checkpoint,
    fp8_checkpoint,
    hf_config,
    new_model,
    randomise,
    save_sharded,
    save_single,
    state_of,
)
from ds4_torch import DS4ForCausalLM
from ds4_torch import quant as Q
from ds4_torch.default_model import DEFAULT_MODEL_DIR, build_default_model
from ds4_torch.loading import checkpoint_fingerprint

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def source():
    return randomise(new_model(hf_config()), seed=0)


def test_from_pretrained_sets_the_checkpoint_fingerprint(source, tmp_path):
    save_single(state_of(source), tmp_path / "a", config_model=source)
    save_single(state_of(randomise(new_model(source.config), seed=1)), tmp_path / "b", config_model=source)
    first, second = DS4ForCausalLM.from_pretrained(tmp_path / "a"), DS4ForCausalLM.from_pretrained(tmp_path / "a")
    assert first.checkpoint_fingerprint == second.checkpoint_fingerprint == checkpoint_fingerprint(tmp_path / "a")
    # same shapes and config, other weights
    assert DS4ForCausalLM.from_pretrained(tmp_path / "b").checkpoint_fingerprint != first.checkpoint_fingerprint


def test_default_model_has_a_fingerprint():
    assert build_default_model().checkpoint_fingerprint == checkpoint_fingerprint(DEFAULT_MODEL_DIR)


# ----------------------------------------------------------------------------- keep mode

DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class DenseAllocations(TorchDispatchMode):
    """Records the shape of every dense-float tensor any ATen op (factories included) returns
    off the meta device."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype in DENSE_DTYPES and t.device.type != "meta":
                self.shapes.add(tuple(t.shape))
        return out


@pytest.fixture(scope="module")
def moe_source():
    """Expert widths (I = 96, 2I = 192) that no dense tensor of the model shares."""
    return randomise(new_model(hf_config(moe_intermediate_size=96)), seed=2)


@pytest.fixture(scope="module")
def fp4_checkpoint(moe_source, tmp_path_factory):
    """Upstream names, FP8 linears (float32 block scales), FP4 experts (e8m0 scales), the rest
    float32. o_a_proj (a grouped projection whose 16-row groups do not start on the 128-row
    block borders, which keep mode would dequantize) is stored float32, so every tensor of this checkpoint is held as stored by a keep-mode float32 model."""
    ckpt, _ = fp8_checkpoint(moe_source, "float32", upstream=True)
    fp4, _, _ = fp4_upstream_checkpoint(moe_source)
    ckpt = {k: v for k, v in ckpt.items() if ".experts." not in k or "shared" in k}
    ckpt.update({k: v for k, v in fp4.items() if ".experts." in k and "shared" not in k})
    dense = state_of(moe_source)
    for k in [k for k in ckpt if re.search(r"\.wo_a\.(weight|scale)$", k)]:
        del ckpt[k]
    for k in [k for k in dense if k.endswith("self_attn.o_a_proj.weight")]:
        ckpt[k.removeprefix("model.")] = dense[k]
    assert any(v.dtype == torch.float8_e4m3fn for v in ckpt.values())
    assert any(k.endswith(".w1.weight") and v.dtype == torch.int8 for k, v in ckpt.items())
    path = save_sharded(ckpt, tmp_path_factory.mktemp("fp4"), n_shards=2, config_model=moe_source)
    return path, sum(v.nbytes for v in ckpt.values())


def _unique_bytes(model) -> int:
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    return sum(t.nbytes for t in tensors.values())


def test_keep_load_never_allocates_dense_experts(fp4_checkpoint, moe_source):
    path, _ = fp4_checkpoint
    c = moe_source.config
    E, H, I = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
    expert_shapes = {(E, 2 * I, H), (E, H, I), (2 * I, H), (I, H), (H, I)}

    with DenseAllocations() as seen:
        DS4ForCausalLM.from_pretrained(path, quantized="dequantize")
    assert {(E, 2 * I, H), (E, H, I)} <= seen.shapes  # the recorder sees the dense path allocate them

    with DenseAllocations() as seen:
        kept = DS4ForCausalLM.from_pretrained(path, quantized="keep")
    assert not (seen.shapes & expert_shapes), seen.shapes & expert_shapes
    assert all(isinstance(layer.mlp.experts, Q.FP4Experts) for layer in kept.model.layers)


def test_keep_load_holds_the_file_bytes_and_matches_dequantize(fp4_checkpoint):
    path, file_tensor_bytes = fp4_checkpoint
    kept = DS4ForCausalLM.from_pretrained(path, quantized="keep")
    dense = DS4ForCausalLM.from_pretrained(path, quantized="dequantize")
    assert _unique_bytes(kept) == file_tensor_bytes
    assert _unique_bytes(dense) > 2 * file_tensor_bytes
    assert all(t.device.type == "cpu" for t in [*kept.parameters(), *kept.buffers()])
    attn = kept.model.layers[1].self_attn
    assert isinstance(attn.q_a_proj, Q.FP8BlockLinear) and attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        for length in (8, 40):  # activation-scaled (decode-sized) and tile-scaled FP8 products
            ids = torch.randint(2, 97, (1, length), generator=torch.Generator().manual_seed(length))
            # the ops multiply the packed weights in their own summation order: fp32 rounding apart
            torch.testing.assert_close(kept(ids), dense(ids), rtol=1e-4, atol=1e-4)
