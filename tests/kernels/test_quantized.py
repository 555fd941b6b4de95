"""`ds4::fp8_linear` and the FP4 unpacking (kernels/quantized.py, kernels/triton_quantized.py)
against the dense product on weights dequantized by tests/ckpt_utils' own reference
(`fp8_reference`, `fp4_quantize`'s exact values), in float64.

Tolerances: fp32 within 1e-5 of the output's largest magnitude; bf16 within 2^-7 of it (the op
rounds its inputs' products once per block of 128 rows, the dense reference once).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from ckpt_utils import fp4_quantize, fp8_quantize, fp8_reference
from ds4_torch import quant as Q
from ds4_torch.kernels import cpu_linear, quantized

TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


def assert_near(got, want, dtype):
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= TOL[dtype] * scale, f"{dtype}: max error {err:.3g} against output magnitude {scale:.3g}"


# (R, K, scale format): partial blocks on both edges, a block-aligned square, one row block
SHAPES = [(300, 200, "float32"), (256, 384, "e8m0"), (130, 129, "uint8"), (64, 128, "e8m0")]


@pytest.mark.parametrize("backend", ["torch", "torch-small-tiles", "triton"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}-{s[2]}")
@torch.no_grad()
def test_fp8_linear_matches_dense_product(shape, backend, monkeypatch):
    """Decode-sized (scales on the activations) and prefill-sized (scales on the tiles) inputs,
    2-D and 3-D, fp32 and bf16; "small-tiles": the torch loop over several 128-row tiles."""
    R, K, fmt = shape
    if backend == "torch-small-tiles":
        monkeypatch.setattr(quantized, "FP8_TILE_ELEMENTS", 128 * K)
        monkeypatch.setattr(quantized, "FP8_PREFILL_TILE_ELEMENTS", 128 * K)
        backend = "torch"
    g = torch.Generator().manual_seed(R + K)
    q, s = fp8_quantize(torch.randn(R, K, generator=g), fmt)
    dense = fp8_reference(q, s).double()
    for lead in ((1,), (5,), (2, 20)):
        x = torch.randn(*lead, K, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            got = quantized.fp8_linear(xd, q, s, 128, 128, backend)
            assert got.dtype == dtype and got.shape == (*lead, R)
            assert_near(got, xd.double() @ dense.T, dtype)


@torch.no_grad()
def test_fp8_linear_large_scales_and_other_blocks():
    """Scales of 2^9 and more (the tile path applies 2^120 in two steps) and 32x32 blocks."""
    g = torch.Generator().manual_seed(1)
    q, s = fp8_quantize(torch.randn(100, 70, generator=g) * 1e5, "e8m0")
    assert s.float().max() >= 2 ** 8
    x = torch.randn(40, 70, generator=g)
    assert_near(quantized.fp8_linear(x, q, s, 128, 128, "torch"), x.double() @ fp8_reference(q, s).double().T,
                torch.float32)
    q, s = fp8_quantize(torch.randn(100, 70, generator=g), "e8m0", block=32)  # 32x32 blocks, partial edges
    dense = fp8_reference(q, s, block=32).double()
    for n in (1, 40):
        x = torch.randn(n, 70, generator=g)
        assert_near(quantized.fp8_linear(x, q, s, 32, 32, "torch"), x.double() @ dense.T, torch.float32)


def test_fp8_linear_errors_name_the_problem():
    q, s = fp8_quantize(torch.randn(130, 129))
    x = torch.randn(2, 129)
    with pytest.raises(ValueError, match=r"scale must be \[2, 2\]"):
        quantized.fp8_linear(x, q, s[:1], 128, 128, "auto")
    with pytest.raises(ValueError, match="last dim 129"):
        quantized.fp8_linear(x[:, :5], q, s, 128, 128, "auto")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        quantized.fp8_linear(x, q.float(), s, 128, 128, "auto")


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_fp8_linear_passes_opcheck(backend):
    q, s = fp8_quantize(torch.randn(130, 129))
    # test_schema is left out: torch's schema checker cannot compare float8 tensors ("mul" is
    # not implemented for Float8_e4m3fn); test_op_does_not_mutate_its_inputs covers it here.
    torch.library.opcheck(torch.ops.ds4.fp8_linear.default, (torch.randn(3, 129), q, s, 128, 128, backend),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@torch.no_grad()
def test_grouped_fp8_linear_is_fp8_linear_group_by_group(backend):
    """ds4::fp8_linear_grouped: group g of x through its own block rows, as ds4::fp8_linear on
    them (decode rows on a CPU take one native call for all groups; "triton" the kernel group by
    group), decode and prefill sizes; it passes opcheck and names a misaligned group."""
    G, R, K = 3, 256, 200
    g = torch.Generator().manual_seed(8)
    q, s = fp8_quantize(torch.randn(G * R, K, generator=g), "e8m0")
    for lead in ((1,), (2, 20)):
        x = torch.randn(*lead, G, K, generator=g)
        got = torch.ops.ds4.fp8_linear_grouped(x, q, s, 128, 128, backend)
        assert got.shape == (*lead, G, R)
        for j in range(G):
            want = quantized.fp8_linear(x[..., j, :], q[j * R:(j + 1) * R], s[j * 2:(j + 1) * 2], 128, 128, backend)
            torch.testing.assert_close(got[..., j, :], want, rtol=0, atol=1e-6 * want.abs().max().item())
    torch.library.opcheck(torch.ops.ds4.fp8_linear_grouped.default, (torch.randn(2, G, K), q, s, 128, 128, backend),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    with pytest.raises(ValueError, match="block border"):
        torch.ops.ds4.fp8_linear_grouped(torch.randn(2, 4, K), q[:4 * 100], s, 128, 128, backend)


def test_op_does_not_mutate_its_inputs():
    q, s = fp8_quantize(torch.randn(130, 129), "uint8")
    x = torch.randn(3, 129)
    before = [t.clone() for t in (x, q.view(torch.uint8), s)]
    out = quantized.fp8_linear(x, q, s, 128, 128, "auto")
    assert all(torch.equal(a, b) for a, b in zip(before, (x, q.view(torch.uint8), s)))
    assert out.data_ptr() not in {x.data_ptr(), q.data_ptr(), s.data_ptr()}


@torch.no_grad()
def test_fp4_linear_over_several_tiles(monkeypatch):
    """quantized_linear on FP4 rows, tile by tile (5 rows a tile, 48 rows): the dense product."""
    g = torch.Generator().manual_seed(4)
    packed, scale, exact = fp4_quantize(torch.randn(48, 96, generator=g))
    monkeypatch.setattr(quantized, "FP4_TILE_ELEMENTS", 5 * 96)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 96, generator=g).to(dtype)
        assert_near(quantized.quantized_linear(x, packed, scale, (1, 32)), x.double() @ exact.double().T, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["e8m0", "uint8", "float32"])
def test_fp4_rows_unpack_exactly(fmt, dtype):
    """The (exponent, byte) lookup gives bit-for-bit what quant.dequantize_fp4 gives (float32
    scales go through the plain formula)."""
    g = torch.Generator().manual_seed(2)
    packed, scale, exact = fp4_quantize(torch.randn(48, 96, generator=g) * 3, fmt)
    got = quantized.dequantize_fp4_rows(packed, scale, dtype)
    assert torch.equal(got, Q.dequantize(packed, scale, dtype))
    assert torch.equal(got, exact.to(dtype))


@torch.no_grad()
def test_grouped_fp8_projection_matches_grouped_linear():
    """attention's wo_a kept in FP8: each group of x through its own block rows of the weight."""
    from ds4_torch.model import GroupedLinear

    g = torch.Generator().manual_seed(3)
    groups, in_per_group, rows = 4, 96, 128
    dense = GroupedLinear(in_per_group, groups * rows, groups)
    q, s = fp8_quantize(torch.randn(groups * rows, in_per_group, generator=g), "e8m0")
    dense.weight.copy_(fp8_reference(q, s))
    kept = Q.FP8BlockLinear.from_linear(dense, scale_shape=s.shape)
    kept.weight.copy_(q)
    kept.weight_scale_inv.copy_(s)
    assert kept.groups == groups
    x = torch.randn(3, 2, groups, in_per_group, generator=g)
    assert_near(kept(x), dense.double()(x.double()), torch.float32)
    with pytest.raises(ValueError, match="block border"):
        Q.FP8BlockLinear(in_per_group, groups * 100, groups=groups)


