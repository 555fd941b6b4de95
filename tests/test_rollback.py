"""`Rollback` (cache.py): a forward of T tokens with `undo=`, then `apply(keep)`, leaves each
sequence exactly as a forward of only its first keep tokens would (every tensor of the cache:
rings, open windows, overlaps, compressed rows, positions), for every keep 0..T, at positions
crossing window ends and the sliding window, in a batch with a different keep per sequence; the
MTP layer's cache the same; and apply() can be repeated with a smaller keep."""

from __future__ import annotations

import pytest
import torch

from ds4_torch import DS4Config, DS4ForCausalLM
from ds4_torch.cache import Rollback, zero_stale_slots
from oracle import randomise
from test_speculative import SMALL

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    m = DS4ForCausalLM(DS4Config.from_dict(SMALL))
    randomise(m, 5)
    return m.eval()


def canonical(cache, mtp=False):
    """Every tensor of the cache, with the slots no step reads (ring slots not yet filled, open
    window slots past the position) zeroed per sequence: what must match."""
    c = cache.mtp if mtp else cache
    out = []
    for b in range(c.batch_size):
        views = c._sequence_views(b, c.max_context)
        state = {k: v.clone() for k, v in views.items()}
        zero_stale_slots(c.config, state, state["position"])
        out.append(state)
    for layer in c.layers:  # every row, the scratch row aside: rows past the count must be zero
        for s in layer.states:
            out.append({"rows": s.rows[:, :-1].clone()})
    return out


def assert_same(a, b, atol=0.0):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], atol=atol, rtol=0, msg=k)


@torch.no_grad()
@pytest.mark.parametrize("T", [1, 2, 4])
def test_apply_keeps_the_first_tokens_exactly(model, T):
    g = torch.Generator().manual_seed(T)
    B, ctx = 3, 40
    prompts = [torch.randint(0, 64, (1, n), generator=g) for n in (5, 6, 11)]  # rates 2 and 3, window 5
    for step in range(6):
        new = torch.randint(0, 64, (B, T), generator=g)
        keep = torch.tensor([(step + b) % (T + 1) for b in range(B)])
        # reference: each sequence alone, fed only its first keep tokens
        ref = model.new_cache(B, ctx)
        got = model.new_cache(B, ctx)
        for b, p in enumerate(prompts):
            for cache in (ref, got):
                model._forward(p, cache.slot(b))
                if step:
                    model._forward(torch.randint(0, 64, (1, step), generator=torch.Generator().manual_seed(b)),
                                   cache.slot(b))
        for b in range(B):
            if int(keep[b]):
                model._forward(new[b:b + 1, :int(keep[b])], ref.slot(b))
        undo = Rollback()
        model._forward(new, got, logits_to_keep=1, undo=undo)
        undo.apply(keep)
        assert torch.equal(got.positions, ref.positions)
        # chunked and one-token forwards round alike to ~1e-6 (the verify path is a chunk)
        assert_same(canonical(got), canonical(ref), atol=1e-5)
        for smaller in reversed(range(int(keep.min()) + 1)):  # apply again, keeping fewer, down to none
            undo.apply(torch.full((B,), smaller))
        ref2 = model.new_cache(B, ctx)
        for b, p in enumerate(prompts):
            model._forward(p, ref2.slot(b))
            if step:
                model._forward(torch.randint(0, 64, (1, step), generator=torch.Generator().manual_seed(b)),
                               ref2.slot(b))
        assert_same(canonical(got), canonical(ref2), atol=1e-5)


@torch.no_grad()
def test_mtp_cache_rolls_back_and_a_chain_of_one_token_forwards_unwinds(model):
    """The MTP layer (CSA here) takes the same undo: a chunk kept in part, then a chain of
    one-token drafts (each with its own record) undone in reverse: exactly the state before."""
    g = torch.Generator().manual_seed(0)
    B, ctx, H, n = 2, 40, model.config.hidden_size, model.config.hc_mult
    for start in (3, 4, 5, 8):
        cache, ref = model.new_cache(B, ctx), model.new_cache(B, ctx)
        streams = torch.randn(B, start + 6, n, H, generator=g)
        ids = torch.randint(0, 64, (B, start + 6), generator=g)
        for c in (cache, ref):
            model.mtp_forward(streams[:, :start], ids[:, :start], c)
        keep = torch.tensor([1, 3])
        undo = Rollback()
        model.mtp_forward(streams[:, start:start + 3], ids[:, start:start + 3], cache, undo=undo)
        undo.apply(keep)
        for b in range(B):
            model.mtp_forward(streams[b:b + 1, start:start + int(keep[b])], ids[b:b + 1, start:start + int(keep[b])],
                              ref.slot(b))
        assert_same(canonical(cache, mtp=True), canonical(ref, mtp=True), atol=1e-5)
        before = canonical(cache, mtp=True)
        undos = []
        for k in range(3):
            undos.append(Rollback())
            model.mtp_forward(streams[:, k:k + 1], ids[:, k:k + 1], cache, undo=undos[-1])
        for u in reversed(undos):
            u.apply(torch.zeros(B, dtype=torch.long))
        assert_same(canonical(cache, mtp=True), before)
