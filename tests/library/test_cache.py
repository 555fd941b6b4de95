"""The static cache: counters and rows at every emit phase, exact size, overflow."""

from __future__ import annotations

import math

import pytest
import torch

from ds4_torch import DS4ForCausalLM
from ds4_torch.cache import DS4Cache
from ds4_torch.config import CSA, HCA, SLIDING
from oracle import make_oracle


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf, path = make_oracle(tmp_path_factory.mktemp("cache"), seed=7)
    return hf, DS4ForCausalLM.from_pretrained(path)


@torch.no_grad()
def test_counters_and_rows_at_every_emit_phase(pair):
    """Token by token across 3 windows of the largest rate: after every step the position, the
    compressed-row counts and the rows themselves (compressor and indexer) equal transformers'
    cache; rows not yet emitted stay zero; the ring holds the last W rows."""
    from transformers import DynamicCache

    hf, ours = pair
    cfg = ours.config
    steps = 3 * cfg.compress_rates[HCA] + 1
    ids = torch.randint(2, cfg.vocab_size, (1, steps), generator=torch.Generator().manual_seed(5))
    hf_cache = DynamicCache(config=hf.config)
    cache = ours.new_cache(1, 64)
    for t in range(steps):
        hf(ids[:, t:t + 1], past_key_values=hf_cache, use_cache=True)
        ours(ids[:, t:t + 1], cache=cache)
        assert cache.positions.tolist() == [t + 1]
        for i, (layer, hf_layer) in enumerate(zip(cache.layers, hf_cache.layers)):
            if layer.kind == SLIDING:
                assert int(cache.compressed_counts(i)[0]) == 0
                continue
            m = cfg.compress_rates[layer.kind]
            count = int(cache.compressed_counts(i)[0])
            assert count == (t + 1) // m == hf_layer.entry_count["compressor"]
            states = [("compressor", layer.compressor)] + ([("indexer", layer.indexer)] if layer.kind == CSA else [])
            for name, state in states:
                capacity = state.rows.shape[1] - 1
                assert capacity == math.ceil(64 / m)
                if count:
                    expected = hf_layer.compressed_kv[name][0]
                    assert (state.rows[0, :count] - expected).abs().max() <= 1e-5, (t, i, name)
                assert not state.rows[0, count:capacity].any(), f"row past the count written at t={t}"
        # ring: the newest min(t+1, W) positions, slot q % W
        W = cfg.sliding_window
        hf_window = hf_cache.layers[0].keys[0, 0]  # HF keeps the last W-1 rows, newest last
        for k in range(1, min(t + 1, W - 1) + 1):
            q = t + 1 - k
            assert torch.allclose(cache.layers[0].window[0, q % W], hf_window[-k], atol=1e-6)


def expected_nbytes(cfg, batch, context, elem, kv_rows="full"):
    """The module docstring's formula: a stored row of d channels takes R(d, r) bytes."""
    def R(d, r):
        return elem * d if kv_rows == "full" else (d - r) + math.ceil((d - r) / 64) + elem * r

    r = cfg.qk_rope_head_dim if kv_rows == "fp8-keep-rope" else 0
    total = 8 * batch
    W, D, dI = cfg.sliding_window, cfg.head_dim, cfg.index_head_dim
    for kind in cfg.layer_types:
        total += elem * batch * W * D
        if kind == HCA:
            m = cfg.compress_rates[HCA]
            total += batch * ((math.ceil(context / m) + 1) * R(D, r) + elem * 2 * m * D)
        elif kind == CSA:
            m = cfg.compress_rates[CSA]
            C = math.ceil(context / m) + 1
            total += batch * (C * R(D, r) + elem * (2 * m * 2 * D + 2 * m * D)
                              + C * R(dI, 0) + elem * (2 * m * 2 * dI + 2 * m * dI))
    return total


@pytest.mark.parametrize("batch,context,dtype", [(1, 64, torch.float32), (3, 1000, torch.bfloat16),
                                                 (2, 4097, torch.float16)])
