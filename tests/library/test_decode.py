"""Eager vs graph decode (the graph path on CPU is the make_fx capture emulator)."""

from __future__ import annotations

import time

import pytest
import torch

from ds4_torch import DS4Config, DS4ForCausalLM
from ds4_torch import capabilities
from ds4_torch.decode import GraphDecoder, choose_mode, emulate_capture, make_decoder, prefill

CHUNK = 8  # prefill chunk: smaller than the prompts, so chunk boundaries are crossed
from ds4_torch.faults import InjectedDeviceError, parse_faults, reset_fault_counts
from oracle import randomise

SMALL = dict(
    vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
    head_dim=16, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8,
    sliding_window=5,  # small window: over sixty ring wraps in 320 steps
    layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 3},
    mlp_layer_types=["hash_moe", "moe", "moe"], index_n_heads=8, index_head_dim=8, index_topk=3,
    n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=5,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 128},
)


@pytest.fixture(scope="module")
def model():
    m = DS4ForCausalLM(DS4Config.from_dict(SMALL))
    randomise(m, 3)
    return m.eval()


@torch.no_grad()
def greedy(decoder, first_logits, steps):
    tokens, logits = [], [first_logits]
    nxt = first_logits.argmax(-1)
    for _ in range(steps):
        tokens.append(nxt)
        out = decoder.step(nxt)
        logits.append(out)
        nxt = out.argmax(-1)
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@pytest.mark.parametrize("prompt_len", [1, 23])  # 23 > window (5) and > prefill chunk (8)
@torch.no_grad()
def test_graph_equals_eager_over_320_steps(model, prompt_len):
    steps = 320
    ids = torch.randint(2, 64, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    results = {}
    for mode in ("eager", "graph"):
        cache = model.new_cache(1, prompt_len + steps)  # the last step fills the cache exactly
        decoder = make_decoder(model, cache, mode)
        assert decoder.mode == mode
        results[mode] = greedy(decoder, prefill(model, cache, ids, CHUNK), steps)
        assert cache.positions.tolist() == [prompt_len + steps]
        with pytest.raises(ValueError, match="cache is full"):  # capacity edge: refused, not replayed
            decoder.step(torch.tensor([3]))
        assert cache.positions.tolist() == [prompt_len + steps]
    assert torch.equal(results["eager"][0], results["graph"][0])
    assert (results["eager"][1] - results["graph"][1]).abs().max().item() <= 1e-5
    # The run crossed what it should: window fill and many ring wraps, every emit phase of both
    # rates, the first compressed row, indexer activation (visible rows > top-k).
    total = prompt_len + steps
    assert total > 60 * SMALL["sliding_window"]
    assert total // 2 > SMALL["index_topk"] and total // 3 > 100


@torch.no_grad()
@pytest.mark.parametrize("kv_rows", ["full", "fp8-keep-rope"])  # fp8: quantized and dequantized in the graph
def test_batch_of_three_at_staggered_positions(model, kv_rows):
    prompt_lens, steps = (2, 9, 17), 40
    caches = {}
    for mode in ("eager", "graph"):
        cache = model.new_cache(3, 80, kv_rows=kv_rows)
        first = []
        for i, n in enumerate(prompt_lens):
            single = model.new_cache(1, 80, kv_rows=kv_rows)
            ids = torch.randint(2, 64, (1, n), generator=torch.Generator().manual_seed(n))
            first.append(prefill(model, single, ids, CHUNK))
            cache.copy_sequence(i, 0, single)
        caches[mode] = greedy(make_decoder(model, cache, mode), torch.cat(first), steps)
    assert torch.equal(caches["eager"][0], caches["graph"][0])
    assert (caches["eager"][1] - caches["graph"][1]).abs().max().item() <= 1e-5


@torch.no_grad()
def test_emulator_catches_a_position_frozen_at_capture(model, monkeypatch):
    """A deliberately broken step whose rope position comes from host-side bookkeeping (a Python
    int) instead of the cache's position tensor: right in eager, frozen by a capture. The emulator
    must show the divergence, as a CUDA graph would."""
    rotary = model.model.rotary_compress
    original = type(rotary).forward
    host = {"position": 0}  # what a buggy engine would track on the host

    def host_positions(self, positions, dtype):
        return original(self, torch.arange(positions.shape[-1]).expand_as(positions) + host["position"], dtype)

    ids = torch.randint(2, 64, (1, 7), generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in ("eager", "graph"):
        cache = model.new_cache(1, 40)
        first = prefill(model, cache, ids, CHUNK)
        monkeypatch.setattr(type(rotary), "forward", host_positions)
        decoder, nxt, logits = make_decoder(model, cache, mode), first.argmax(-1), []
        for step in range(10):
            host["position"] = 7 + step
            logits.append(decoder.step(nxt))
            nxt = logits[-1].argmax(-1)
        monkeypatch.setattr(type(rotary), "forward", original)
        out[mode] = torch.stack(logits)
    assert torch.equal(out["eager"][0], out["graph"][0])  # the captured step itself agrees
    assert (out["eager"] - out["graph"]).abs().max().item() > 1e-3  # later replays do not


def test_emulator_refuses_tensor_reads_during_capture(model, monkeypatch):
    """Reading a tensor's value into Python inside the step (an .item() or int()) cannot be
    captured: it fails at capture time instead of silently baking the value."""
    rotary = model.model.rotary_compress
    original = type(rotary).forward

    def reads_item(self, positions, dtype):
        return original(self, positions + int(positions.reshape(-1)[0]) * 0, dtype)

    monkeypatch.setattr(type(rotary), "forward", reads_item)
    decoder = make_decoder(model, model.new_cache(1, 8), "graph")
    with pytest.raises(RuntimeError):
        decoder.step(torch.tensor([3]))


@torch.no_grad()
def test_injected_decode_failure_recovers(model, monkeypatch):
    ids = torch.randint(2, 64, (1, 6), generator=torch.Generator().manual_seed(1))

    def run(mode):
        cache = model.new_cache(1, 40)
        return greedy(make_decoder(model, cache, mode), prefill(model, cache, ids, CHUNK), 12)

    fresh = run("eager")
    for mode, kind, exc in (("graph", "device", InjectedDeviceError), ("eager", "oom", torch.OutOfMemoryError)):
        reset_fault_counts()
        monkeypatch.setenv("DS4_TORCH_FAULT", f"decode:5:{kind}")
        cache = model.new_cache(1, 40)
        decoder = make_decoder(model, cache, mode)
        with pytest.raises(exc):
            greedy(decoder, prefill(model, cache, ids, CHUNK), 12)
        if mode == "graph":
            assert decoder.graphs == {}  # captured graphs dropped
        with pytest.raises(RuntimeError, match="invalidated"):
            decoder.step(torch.tensor([3]))
        with pytest.raises(RuntimeError, match="invalidated"):
            model(torch.tensor([[3]]), cache=cache)
        cache.reset()
        again = greedy(decoder, prefill(model, cache, ids, CHUNK), 12)
        assert torch.equal(again[0], fresh[0]) and torch.equal(again[1], fresh[1])
        monkeypatch.delenv("DS4_TORCH_FAULT")


def test_always_faults_keep_failing(model, monkeypatch):
    reset_fault_counts()
    monkeypatch.setenv("DS4_TORCH_FAULT", "decode:2:device:always")
    cache = model.new_cache(1, 10)
    decoder = make_decoder(model, cache, "eager")
    decoder.step(torch.tensor([3]))
    for _ in range(3):
        with pytest.raises(InjectedDeviceError):
            decoder.step(torch.tensor([3]))
        cache.reset()


@pytest.mark.parametrize("spec,message", [("decode", "SITE:N"), ("sample:1", "unknown site"),
                                          ("decode:0", "occurrence"), ("decode:x", "occurrence"),
                                          ("decode:1:gpu", "unknown kind"), ("decode:1:oom:never", "always")])
def test_fault_spec_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_faults(spec)


def test_a_slow_fault_takes_its_time_and_raises_nothing(monkeypatch):
    from ds4_torch.faults import fault_point

    monkeypatch.setenv("DS4_TORCH_FAULT", "submit:2:slow")
    monkeypatch.setenv("DS4_TORCH_FAULT_SLOW_S", "0.3")
    reset_fault_counts()
    took = []
    for _ in range(3):
        t0 = time.perf_counter()
        fault_point("submit")
        took.append(time.perf_counter() - t0)
    assert took[1] >= 0.3 and took[0] < 0.1 and took[2] < 0.1


def test_modes_and_capabilities(model, monkeypatch):
    cache = model.new_cache(1, 8)
    caps = capabilities("cpu")
    assert not caps.cuda_graphs and caps.cuda_graphs.reason and caps.compile
    assert make_decoder(model, cache, "auto").mode == "eager"  # no CUDA graphs on CPU
    mode, why = choose_mode("cpu")
    assert mode == "eager" and "CUDA graphs" in why and "compile" in why  # auto says why
    assert isinstance(make_decoder(model, cache, "graph"), GraphDecoder)
    assert make_decoder(model, cache, "compile").mode == "compile"  # compiles at its first step
    monkeypatch.setenv("DS4_TORCH_DECODE_MODE", "graph")
    assert make_decoder(model, cache, "eager").mode == "graph"
    monkeypatch.setenv("DS4_TORCH_DECODE_MODE", "turbo")
    with pytest.raises(ValueError, match="turbo"):
        make_decoder(model, cache)
    monkeypatch.delenv("DS4_TORCH_DECODE_MODE")
    with pytest.raises(ValueError, match=r"shape \[batch\]"):
        make_decoder(model, cache, "eager").step(torch.tensor([[1]]))


@torch.no_grad()
@pytest.mark.parametrize("mode", ["graph", "compile"])
def test_a_paged_cache_decodes_as_the_static_one(model, mode, monkeypatch):
    """Decoders over a paged cache (blocks of 6 tokens) and a static one, the same steps: logits
    bit for bit while sequences take new blocks after the capture (the slot map is rewritten in
    place, and the graph reads it), with a padding row whose table stays empty, a sequence reset
    and prefilled again, and a fork between steps. Compile mode through dynamo and AOT autograd
    (`aot_eager`: the graph inductor gets, without its minutes of C++ builds here)."""
    from ds4_torch.paged import PagedDS4Cache

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "aot_eager"}))
    torch._dynamo.reset()

    B, ctx, bt = 4, 64, 6
    static, paged = model.new_cache(B, ctx), PagedDS4Cache(model.config, B, ctx, block_tokens=bt)
    caches = (static, paged)
    decoders = [make_decoder(model, c, mode, scratch_padding=True) for c in caches]
    g = torch.Generator().manual_seed(4)

    def fill(b, n):
        ids = torch.randint(2, 64, (1, n), generator=g)
        for c in caches:
            prefill(model, c.slot(b), ids, CHUNK)

    for b, n in enumerate((2, 9, 17)):
        fill(b, n)
    steps, held = 18 if mode == "graph" else 12, None
    for step in range(steps):
        if step == steps // 3:  # a sequence ends; another one starts in its slot
            for c in caches:
                c.reset(1)
            fill(1, 5)
        if step == 2 * steps // 3:  # sequence 2 continues from where sequence 0 stands
            static.copy_sequence(2, 0)
            paged.fork(2, 0)
            assert paged.table(2).blocks == paged.table(0).blocks
        ids = torch.randint(2, 64, (3,), generator=g)  # three rows: a graph runs four, the last a padding row
        want, got = (d.step(ids) for d in decoders)
        assert torch.equal(got, want), f"step {step}: {(got - want).abs().max()}"
        assert paged.positions[:3].tolist() == [t.num_tokens for t in paged.tables[:3]]
        held = held or len(paged.table(0).blocks)  # at the capture
    assert paged.table(3).blocks == [] and len(paged.table(0).blocks) > held
    if mode == "graph":
        assert list(decoders[1].graphs) == [4] and decoders[1].eager_fallbacks == 0