# --------------------------------------------------------------------------- whole models
def small_config():
    """One CSA layer whose linears span whole and partial 128x128 blocks and whose wo_a groups
    (2 x 128 rows) start on block borders; 8 experts."""
    from ds4_torch.config import CSA, DS4Config

    return DS4Config(vocab_size=300, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=8, head_dim=64, qk_rope_head_dim=16, q_lora_rank=128, o_groups=2,
                     o_lora_rank=128, sliding_window=8, layer_types=(CSA,), index_n_heads=8, index_head_dim=32,
                     index_topk=4, mlp_layer_types=("moe",), n_routed_experts=8, num_experts_per_tok=2, hc_mult=2)


@pytest.fixture(scope="module")
def upstream_checkpoint(tmp_path_factory):
    """`bench quant`'s writer at small sizes: upstream names, FP8 linears (e8m0 128x128, wo_a's
    two groups of 128 rows on block borders), FP4 experts, bf16 rest."""
    from ds4_torch.bench.quant import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("upstream"), small_config())


@torch.no_grad()
def test_keep_and_dequantized_models_agree(upstream_checkpoint):
    """The upstream-layout checkpoint loads both ways; keep holds FP8/FP4 (wo_a included) and
    gives the dequantized model's logits (fp32) over a prefill and decode steps."""
    from safetensors import safe_open

    from ds4_torch.model import DS4ForCausalLM

    with safe_open(str(next(upstream_checkpoint.glob("model-layer-*.safetensors"))), "pt") as f:
        names = set(f.keys())
    assert {"layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale", "layers.0.attn.wo_a.scale",
            "layers.0.ffn.experts.7.w3.weight", "layers.0.ffn.experts.7.w3.scale"} <= names
    kept = DS4ForCausalLM.from_pretrained(upstream_checkpoint, quantized="keep")
    dense = DS4ForCausalLM.from_pretrained(upstream_checkpoint, quantized="dequantize")
    attn = kept.model.layers[0].self_attn
    assert isinstance(attn.o_a_proj, Q.FP8BlockLinear) and attn.o_a_proj.groups == 2
    assert isinstance(kept.model.layers[0].mlp.experts, Q.FP4Experts)
    ids = torch.randint(2, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    caches = [m.new_cache(1, 32) for m in (kept, dense)]
    for chunk in (ids[:, :17], ids[:, 17:18], ids[:, 18:19], ids[:, 19:]):
        got, want = (m(chunk, cache=c) for m, c in zip((kept, dense), caches))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_info_reports_the_bytes_a_keep_load_holds(upstream_checkpoint, capsys):
    """`info --quantized keep` (headers only) against the tensors a real keep load allocates;
    --tp 2 per device; --memory-gb's verdict on both sides of the need."""
    import re

    from ds4_torch.cli import main
    from ds4_torch.model import DS4ForCausalLM

    kept = DS4ForCausalLM.from_pretrained(upstream_checkpoint, dtype=torch.bfloat16, quantized="keep")
    held = sum(t.nbytes for t in {id(t): t for t in [*kept.parameters(), *kept.buffers()]}.values())

    def info(*extra):
        assert main(["info", "--model", str(upstream_checkpoint), "--dtype", "bfloat16", *extra]) == 0
        out = capsys.readouterr().out
        return int(re.search(r"weights held \S* \S*, \S*, --tp \d+\): ([\d,]+) bytes", out)[1].replace(",", "")), out

    got, out = info("--quantized", "keep")
    assert got == held
    dequantized, _ = info()
    assert dequantized > 1.5 * held
    per_device, _ = info("--quantized", "keep", "--tp", "2")
    assert held / 2 < per_device < held
    need = held + kept.new_cache(1, 4096).nbytes
    for factor, verdict in ((1.01, "yes"), (0.99, "no")):
        out = info("--quantized", "keep", "--memory-gb", str(need / 2**30 * factor))[1]
        assert re.search(r"fits in [\d.]+ GiB per device: (yes|no) ", out)[1] == verdict


# A stand-in llama.cpp build (tests must not need the real one, a 20-minute build): a source tree
# with llama.cpp's converter entry point, `conversion.base` and `gguf-py`, and build/bin/llama-bench,
# found through build/CMakeCache.txt as a real out-of-tree build is. The converter checks what
# `bench quant` hands it and writes a tensor list; llama-bench logs its arguments and answers in
# its `-o json` shape, refusing to run without `--repack 0` (as a CPU with AMX does on deepseek4).
FAKE_CONVERTER = """
import json, sys
from pathlib import Path
hf, out = Path(sys.argv[1]), Path(sys.argv[sys.argv.index("--outfile") + 1])
config = json.loads((hf / "config.json").read_text())
assert {"compress_ratios", "qk_rope_head_dim", "num_hash_layers"} <= set(config), config
assert (hf / "tokenizer.json").is_file() and any(hf.glob("*.safetensors"))
experts = config["n_routed_experts"]
out.write_text(json.dumps([["token_embd.weight", 10 ** 6, [4, 4]], ["output.weight", 3000, [4, 4]],
                           ["blk.0.ffn_up_exps.weight", 100 * experts, [4, 4, experts]]]))
"""
FAKE_GGUF = """
import json
class _Tensor:
    def __init__(self, name, n_bytes, shape):
        self.name, self.n_bytes, self.shape = name, n_bytes, shape
class GGUFReader:
    def __init__(self, path):
        self.tensors = [_Tensor(*t) for t in json.loads(open(path).read())]
"""
FAKE_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps(args) + "\\n")
if "--repack" not in args:
    sys.exit("GGML_ASSERT(*cur_backend_id != -1) failed")
