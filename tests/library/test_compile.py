"""torch.compile(model, fullgraph=True): no graph breaks, no recompiles across decode boundaries."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from ds4_torch import DS4Config, DS4ForCausalLM
from ds4_torch.decode import make_decoder
from oracle import randomise
from test_decode import SMALL


@pytest.fixture()
def model():
    torch._dynamo.reset()
    counters.clear()
    m = DS4ForCausalLM(DS4Config.from_dict(SMALL))
    randomise(m, 5)
    return m.eval()


@torch.no_grad()
def test_inductor_decode_compiles_at_most_twice(model):
    """48 decode steps through the `compile` decode mode cross window fill (5), nine ring wraps,
    every emit phase of both rates (2 and 3), the first compressed rows and indexer activation
    (> 3 visible CSA rows, from step 8): one compiled graph serves all, and each step's logits are
    eager's."""
    ids = torch.randint(2, 64, (1, 49), generator=torch.Generator().manual_seed(1))
    eager_cache, compiled_cache = model.new_cache(1, 256), model.new_cache(1, 256)
    eager, compiled = make_decoder(model, eager_cache, "eager"), make_decoder(model, compiled_cache, "compile")
    assert compiled.mode == "compile"
    worst = 0.0
    for t in range(49):
        step = ids[:, t]
        worst = max(worst, (compiled.step(step) - eager.step(step)).abs().max().item())
    assert worst <= 1e-5
    assert torch.equal(compiled_cache.positions, eager_cache.positions)
    assert counters["stats"]["unique_graphs"] <= 2
    assert not counters["graph_break"]


@torch.no_grad()
def test_prefill_chunks_and_decode_have_no_graph_break(model):
    """Chunked prefill (chunks of several sizes) then decode, traced whole by dynamo (aot_eager:
    the same graph capture as inductor without the C++ build)."""
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = torch.randint(2, 64, (2, 40), generator=torch.Generator().manual_seed(2))
    eager_cache, compiled_cache = model.new_cache(2, 48), model.new_cache(2, 48)
    for a, b in ((0, 7), (7, 20), (20, 33)) + tuple((t, t + 1) for t in range(33, 40)):
        got = compiled(ids[:, a:b], cache=compiled_cache)
        want = model(ids[:, a:b], cache=eager_cache)
        assert (got - want).abs().max().item() <= 1e-5
    assert not counters["graph_break"]