def test_the_emulator_drops_node_values_in_its_own_trace_only():
    """The capture emulator's trace records no per-node values (no compiler reads them), and
    replays the function; a make_fx after it (torch.compile's, say) still gets every node's value."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.arange(4.0)
    emulated = emulate_capture(lambda t: (t * 2).sum(), [x])
    assert torch.equal(emulated(x + 1), ((x + 1) * 2).sum())
    assert all(n.meta.get("val") is None for n in emulated.graph.nodes)
    traced = make_fx(lambda t: (t * 2).sum())(x)
    assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in traced.graph.nodes if n.op != "output")


def test_graph_steps_equal_eager_where_autograd_records(model):
    """Steps called with autograd on (a notebook or script without no_grad): a capture traced
    under autograd used to replay other logits at batch 1 (off by 1.7 on this model at once)."""
    assert torch.is_grad_enabled()
    ids = torch.randint(2, 64, (1, 6), generator=torch.Generator().manual_seed(4))
    eager_cache, graph_cache = model.new_cache(1, 128), model.new_cache(1, 128)
    eager, graph = make_decoder(model, eager_cache, "eager"), make_decoder(model, graph_cache, "graph")
    for t in range(6):
        torch.testing.assert_close(graph.step(ids[:, t]), eager.step(ids[:, t]), atol=1e-5, rtol=0)