@pytest.mark.parametrize("kv_rows", ["full", "fp8", "fp8-keep-rope"])
def test_nbytes_formula(pair, batch, context, dtype, kv_rows):
    _, ours = pair
    cache = ours.new_cache(batch, context, dtype=dtype, kv_rows=kv_rows)
    assert cache.nbytes == expected_nbytes(ours.config, batch, context, torch.finfo(dtype).bits // 8, kv_rows)


@torch.no_grad()
def test_shapes_never_change(pair):
    _, ours = pair
    cache = ours.new_cache(2, 40)
    before = [(t.shape, t.data_ptr()) for t in cache.tensors()]
    ids = torch.randint(2, 100, (2, 40))
    for a, b in ((0, 13), (13, 14), (14, 31), (31, 40)):
        ours(ids[:, a:b], cache=cache)
    assert [(t.shape, t.data_ptr()) for t in cache.tensors()] == before


@torch.no_grad()
def test_overflow_raises_and_leaves_cache_unchanged(pair):
    _, ours = pair
    cache = ours.new_cache(1, 20)
    ids = torch.randint(2, 100, (1, 25))
    ours(ids[:, :18], cache=cache)
    snapshot = [t.clone() for t in cache.tensors()]
    with pytest.raises(ValueError, match="max_context 20"):
        ours(ids[:, 18:21], cache=cache)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, cache.tensors()))
    ours(ids[:, 18:20], cache=cache)  # exactly filling it is fine
    assert cache.positions.tolist() == [20]
    with pytest.raises(ValueError, match="cache is full"):
        ours(ids[:, 20:21], cache=cache)


@torch.no_grad()
def test_reset_gives_a_fresh_cache(pair):
    _, ours = pair
    ids = torch.randint(2, 100, (1, 30))
    cache = ours.new_cache(1, 32)
    first = ours(ids, cache=cache)
    cache.reset()
    assert torch.equal(ours(ids, cache=cache), first)