get = lambda flag: int(args[args.index(flag) + 1])
t, p, n = get("-t"), get("-p"), get("-n")
print(json.dumps([{{"n_prompt": p, "n_gen": 0, "avg_ts": 100.0 * t}}, {{"n_prompt": 0, "n_gen": n, "avg_ts": 40.0 * t}}]))
"""


def fake_llama_cpp(root):
    import os
    import sys

    source, build = root / "llama.cpp", root / "build"
    (source / "conversion").mkdir(parents=True)
    (source / "conversion" / "__init__.py").write_text("")
    (source / "conversion" / "base.py").write_text("class TextModel:\n    pass\n")
    (source / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    (source / "gguf-py" / "gguf").mkdir(parents=True)
    (source / "gguf-py" / "gguf" / "__init__.py").write_text(FAKE_GGUF)
    (build / "bin").mkdir(parents=True)
    (build / "CMakeCache.txt").write_text(f"CMAKE_BUILD_TYPE:STRING=Release\nCMAKE_HOME_DIRECTORY:INTERNAL={source}\n")
    bench = build / "bin" / "llama-bench"
    bench.write_text(FAKE_BENCH.format(python=sys.executable, log=str(root / "calls.jsonl")))
    os.chmod(bench, 0o755)
    return build


def test_bench_quant_times_both_modes_and_llama_cpp(upstream_checkpoint, capsys, tmp_path):
    """`bench quant --model DIR --threads 1 2 --llama-cpp BUILD` end to end (each mode in a child
    process): our two modes and llama.cpp at both thread counts with the same prompt and new
    tokens, llama.cpp's converted GGUF's decode bytes (top-k of its experts), every row's weight
    GB/s and its fraction of this run's one- and all-thread read bandwidth, the CSV."""
    import csv
    import json
    import os

    from ds4_torch.cli import main

    build = fake_llama_cpp(tmp_path / "llama")
    table = tmp_path / "quant.csv"
    assert main(["bench", "quant", "--model", str(upstream_checkpoint), "--prompt-len", "8", "--new-tokens", "3",
                 "--repeats", "1", "--threads", "1", "2", "--llama-cpp", str(build), "--csv", str(table)]) == 0
    out = capsys.readouterr().out
    assert "same greedy tokens: yes at 1 thread, yes at 2 threads" in out and "keep / llama.cpp: decode" in out and "--repack 0" in out
    rows = {(r["quantized"], int(r["threads"])): r for r in csv.DictReader(table.open())}
    assert set(rows) == {(impl, t) for impl in ("keep", "dequantize", "llama.cpp") for t in (1, 2)}
    keep, dense = rows[("keep", 1)], rows[("dequantize", 1)]
    assert float(keep["layer_bytes_per_parameter"]) < 0.5 * float(dense["layer_bytes_per_parameter"])
    # a decode step reads fewer weight bytes kept: everything but the embedding, top-k experts a layer
    assert 0 < int(keep["decode_weight_bytes"]) < int(dense["decode_weight_bytes"])
    top_k = small_config().num_experts_per_tok
    for t in (1, 2):
        peer = rows[("llama.cpp", t)]
        assert float(peer["decode_ms_per_token"]) == pytest.approx(1e3 / (40.0 * t))
        assert float(peer["prefill_tokens_per_s"]) == pytest.approx(100.0 * t)
        assert int(peer["decode_weight_bytes"]) == 3000 + 100 * top_k  # not the embedding; top-k experts
    for r in rows.values():
        weight_gb_s = int(r["decode_weight_bytes"]) / float(r["decode_ms_per_token"]) / 1e6
        assert float(r["weight_gb_s"]) == pytest.approx(weight_gb_s)
        for key in ("1_thread", "all_threads"):
            assert float(r[f"of_read_{key}"]) == pytest.approx(weight_gb_s / float(r[f"read_gb_s_{key}"]))
    assert f"of {os.cpu_count()}T read" in out
    calls = [json.loads(line) for line in (tmp_path / "llama" / "calls.jsonl").read_text().splitlines()]
    timed = [c for c in calls if "--repack" in c and c[c.index("-p") + 1] == "8"]
    assert sorted(c[c.index("-t") + 1] for c in timed) == ["1", "2"]
    assert all(c[c.index("-n") + 1] == "3" for c in timed)


