"""`serve`'s default KV pool and `--ctx`: the pool takes half of the memory left after the weights
(at most what every slot at --ctx would hold), --ctx is the model's maximum at most what the pool
holds for one request; and the footprint functions they rest on."""
from __future__ import annotations

import logging

import pytest
import torch

from ds4_torch.cache import DS4Cache
from ds4_torch.config import DS4Config
from ds4_torch.default_model import DEFAULT_MODEL_DIR
from ds4_torch.footprint import cache_bytes, fitting_context, free_memory
from ds4_torch.paged import PagedDS4Cache, block_nbytes
from ds4_torch.runtime import UserError
from serve import cli


@pytest.fixture(scope="module")
def config():
    return DS4Config.from_pretrained(DEFAULT_MODEL_DIR).replace(max_position_embeddings=65536)


@pytest.mark.parametrize("context,sequences,dtype", [(4096, 1, torch.float32), (5000, 3, torch.bfloat16),
                                                     (65536, 2, torch.float32)])
def test_cache_bytes_are_what_a_cache_allocates(config, context, sequences, dtype):
    assert cache_bytes(config, context, sequences, dtype) == DS4Cache(config, sequences, context, dtype=dtype).nbytes


def test_fitting_context_is_the_maximum_when_it_fits_else_the_largest_granule_that_does(config):
    full = cache_bytes(config, 65536, 24, torch.float32)
    assert fitting_context(config, torch.float32, 24, full) == 65536
    for budget in (full - 1, full // 3, cache_bytes(config, 9 * 1024, 24, torch.float32)):
        ctx = fitting_context(config, torch.float32, 24, budget)
        assert ctx % 1024 == 0 and 0 < ctx < 65536
        assert cache_bytes(config, ctx, 24, torch.float32) <= budget < cache_bytes(config, ctx + 1024, 24,
                                                                                   torch.float32)
    assert fitting_context(config, torch.float32, 24, cache_bytes(config, 1024, 24, torch.float32) - 1) == 0


def test_free_memory_on_a_cpu_is_positive_and_at_most_the_machine():
    import os

    free = free_memory("cpu")
    assert 0 < free <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class _Model:  # what choose_kv_pool reads of a model
    def __init__(self, config):
        self.config, self.device, self.dtype = config, torch.device("cpu"), torch.float32


def test_a_blocks_bytes_are_what_a_pool_allocates(config):
    for dtype, bt in ((torch.float32, 256), (torch.bfloat16, 64)):
        cache = PagedDS4Cache(config, 2, 1024, dtype=dtype, num_blocks=5, block_tokens=bt)
        assert block_nbytes(config, dtype, bt) == cache.block_nbytes
        rows = sum(s.rows.numel() * s.rows.element_size() for layer in cache.layers for s in layer.states)
        per_scratch_row = sum(s.rows[-1].numel() * s.rows.element_size() for layer in cache.layers for s in layer.states)
        assert rows == 5 * cache.block_nbytes + per_scratch_row


def test_serve_default_kv_pool_from_memory(config, monkeypatch, caplog):
    model = _Model(config)
    slots = 16 + 8  # default sessions max(8, 16) + 8 batch slots
    block = block_nbytes(config, torch.float32, 256)
    every_slot = slots * 65536 // 256  # blocks of every slot at the model's maximum: the most the default takes
    monkeypatch.setattr("ds4_torch.footprint.free_memory", lambda device: 10 * every_slot * block)
    with caplog.at_level(logging.INFO, logger="ds4.serve"):
        mb, ctx = cli.choose_kv_pool(model, None, None, 8, None, 256)
    assert (mb * 2**20 / block, ctx) == (every_slot, 65536)
    assert "--ctx 65536 per request (the model's maximum)" in caplog.text
    # an explicit --ctx sizes the default pool for it
    mb, ctx = cli.choose_kv_pool(model, 1000, None, 8, None, 256)
    assert (mb * 2**20 / block, ctx) == (slots * 4, 1000)

    # less memory: half of it, less the slots' own state, in whole blocks; one request gets all but one block
    monkeypatch.setattr("ds4_torch.footprint.free_memory", lambda device: every_slot * block)
    mb, ctx = cli.choose_kv_pool(model, None, None, 8, None, 256)
    blocks = mb * 2**20 / block
    # a slot's own state, as a cache allocates it: one more sequence's bytes
    per_slot = (PagedDS4Cache(config, 2, 65536, num_blocks=1).nbytes - PagedDS4Cache(config, 1, 65536, num_blocks=1).nbytes)
    assert blocks == (every_slot * block // 2 - slots * per_slot) // block
    assert ctx == 65536  # (the pool still holds far more than one request)
    monkeypatch.setattr("ds4_torch.footprint.free_memory", lambda device: 2 * slots * per_slot + 2 * 100 * block)
    assert cli.choose_kv_pool(model, None, None, 8, None, 256) == (100 * block / 2**20, 99 * 256)

    # an explicit --kv-cache-mb: a --ctx past what it holds is lowered, and says so
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds4.serve"):
        assert cli.choose_kv_pool(model, 60000, None, 8, 40 * block / 2**20, 256) == (40 * block / 2**20, 39 * 256)
    assert "--ctx 60000 lowered to 9984" in caplog.text

    monkeypatch.setattr("ds4_torch.footprint.free_memory", lambda device: 1000)
    with pytest.raises(UserError, match="does not fit .* lower --max-sessions"):
        cli.choose_kv_pool(model, None, None, 8, None, 256)
    with pytest.raises(UserError, match="at least 2 are needed"):
        cli.choose_kv_pool(model, None, None, 8, block / 2**20, 256)


def test_serve_loads_with_the_default_ctx_and_explicit_ctx_still_wins(monkeypatch):
    args = cli.build_parser().parse_args([])
    assert args.ctx is None
    _, _, server_config = cli.load(args)
    assert server_config.ctx == DS4Config.from_pretrained(DEFAULT_MODEL_DIR).max_position_embeddings
    args = cli.build_parser().parse_args(["--ctx", "1000"])
    assert cli.load(args)[2].ctx == 1000


@torch.no_grad()
def test_a_large_cache_reads_only_visible_rows_and_gives_the_same_logits():
    """Eager CPU steps read the compressed rows some sequence can see; the graph path (traced:
    every row, masked) is the independent reference, at a context past several row bounds."""
    from ds4_torch.decode import make_decoder, prefill
    from ds4_torch.model import DS4ForCausalLM

    model = DS4ForCausalLM.from_pretrained(DEFAULT_MODEL_DIR)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, model.config.vocab_size, (2, 1100), generator=g)
    caches = [model.new_cache(2, 4096) for _ in range(2)]
    for cache in caches:
        prefill(model, cache, prompt, chunk=300)
    eager, graph = make_decoder(model, caches[0], "eager"), make_decoder(model, caches[1], "graph")
    tokens = torch.tensor([5, 9])
    for _ in range(6):
        a, b = eager.step(tokens), graph.step(tokens)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        tokens = a.argmax(-1)


def test_bench_context(tmp_path, capsys):
    import csv

    from ds4_torch.cli import main

    table = tmp_path / "context.csv"
    assert main(["bench", "context", "--contexts", "64", "700", "--ctx", "2048", "--new-tokens", "3",
                 "--csv", str(table)]) == 0
    rows = list(csv.DictReader(table.open()))
    assert [int(r["context"]) for r in rows] == [64, 700]
    assert all(float(r["prefill_tok_s"]) > 0 and float(r["decode_tok_s"]) > 0 for r in rows)
    assert "decode at 700 / at 64" in capsys.readouterr().out
    assert main(["bench", "context", "--contexts", "2047", "--ctx", "2048", "--new-tokens", "3"]) == 2
    assert "does not fit the cache" in capsys.readouterr().err
