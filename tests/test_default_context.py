"""`serve`'s default `--ctx`: the model's maximum when the caches fit in half of the memory left
after the weights, else the largest that fits; and the footprint functions it rests on."""
from __future__ import annotations

import logging

import pytest
import torch

from ds4_torch.cache import DS4Cache
from ds4_torch.config import DS4Config
from ds4_torch.default_model import DEFAULT_MODEL_DIR
from ds4_torch.footprint import cache_bytes, fitting_context, free_memory
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


class _Model:  # what choose_context reads of a model
    def __init__(self, config):
        self.config, self.device, self.dtype = config, torch.device("cpu"), torch.float32


def test_serve_default_ctx_from_memory(config, monkeypatch, caplog):
    model = _Model(config)
    slots = 16 + 8  # default sessions max(8, 16) + 8 batch slots
    need = cache_bytes(config, 65536, slots, torch.float32)
    monkeypatch.setattr("ds4_torch.footprint.free_memory", lambda device: 2 * need + 10)
    with caplog.at_level(logging.INFO, logger="ds4.serve"):
        assert cli.choose_context(model, None, 8) == 65536
    assert "--ctx 65536 (the model's maximum)" in caplog.text and "16 sessions + 8 batch slots" in caplog.text

    monkeypatch.setattr("ds4_torch.footprint.free_memory", lambda device: need)  # half of it: less than the max
    ctx = cli.choose_context(model, None, 8)
    assert ctx == fitting_context(config, torch.float32, slots, need // 2) and ctx < 65536
    assert cache_bytes(config, ctx, slots, torch.float32) <= need // 2

    # --max-sessions counts: 100 sessions (and 16 batch slots for --max-batch 9) get a shorter context
    assert cli.choose_context(model, 100, 9) == fitting_context(config, torch.float32, 116, need // 2) < ctx

    monkeypatch.setattr("ds4_torch.footprint.free_memory", lambda device: 1000)
    with pytest.raises(UserError, match="do not fit .* lower --max-sessions"):
        cli.choose_context(model, None, 8)


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