def test_bench_quant_without_llama_cpp_says_so(tmp_path, monkeypatch):
    """No build on PATH, or a --llama-cpp path without one: why llama.cpp is not timed (our modes
    are timed alone)."""
    import os

    from ds4_torch.bench import llama_cpp

    monkeypatch.setenv("PATH", os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                                               if not (os.path.isdir(d) and "llama-bench" in os.listdir(d))))
    assert llama_cpp.find(None) == (None, "no llama.cpp build: pass --llama-cpp PATH or put llama-bench on PATH "
                                          "(docs/performance.md)")
    found, why = llama_cpp.find(str(tmp_path))
    assert found is None and why.startswith(f"no llama-bench at {tmp_path}")
    build = fake_llama_cpp(tmp_path / "llama")
    (build / "CMakeCache.txt").unlink()  # a binary whose source cannot be found: no converter
    found, why = llama_cpp.find(str(build))
    assert found is None and "convert_hf_to_gguf.py" in why


@torch.no_grad()
def test_keep_model_decodes_the_same_in_every_decode_mode(upstream_checkpoint, monkeypatch):
    """The reused unpack buffers serve a first call under inference_mode (eager generate) and
    later ones outside it (the graph path's tracing): same greedy tokens as eager."""
    from ds4_torch.generation import generate
    from ds4_torch.model import DS4ForCausalLM

    monkeypatch.setattr(quantized, "_thread_buffers", threading.local())  # first made by the eager run below
    monkeypatch.setattr(quantized, "_fp4_tables", {})

    kept = DS4ForCausalLM.from_pretrained(upstream_checkpoint, quantized="keep")
    prompt = [5, 6, 7, 8, 9, 10]
    eager = list(generate(kept, prompt, 10, decode_mode="eager"))
    assert list(generate(kept, prompt, 10, decode_mode="graph")) == eager


