"""The static cache: counters and rows at every emit phase, exact size, overflow."""

from __future__ import annotations

import math

import pytest
import torch

from ds4_torch import DS4ForCausalLM
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


def expected_nbytes(cfg, batch, context, elem):
    total = 8 * batch
    W, D, dI = cfg.sliding_window, cfg.head_dim, cfg.index_head_dim
    for kind in cfg.layer_types:
        total += elem * batch * W * D
        if kind == HCA:
            m = cfg.compress_rates[HCA]
            total += elem * batch * ((math.ceil(context / m) + 1) * D + 2 * m * D)
        elif kind == CSA:
            m = cfg.compress_rates[CSA]
            C = math.ceil(context / m) + 1
            total += elem * batch * (C * D + 2 * m * 2 * D + 2 * m * D + C * dI + 2 * m * 2 * dI + 2 * m * dI)
    return total


@pytest.mark.parametrize("batch,context,dtype", [(1, 64, torch.float32), (3, 1000, torch.bfloat16),
                                                 (2, 4097, torch.float16)])
def test_nbytes_formula(pair, batch, context, dtype):
    _, ours = pair
    cache = ours.new_cache(batch, context, dtype=dtype)
    assert cache.nbytes == expected_nbytes(ours.config, batch, context, torch.finfo(dtype).bits // 8)


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