def test_bad_inputs(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="batch"):
        ours(torch.zeros(2, 3, dtype=torch.long), cache=ours.new_cache(1, 8))
    with pytest.raises(ValueError, match="input_ids"):
        ours(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_context"):
        ours.new_cache(1, 0)


# --------------------------------------------------------------------------- one sequence's state
def slot_tensors(cache, index):
    """Every tensor of sequence `index`, whole (scratch rows and stale slots included)."""
    return [t[index].clone() for t in cache.tensors()]


@torch.no_grad()
def feed(model, tokens, tail, max_context=64):
    """A batch-1 cache fed `tokens`, the last `tail` one at a time (so open windows hold stale
    slots from earlier windows)."""
    cache = model.new_cache(1, max_context)
    head = len(tokens) - tail
    model(torch.tensor([tokens[:head]]), cache=cache)
    for t in tokens[head:]:
        model(torch.tensor([[t]]), cache=cache)
    return cache


@pytest.mark.parametrize("n,tail", [(3, 0), (21, 7), (37, 3)])
@torch.no_grad()
def test_export_import_continues_like_the_original(pair, n, tail):
    """3 tokens: no window closed (CSA overlap gates -inf); 21 and 37: ring wrapped, rows of both
    rates, open windows part-filled with stale slots. The original cache continuing is the
    reference: an import into another cache continues bit for bit; an import, a copy from the
    original and a copy within the batch, into slots of a batch cache (another max_context, a
    neighbour at another position), within 1e-5."""
    _, model = pair
    gen = torch.Generator().manual_seed(n)
    tokens = torch.randint(2, 100, (n,), generator=gen).tolist()
    follow = torch.randint(2, 100, (12,), generator=gen).tolist()
    original = feed(model, tokens, tail)
    state = original.export_sequence(0)

    alone = model.new_cache(1, 64)
    alone.import_sequence(0, state)
    batch = model.new_cache(4, 52)
    batch.copy_sequence(2, 0, feed(model, torch.randint(2, 100, (29,), generator=gen).tolist(), 2))
    neighbour = slot_tensors(batch, 2)
    batch.import_sequence(1, state)
    batch.copy_sequence(0, 0, original)
    batch.copy_sequence(3, 1)
    assert batch.positions.tolist() == [n, n, 29, n]
    assert all(torch.equal(a, b) for a, b in zip(slot_tensors(batch, 2), neighbour))

    for t in follow:
        want = model(torch.tensor([[t]]), cache=original)[0, -1]
        assert torch.equal(model(torch.tensor([[t]]), cache=alone)[0, -1], want)
        got = model(torch.tensor([[t], [t], [5], [t]]), cache=batch)[[0, 1, 3], -1]
        assert (got - want).abs().max() <= 1e-5


def expected_export_bytes(cfg, n, elem):
    """Bytes of one sequence's state after n tokens, from the layout alone."""
    total = 8
    W, D, dI = cfg.sliding_window, cfg.head_dim, cfg.index_head_dim
    for kind in cfg.layer_types:
        total += elem * W * D
        if kind == HCA:
            m = cfg.compress_rates[HCA]
            total += elem * ((n // m) * D + 2 * m * D)
        elif kind == CSA:
            m = cfg.compress_rates[CSA]
            total += elem * ((n // m) * D + 2 * m * 2 * D + 2 * m * D + (n // m) * dI + 2 * m * 2 * dI + 2 * m * dI)
    return total


@torch.no_grad()
def test_export_size_follows_tokens_not_max_context(pair):
    _, model = pair
    ids = torch.randint(2, 100, (1, 30), generator=torch.Generator().manual_seed(3))
    sizes = {}
    for ctx in (32, 4000):
        for n in (9, 30):
            cache = model.new_cache(1, ctx)
            model(ids[:, :n], cache=cache)
            state = cache.export_sequence(0)
            assert [(k, v.dtype, tuple(v.shape)) for k, v in state.items()] == cache.sequence_spec(n)
            sizes[ctx, n] = sum(t.numel() * t.element_size() for t in state.values())
            assert sizes[ctx, n] == expected_export_bytes(model.config, n, 4)
    assert sizes[32, 9] == sizes[4000, 9] < sizes[32, 30] == sizes[4000, 30]


def with_edits(state, **edits):
    """A copy of `state` with `edits` applied: a tensor replaced, or removed when None."""
    out = dict(state)
    for k, v in edits.items():
        if v is None:
            del out[k]
        else:
            out[k] = v
    return out


@torch.no_grad()
def test_import_rejects_a_mismatched_state_and_writes_nothing(pair):
    _, model = pair
    cache = model.new_cache(2, 32)
    model(torch.randint(2, 100, (2, 13), generator=torch.Generator().manual_seed(4)), cache=cache)
    good = cache.export_sequence(1)
    before = [t.clone() for t in cache.tensors()]

    def changed(**edits):
        return with_edits(good, **edits)

    cases = [
        (changed(**{"layers.1.compressor.rows": None}), "layers.1.compressor.rows"),
        (changed(**{"layers.9.window": good["layers.0.window"]}), "layers.9.window"),
        (changed(**{"layers.0.window": good["layers.0.window"].double()}), "layers.0.window"),
        (changed(**{"layers.3.indexer.open_gate": good["layers.3.indexer.open_gate"][:-1]}), "layers.3.indexer"),
        (changed(position=torch.tensor(16)), "layers.1.compressor.rows"),    # 16 // 4 rows, 13 // 4 given
        (changed(position=torch.tensor(33)), "max_context"),
        (changed(position=torch.tensor([13])), "position"),
        (changed(position=torch.tensor(13, dtype=torch.int32)), "position"),
    ]
    for state, name in cases:
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            cache.import_sequence(0, state)
        assert all(torch.equal(a, b) for a, b in zip(cache.tensors(), before))
    other = DS4Cache(model.config.replace(sliding_window=5), 1, 32)
    with pytest.raises(ValueError, match="same config"):
        other.copy_sequence(0, 1, cache)
    with pytest.raises(ValueError, match="window"):
        other.import_sequence(0, good)


@torch.no_grad()
def test_import_leaves_no_stale_rows(pair):
    """A slot that held a longer sequence, or was invalidated with rows written past its count,
    ends up exactly as a fresh slot importing the same state."""
    _, model = pair
    ids = torch.randint(2, 100, (2, 40), generator=torch.Generator().manual_seed(6))
    source = model.new_cache(1, 64)
    model(ids[:1, :9], cache=source)
    state = source.export_sequence(0)
    fresh = model.new_cache(1, 64)
    fresh.import_sequence(0, state)

    longer = model.new_cache(1, 64)
    model(ids[1:, :40], cache=longer)
    longer.import_sequence(0, state)
    assert all(torch.equal(a, b) for a, b in zip(slot_tensors(longer, 0), slot_tensors(fresh, 0)))

    broken = model.new_cache(1, 64)
    model(ids[1:, :4], cache=broken)
    for layer in broken.layers:
        for s in layer.states:
            s.rows[0].fill_(7.0)  # what a step failing half-way could leave past the count
    broken.invalidate([0])
    broken.import_sequence(0, state)
    assert not broken.invalid
    assert all(torch.equal(a, b) for a, b in zip(slot_tensors(broken, 0), slot_tensors(fresh, 0)))
    broken.invalidate([0])
    with pytest.raises(RuntimeError, match="invalidated"):
        broken.export_sequence(0)