@torch.no_grad()
def test_expert_parallel_ranks_unpack_only_their_selected_experts(monkeypatch):
    """Two ranks of an expert-parallel split (parallel.py's id remapping, each holding 4 of 8 FP4
    experts): each unpacks exactly the experts it owns that a token selected, no padding reads of
    expert 0, and the two partial outputs sum to the whole layer's."""
    from types import SimpleNamespace

    from ds4_torch.kernels import moe as moe_module
    from ds4_torch.model import Experts
    from ds4_torch.parallel import _experts_owned

    E, H, I = 8, 64, 32
    g = torch.Generator().manual_seed(5)
    dense = [torch.randn(E, 2 * I, H, generator=g) / 8, torch.randn(E, H, I, generator=g) / 6]
    packed = [[fp4_quantize(w[e]) for e in range(E)] for w in dense]
    (gu, gus, _), (dn, dns, _) = ([torch.stack([q[i] for q in qs]) for i in range(3)] for qs in packed)

    def experts(first, count):
        module = Experts(SimpleNamespace(hidden_size=H, moe_intermediate_size=I, n_routed_experts=count,
                                         swiglu_limit=10.0))
        sl = slice(first, first + count)
        Q.FP4Experts.convert_(module, gu[sl], gus[sl], dn[sl], dns[sl], split_gate_up=True)
        if count < E:
            module.register_forward_pre_hook(_experts_owned(first, count))
        return module

    unpacked = []
    original = moe_module.expert_gate_up
    monkeypatch.setattr(moe_module, "expert_gate_up", lambda x, w, s: unpacked.append(w.data_ptr()) or original(x, w, s))
    grouped = cpu_linear.fp4_linear_groups  # a few tokens an expert: the selected experts in one call

    def grouped_spy(xs, stack, scale, chosen):
        out = grouped(xs, stack, scale, chosen)
        if out is not None and stack.shape[-1] == H // 2:  # the gate_up projection (its inputs: H)
            unpacked.extend(stack[e].data_ptr() for e in chosen)
        return out

    monkeypatch.setattr(cpu_linear, "fp4_linear_groups", grouped_spy)
    flat = torch.randn(3, H, generator=g)
    ids = torch.tensor([[0, 5], [1, 0], [6, 5]])
    weights = torch.rand(3, 2, generator=g)
    whole = experts(0, E)(flat, ids, weights)
    total = torch.zeros_like(whole)
    for rank, owned in enumerate(({0, 1}, {5, 6})):
        unpacked.clear()
        total += experts(4 * rank, 4)(flat, ids, weights)
        assert sorted(unpacked) == sorted(gu[e].data_ptr() for e in owned), rank
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)
