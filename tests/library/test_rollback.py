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


@torch.no_grad()
@pytest.mark.parametrize("T", [2, 4])
def test_a_paged_cache_rolls_back_as_the_static_one(model, T):
    """The same forwards with undo and applies over a static and a paged cache (blocks of 6
    tokens: steps cross them) leave the same states bit for bit, the tables holding exactly the
    kept tokens; a later apply (a trim) after the sequence was forked, which shares the block the
    cleared rows are in, leaves the fork as it was; the kept tokens' blocks are registered once
    final."""
    from ds4_torch.paged import PagedDS4Cache
    from test_paged import assert_slots_follow_tables

    g = torch.Generator().manual_seed(10 + T)
    B, ctx, bt = 3, 60, 6
    static, paged = model.new_cache(B, ctx), PagedDS4Cache(model.config, B, ctx, block_tokens=bt)
    prompt = torch.randint(0, 64, (B, 7), generator=g)
    history = prompt.tolist()
    for c in (static, paged):
        model(prompt, c)
    copied_and_cleared = 0

    def same():
        assert paged.positions.tolist() == static.positions.tolist() == [len(h) for h in history]
        assert_slots_follow_tables(paged)
        for b in range(B):
            assert paged.table(b).tokens == history[b]
            got, want = paged.export_sequence(b), static.export_sequence(b)
            assert all(torch.equal(got[k], want[k]) for k in want), b

    for step in range(8):
        new = torch.randint(0, 64, (B, T), generator=g)
        keep = torch.tensor([(step + b) % (T + 1) for b in range(B)])
        undo, before = {}, [len(h) for h in history]
        for c in (static, paged):
            c.take_tokens(new, tentative=True)
            undo[c] = Rollback()
            model._forward(new, c, logits_to_keep=1, undo=undo[c])
            undo[c].apply(keep)
        for b in range(B):
            k = int(keep[b])
            paged.drop_tokens(b, T - k)
            paged.name_tokens(b, new[b, :k].tolist())
            history[b] += new[b, :k].tolist()
            # registered: the blocks full before the step (final), not those it filled (a trim may clear rows there)
            assert len(paged.table(b).digests) == before[b] // bt
        same()
        if int(keep[0]) and step % 2:  # sequence 2 becomes a fork of 0, then 0 gives back its last token
            for c in (static, paged):
                c.copy_sequence(2, 0)
            history[2] = list(history[0])
            trim = torch.tensor([int(keep[0]) - 1, -1, -1])
            paged.drop_tokens(0, 1)
            n = len(history[0]) - 1
            if n % bt:  # the block it now ends in was the fork's too: copied, so the apply clears only its own
                assert paged.table(0).blocks[-1] != paged.table(2).blocks[-1]
                copied_and_cleared += (n + 1) % 2 == 0 or (n + 1) % 3 == 0  # the dropped token closed a row
            for c in (static, paged):
                undo[c].apply(trim)
            history[0].pop()
            same()
    assert copied_and_cleared
    for b in range(B):
        paged.commit_tokens(b)  # the tokens are final: every full block registered
        assert len(paged.table(b).digests) == len(history[b]) // bt
    assert len(paged.pool.lookup(history[1])) == len(history[1]) // bt
