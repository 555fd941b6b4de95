"""`ds4::moe` (kernels/moe.py, kernels/triton_moe.py) and the model's `Experts` against a plain
per-token, per-expert loop written here (float64).

Tolerances as in test_kernels.py: fp32 <= 1e-5 absolute on outputs of magnitude ~1; bf16/fp16
within 8 ulps (relative, 1 absolute floor) of the float64 loop on the same rounded inputs.

The Triton kernels run under the interpreter here (conftest sets TRITON_INTERPRET=1). Two checks
need triton without the interpreter, so they run this file as a child process with the variable
unset: the sm_80/sm_90 compile (no GPU needed) and the native CUDA run (skipped without a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ds4_torch.kernels import cpu_linear
from ds4_torch.kernels import moe as moe_module  # registers torch.ops.ds4.moe
from helpers import assert_close

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LIMIT = 1.5  # small enough that the clamps bite on many entries


# --------------------------------------------------------------------------- the independent loop
def loop_reference(hidden, expert_ids, routing_weights, gate_up, down, limit):
    """out[n] = sum_j w[n,j] * down[e] @ (silu(min(g, L)) * clamp(u, -L, L)), (g|u) = gate_up[e] @ x[n],
    e = ids[n, j]; a pair with e outside [0, E) adds nothing. float64; the weight is rounded to
    the input dtype first, as the model multiplies in that dtype."""
    N, H = hidden.shape
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.zeros(N, H, dtype=torch.float64)
    w = routing_weights.to(hidden.dtype).double()
    for n in range(N):
        x = hidden[n].double()
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[n, j])
            if not 0 <= e < E:
                continue
            projected = gate_up[e].double() @ x
            gate, up = projected[:I], projected[I:]
            h = gate.clamp(max=limit) * torch.sigmoid(gate.clamp(max=limit)) * up.clamp(-limit, limit)
            out[n] += w[n, j] * (down[e].double() @ h)
    return out


def make_inputs(N, k, E, H, I, seed, dtype=torch.float32, ids=None):
    """Inputs with outputs of magnitude ~1 and gates large enough to hit both clamps."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * (2.0 / H ** 0.5)
    down = torch.randn(E, H, I, generator=g) / I ** 0.5
    if ids is None:  # k distinct experts per token, as a top-k router picks them
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]) if N else torch.zeros(0, k)
    weights = torch.rand(N, k, generator=g) + 0.1
    return (hidden.to(dtype), ids.long(), weights.to(dtype), gate_up.to(dtype), down.to(dtype))


def ids_with_repeats(N, k, E, seed):
    """Every token draws from experts {0, 1}, or from the first k: few experts, many repeats."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(max(k, 2), generator=g)[:k] for _ in range(N)]) % E


# (name, N, k, E, H, I, ids: None = k distinct random experts per token)
CASES = [
    ("decode_top6", 1, 6, 8, 80, 48, None),
    ("decode_top1", 1, 1, 4, 64, 32, None),
    ("decode_batch_repeated_experts", 7, 3, 4, 64, 48, "repeats"),
    ("token_picks_one_expert_twice", 3, 2, 4, 48, 32, torch.tensor([[1, 1], [2, 1], [3, 3]])),
    ("unused_experts_and_no_expert", 5, 4, 16, 64, 32, torch.tensor(
        [[0, 3, -1, 5], [5, -1, -1, 0], [16, 3, 2, 1], [-1, -1, -1, -1], [7, 0, 3, 99]])),
    ("prefill_300_top6_few_experts", 300, 6, 8, 80, 48, None),  # Triton BLOCK_M 64
    ("prefill_300_top5_many_experts", 300, 5, 64, 64, 32, None),  # BLOCK_M 32
    ("prefill_40_top2", 40, 2, 16, 64, 48, None),  # BLOCK_M 16, several blocks per expert
    ("no_tokens", 0, 4, 4, 32, 32, None),
]


def case_inputs(case, dtype=torch.float32, seed=0):
    name, N, k, E, H, I, ids = case
    if isinstance(ids, str):
        ids = ids_with_repeats(N, k, E, seed)
    return make_inputs(N, k, E, H, I, seed, dtype, ids)


def test_cases_cover_what_they_claim():
    hidden, ids, weights, gate_up, down = case_inputs(CASES[0])
    projected = torch.einsum("nh,eih->nei", hidden, gate_up)
    assert (projected > LIMIT).any() and (projected < -LIMIT).any()  # both clamps bite
    repeated = case_inputs(CASES[2])[1]
    assert repeated.unique().numel() < repeated.numel()
    prefill = case_inputs(CASES[6])[1]
    assert prefill.unique().numel() == 64 and (torch.bincount(prefill.view(-1)) > 16).any()
    assert {c[2] for c in CASES} == {1, 2, 3, 4, 5, 6}  # k = 1..6


# --------------------------------------------------------------------------- the op vs the loop
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_op_matches_loop_fp32(case, backend):
    args = case_inputs(case)
    got = torch.ops.ds4.moe(*args, LIMIT, backend)
    assert_close(got, loop_reference(*args, LIMIT), torch.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4], CASES[5], CASES[6]], ids=lambda c: c[0])
def test_op_low_precision_within_ulps_of_fp32(case, dtype, backend):
    args = case_inputs(case, dtype)
    got = torch.ops.ds4.moe(*args, LIMIT, backend)
    assert_close(got, loop_reference(*args, LIMIT), dtype)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_torch_loop_and_grouped_paths_both_match_loop(case, monkeypatch):
    """`moe_torch` multiplies small expert groups with one grouped product per projection when
    most experts are hit, and loops over the hit experts otherwise: both must give the loop's
    result, ids outside [0, E) included (the rule itself: the test below)."""
    args = case_inputs(case)
    name, N, k, E, H, I, _ = case
    want = loop_reference(*args, LIMIT)
    for limit in (0, 1 << 40):  # never / always when most experts are hit
        monkeypatch.setattr(moe_module, "GROUPED_MAX_PAIRS_PER_EXPERT", limit)
        assert_close(moe_module.moe_torch(*args, LIMIT), want, torch.float32)
    if N * k >= E:
        assert_close(moe_module.moe_grouped(*case_inputs(case, torch.bfloat16), LIMIT),
                     loop_reference(*case_inputs(case, torch.bfloat16), LIMIT), torch.bfloat16)


def test_grouped_path_with_every_pair_invalid_or_one_expert():
    """Edge groups: every pair on one expert (the other groups empty), and every id outside
    [0, E) (nothing to add: zeros)."""
    g = torch.Generator().manual_seed(5)
    N, k, E, H, I = 6, 2, 4, 16, 8
    hidden = torch.randn(N, H, generator=g)
    weights = torch.rand(N, k, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3
    one = torch.full((N, k), 2, dtype=torch.int64)
    assert_close(moe_module.moe_grouped(hidden, one, weights, gate_up, down, LIMIT),
                 loop_reference(hidden, one, weights, gate_up, down, LIMIT), torch.float32)
    none = torch.tensor([[-1, E]] * N)
    assert torch.equal(moe_module.moe_grouped(hidden, none, weights, gate_up, down, LIMIT), torch.zeros(N, H))


def test_small_decode_batches_take_the_grouped_path():
    """The embedded model's sizes: an 8- to 64-row decode step on a CPU runs one grouped product
    per projection (no per-expert loop, no host sync); a lone row, a prefill chunk and a GPU
    loop (or run the Triton kernels)."""
    cpu = torch.device("cpu")
    assert moe_module._grouped_pays(16, 2, 8, cpu) and moe_module._grouped_pays(64, 2, 8, cpu)
    assert not moe_module._grouped_pays(1, 2, 8, cpu)
    assert not moe_module._grouped_pays(256, 2, 8, cpu)
    assert not moe_module._grouped_pays(16, 2, 8, torch.device("mps"))
    assert not moe_module._grouped_pays(16, 2, 8, cpu, torch.float64)  # (the grouped product has no float64)


def test_op_does_not_mutate_or_alias_inputs():
    for backend in ("torch", "triton"):
        args = case_inputs(CASES[4])
        before = [a.clone() for a in args]
        out = torch.ops.ds4.moe(*args, LIMIT, backend)
        assert all(torch.equal(a, b) for a, b in zip(args, before))
        assert all(out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr() for a in args)


def test_weights_are_read_in_place_not_copied(monkeypatch):
    """The torch path multiplies by views of the selected experts: no gathered copy of the set."""
    hidden, ids, weights, gate_up, down = case_inputs(CASES[5])
    seen = []

    def spy_linear(x, weight):
        seen.append(weight)
        return F.linear(x, weight)

    monkeypatch.setattr(moe_module, "_linear", spy_linear)
    moe_module.moe_torch(hidden, ids, weights, gate_up, down, LIMIT)
    assert len(seen) == 2 * ids.unique().numel()  # each hit expert once: gate_up, then down
    for w in seen:
        assert w.untyped_storage().data_ptr() in (gate_up.untyped_storage().data_ptr(),
                                                  down.untyped_storage().data_ptr())


def test_cpu_linear_fast_paths_compute_the_product():
    """`_linear` swaps kernels by shape (one bf16 row as two, big fp32 row blocks on oneDNN): each
    still computes x @ w.T, and autograd still flows (it then takes F.linear)."""
    from ds4_torch.kernels.linear import ONEDNN_LINEAR as _ONEDNN_LINEAR, fastest_linear as _linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) / 8
    for rows, dtype in ((1, torch.bfloat16), (1, torch.float32), (6, torch.float32), (6, torch.bfloat16)):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        assert_close(_linear(x, w.to(dtype)), x.double() @ w.to(dtype).double().T, dtype)
    x = torch.randn(1, 64, generator=g).bfloat16()
    assert torch.equal(_linear(x, w.bfloat16()), F.linear(x.expand(2, -1), w.bfloat16())[:1])
    if _ONEDNN_LINEAR is not None:  # a big enough product on oneDNN, a small one on the sgemm (its call costs more)
        big = torch.randn(1024, 1024, generator=g) / 32
        x = torch.randn(6, 1024, generator=g)
        assert torch.equal(_linear(x, big), _ONEDNN_LINEAR(x, big, None, "none", [], ""))
        assert_close(_linear(x, big), x.double() @ big.double().T, torch.float32)
        x = torch.randn(6, 64, generator=g)
        assert torch.equal(_linear(x, w), F.linear(x, w))
    x = torch.randn(6, 64, generator=g, requires_grad=True)
    _linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(6, -1))


# --------------------------------------------------------------------------- the Triton layout
def test_sort_pairs_by_expert_layout():
    from ds4_torch.kernels.triton_moe import max_blocks, sort_pairs_by_expert

    ids = torch.tensor([[3, 0], [3, -1], [0, 3], [7, 3], [1, 9]])  # E = 8: 9 and -1 pick nothing
    E, block_m, P = 8, 4, ids.numel()
    pairs, block_expert = sort_pairs_by_expert(ids, E, block_m)
    assert pairs.numel() == max_blocks(P, E, block_m) * block_m and block_expert.numel() == pairs.numel() // block_m
    flat = ids.view(-1).tolist()
    blocks = pairs.view(-1, block_m).tolist()
    listed = []
    for b, (expert, rows) in enumerate(zip(block_expert.tolist(), blocks)):
        real = [p for p in rows if p < P]
        if expert < 0:
            assert not real  # unused blocks hold padding only
            continue
        assert real and all(flat[p] == expert for p in real), (b, expert, rows)
        assert rows == real + [P] * (block_m - len(real))  # padding at the end of a block
        listed += real
    assert sorted(listed) == [p for p, e in enumerate(flat) if 0 <= e < E]  # each routed pair once
    assert listed == sorted(listed, key=lambda p: flat[p])  # grouped by expert, stable within
    assert (block_expert >= 0).sum() == 4  # expert 3 has 4 pairs (one block), 0: 2, 1: 1, 7: 1


# --------------------------------------------------------------------------- op registration
def small_args():
    return case_inputs(("small", 3, 2, 4, 32, 32, torch.tensor([[0, 2], [2, -1], [3, 3]])))


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_op_passes_opcheck(backend):
    torch.library.opcheck(torch.ops.ds4.moe.default, (*small_args(), LIMIT, backend))


def test_op_has_a_cuda_kernel_and_a_fake():
    name = torch.ops.ds4.moe.default.name()
    for key in ("CUDA", "CompositeExplicitAutograd", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), key


def test_backend_errors_name_the_problem(monkeypatch):
    args = small_args()
    with pytest.raises(ValueError, match="auto, torch, triton"):
        torch.ops.ds4.moe(*args, LIMIT, "flash")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA GPU, or TRITON_INTERPRET=1"):
        torch.ops.ds4.moe(*args, LIMIT, "triton")


def test_shape_and_dtype_errors():
    hidden, ids, weights, gate_up, down = small_args()
    with pytest.raises(ValueError, match="down must be"):
        torch.ops.ds4.moe(hidden, ids, weights, gate_up, down[:, :, :-1], LIMIT, "torch")
    with pytest.raises(ValueError, match="share one floating dtype"):
        torch.ops.ds4.moe(hidden, ids, weights, gate_up.double(), down, LIMIT, "torch")
    with pytest.raises(ValueError, match="int64"):
        torch.ops.ds4.moe(hidden, ids.int(), weights, gate_up, down, LIMIT, "torch")


def test_op_traces_as_one_node_and_routing_stays_live():
    """make_fx bakes Python values into the graph like a CUDA-graph capture: the op must be one
    node whose routing is read at replay, not frozen at trace time."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(hidden, ids, weights, gate_up, down):
        return torch.ops.ds4.moe(hidden, ids, weights, gate_up, down, LIMIT, "auto")

    hidden, ids, weights, gate_up, down = case_inputs(CASES[0])
    graph = make_fx(step)(hidden, ids, weights, gate_up, down)
    assert [n.target for n in graph.graph.nodes if n.op == "call_function"] == [torch.ops.ds4.moe.default]
    other = (ids + 1) % gate_up.shape[0]  # other experts than at trace time
    assert_close(graph(hidden, other, weights, gate_up, down), loop_reference(hidden, other, weights, gate_up,
                                                                              down, LIMIT), torch.float32)


def test_op_compiles_fullgraph():
    torch._dynamo.reset()

    def step(hidden, ids, weights, gate_up, down):
        return torch.ops.ds4.moe(hidden * 2, ids, weights, gate_up, down, LIMIT, "auto") + 1

    args = case_inputs(CASES[2])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert_close(compiled(*args), step(*args).double(), torch.float32)


# --------------------------------------------------------------------------- the model's Experts
def experts_module(E=8, H=64, I=32, k=3, seed=0):
    from types import SimpleNamespace

    from ds4_torch.model import Experts

    # The config fields Experts reads (a full DS4Config needs a whole model's worth of them).
    module = Experts(SimpleNamespace(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, swiglu_limit=LIMIT))
    _, _, _, gate_up, down = make_inputs(1, k, E, H, I, seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    return module


@pytest.mark.parametrize("N", [1, 2, 40], ids=["decode", "decode_batch", "prefill"])
@torch.no_grad()
def test_experts_module_matches_loop(N):
    module = experts_module()
    hidden, ids, weights, _, _ = make_inputs(N, 3, 8, 64, 32, seed=N)
    got = module(hidden, ids, weights)
    assert_close(got, loop_reference(hidden, ids, weights, module.gate_up_proj, module.down_proj, LIMIT),
                 torch.float32)


def test_experts_module_trains():
    """With autograd recording, Experts takes the differentiable torch path: gradients equal those
    of the loop (float64 autograd through the same formula)."""
    module = experts_module().double()
    hidden, ids, weights, _, _ = make_inputs(6, 3, 8, 64, 32, seed=3, dtype=torch.float64)
    hidden.requires_grad_(True)
    module(hidden, ids, weights).square().sum().backward()
    gate_up, down = (module.gate_up_proj.detach().clone().requires_grad_(True),
                     module.down_proj.detach().clone().requires_grad_(True))
    x = hidden.detach().clone().requires_grad_(True)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            gate, up = (gate_up[e] @ x[n]).chunk(2)
            out = out.index_add(0, torch.tensor([n]), (weights[n, j] * (down[e] @ (
                F.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT))))[None])
    out.square().sum().backward()
    for got, want in ((hidden.grad, x.grad), (module.gate_up_proj.grad, gate_up.grad),
                      (module.down_proj.grad, down.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def quantized_experts(gate_up, down, fmt):
    """(gate_up, down, gate_up_scale, down_scale) packed as the op takes them (the gate_up grid: the
    gate grid on the up grid), and the exact dequantized weights, with tests/ckpt_utils' own
    quantizers: fmt "fp4" (e8m0 per 32), "fp8" (e8m0 128x128 blocks) or "fp8-f32" (float32 scales)."""
    from ckpt_utils import fp4_quantize, fp8_quantize, fp8_reference

    I = gate_up.shape[1] // 2
    packed = {"gate_up": [], "down": []}
    for e in range(gate_up.shape[0]):
        for name, parts in (("gate_up", (gate_up[e, :I], gate_up[e, I:])), ("down", (down[e],))):
            if fmt == "fp4":
                quantized = [fp4_quantize(w) for w in parts]
            else:
                quantized = [(q, s, fp8_reference(q, s)) for q, s in
                             (fp8_quantize(w, "float32" if fmt == "fp8-f32" else "e8m0") for w in parts)]
            packed[name].append([torch.cat([q[i] for q in quantized]) for i in range(3)])
    (gu, gus, gud), (dn, dns, dnd) = ([torch.stack([p[i] for p in packed[n]]) for i in range(3)]
                                      for n in ("gate_up", "down"))
    return (gu, dn, gus, dns), (gud, dnd)


# (name, N, k, E, H, I): partial FP8 blocks (H, I not multiples of 128) and gate/up grids that
# meet off a block border (I = 96); decode, a small batch, a prefill above the activation-scaling
# row count (the op then scales the unpacked tiles instead).
QUANT_CASES = [("decode", 1, 3, 4, 200, 96), ("batch", 5, 2, 4, 160, 128), ("prefill", 40, 3, 4, 136, 64)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fmt", ["fp4", "fp8", "fp8-f32"])
@pytest.mark.parametrize("case", QUANT_CASES, ids=[c[0] for c in QUANT_CASES])
@torch.no_grad()
def test_op_on_quantized_experts_matches_loop(case, fmt, backend, monkeypatch):
    """FP4/FP8 experts handed to the op packed, with their scales: the loop on the dequantized
    weights, in fp32 and bf16. The torch implementation unpacks only the experts some pair
    selected, each once per call, and a pair with no expert (-1, another rank's expert) unpacks
    nothing; the Triton kernels decode the packed bytes in registers."""
    name, N, k, E, H, I = case
    if fmt == "fp4":
        H, I = H // 32 * 32, I // 32 * 32
    hidden, ids, weights, gate_up, down = make_inputs(N, k, E, H, I, seed=N)
    ids[0, 0] = -1
    packed, (gate_up_d, down_d) = quantized_experts(gate_up, down, fmt)
    unpacked = []
    for fn in ("expert_gate_up", "expert_down"):
        original = getattr(moe_module, fn)

        def spy(x, weight, scale, original=original, stack=packed[0] if fn == "expert_gate_up" else packed[1]):
            unpacked.append((stack.dim(), (weight.data_ptr() - stack.data_ptr()) // stack.stride(0)
                             // stack.element_size()))
            return original(x, weight, scale)

        monkeypatch.setattr(moe_module, fn, spy)
    grouped = cpu_linear.fp4_linear_groups  # FP4 decode: every selected expert's rows in one call

    def grouped_spy(xs, stack, scale, experts):
        out = grouped(xs, stack, scale, experts)
        unpacked.extend((stack.dim(), e) for e in experts if out is not None)  # None: the loop reads them
        return out

    monkeypatch.setattr(cpu_linear, "fp4_linear_groups", grouped_spy)
    gu, dn, gus, dns = packed
    for dtype in (torch.float32, torch.bfloat16):
        unpacked.clear()
        x, w = hidden.to(dtype), weights.to(dtype)
        got = moe_module.moe(x, ids, w, gu, dn, LIMIT, backend, gus, dns)
        want = loop_reference(x, ids, w, gate_up_d.to(dtype), down_d.to(dtype), LIMIT)
        assert_close(got, want, dtype)
        selected = sorted(set(ids[ids >= 0].tolist())) if backend == "torch" else []
        assert sorted(e for _, e in unpacked) == sorted(selected * 2)  # gate_up and down of each


@pytest.mark.parametrize("fmt, float32_scale", [("fp8", "down"), ("fp8", "gate_up"), ("fp4", "down"),
                                                 ("fp4", "gate_up")])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@torch.no_grad()
def test_quantized_experts_whose_matrices_store_scales_differently(fmt, float32_scale, backend):
    """gate_up and down with different scale formats (e8m0 bytes for one, float32 for the other,
    the same values): each matrix is read in its own format, and the op matches the loop on the
    dequantized weights. (Triton used to read both in gate_up's format: e8m0 bytes as floats, or
    float32 scales as bytes.)"""
    N, k, E, H, I = 5, 2, 4, 160, 128
    hidden, ids, weights, gate_up, down = make_inputs(N, k, E, H, I, seed=7)
    (gu, dn, gus, dns), (gate_up_d, down_d) = quantized_experts(gate_up, down, fmt)
    assert gus.dtype == dns.dtype == torch.float8_e8m0fnu
    as_float32 = lambda s: torch.exp2(s.view(torch.uint8).float() - 127)  # e8m0: 2^(byte - 127)
    if float32_scale == "down":
        dns = as_float32(dns)
    else:
        gus = as_float32(gus)
    got = moe_module.moe(hidden, ids, weights, gu, dn, LIMIT, backend, gus, dns)
    assert_close(got, loop_reference(hidden, ids, weights, gate_up_d, down_d, LIMIT), torch.float32)


def test_quantized_op_errors_name_the_problem():
    hidden, ids, weights, gate_up, down = make_inputs(2, 2, 4, 64, 32, seed=0)
    (gu, dn, gus, dns), _ = quantized_experts(gate_up, down, "fp4")
    with pytest.raises(ValueError, match="both gate_up_scale and down_scale"):
        moe_module.moe(hidden, ids, weights, gu, dn, LIMIT, "auto", gus, None)
    with pytest.raises(ValueError, match="down must be"):
        moe_module.moe(hidden, ids, weights, gu, dn[:, :32], LIMIT, "auto", gus, dns)
    with pytest.raises(ValueError, match="gate_up_scale must be"):
        moe_module.moe(hidden, ids, weights, gu, dn, LIMIT, "auto", gus[:, :3], dns)


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@torch.no_grad()
def test_quantized_experts_module_runs_the_op_packed(fmt, monkeypatch):
    """quant.py's storage swapped into the model's Experts: forward hands the packed experts to
    the op (expert_weights is never called) and matches the dense module holding the dequantized
    weights."""
    from ds4_torch import quant as Q

    module = experts_module()
    E = module.num_experts
    (gu, dn, gus, dns), (gate_up_d, down_d) = quantized_experts(module.gate_up_proj, module.down_proj, fmt)
    module.gate_up_proj.copy_(gate_up_d)
    module.down_proj.copy_(down_d)
    hidden, ids, weights, _, _ = make_inputs(3, 3, E, 64, 32, seed=3)
    dense = module(hidden, ids, weights)
    storage = Q.FP4Experts if fmt == "fp4" else Q.FP8Experts
    storage.convert_(module, gu, gus, dn, dns, split_gate_up=True)
    monkeypatch.setattr(module, "expert_weights", lambda *a, **k: pytest.fail("dequantized a whole expert"))
    assert_close(module(hidden, ids, weights), dense.double(), torch.float32)


@torch.no_grad()
def test_fp8_experts_with_a_block_across_the_gate_up_border():
    """One FP8 grid over gate_up's 2I = 192 rows (HF's stacked layout): its second 128-row block
    holds gate and up rows, which the op's two-grid layout cannot express, so packed_weights()
    declines and forward dequantizes one selected expert at a time; same output."""
    from ckpt_utils import fp8_quantize, fp8_reference
    from ds4_torch import quant as Q

    module = experts_module(E=4, I=96)
    quantized = [[fp8_quantize(w[e], "e8m0") for e in range(4)] for w in (module.gate_up_proj, module.down_proj)]
    (gu, gus), (dn, dns) = ([torch.stack([q[i] for q in qs]) for i in range(2)] for qs in quantized)
    module.gate_up_proj.copy_(torch.stack([fp8_reference(q, s) for q, s in quantized[0]]))
    module.down_proj.copy_(torch.stack([fp8_reference(q, s) for q, s in quantized[1]]))
    hidden, ids, weights, _, _ = make_inputs(3, 3, 4, 64, 96, seed=4)
    dense = module(hidden, ids, weights)
    Q.FP8Experts.convert_(module, gu, gus, dn, dns)
    assert module.packed_weights() is None
    assert_close(module(hidden, ids, weights), dense.double(), torch.float32)


@torch.no_grad()
def test_quantized_experts_trace_without_freezing_the_routing():
    from torch.fx.experimental.proxy_tensor import make_fx

    from ds4_torch import quant as Q
    from ckpt_utils import fp4_quantize

    module = experts_module()
    E = module.num_experts
    packed = [[fp4_quantize(w[e]) for e in range(E)] for w in (module.gate_up_proj, module.down_proj)]
    gate_up_q, down_q = ([torch.stack([p[i] for p in ws]) for i in range(3)] for ws in packed)
    Q.FP4Experts.convert_(module, gate_up_q[0], gate_up_q[1], down_q[0], down_q[1])
    hidden, ids, weights, _, _ = make_inputs(2, 3, E, 64, 32, seed=5)
    graph = make_fx(module)(hidden, ids, weights)
    other = (ids + 3) % E
    assert_close(graph(hidden, other, weights),
                 loop_reference(hidden, other, weights, gate_up_q[2], down_q[2], LIMIT), torch.float32)


def test_bench_moe_agrees_with_transformers_at_tiny_sizes(tmp_path, capsys):
    """The benchmark runs end to end, and its transformers modules (same weights, same routing)
    produce ds4_torch's outputs: fp32 to rounding; bf16 within 0.07, one bf16 ulp at the outputs'
    magnitude (8-16 here): transformers' eager loop adds the k slots in bf16, ds4_torch in fp32."""
    import argparse
    import csv

    from ds4_torch.bench import moe as bench_moe

    parser = argparse.ArgumentParser()
    bench_moe.add_arguments(parser)
    path = tmp_path / "moe.csv"
    args = parser.parse_args(["--hidden", "64", "--intermediate", "32", "--experts", "4", "--top-k", "2",
                              "--prefill-tokens", "8", "--repeats", "1", "--decode-repeats", "1", "--csv", str(path)])
    assert bench_moe.run(args) == 0
    rows = list(csv.DictReader(path.open()))
    assert [(r["dtype"], r["case"], r["impl"]) for r in rows] == [
        (d, c, i) for d in ("fp32", "bf16") for c in ("decode", "prefill8")
        for i in ("ds4_torch", "transformers-eager", "transformers-grouped_mm")]
    for r in rows:
        assert float(r["max_abs_diff"]) <= (1e-5 if r["dtype"] == "fp32" else 0.07), r
        assert float(r["floor_mb"]) > 0 and float(r["ms"]) > 0
    assert "ds4_torch" in capsys.readouterr().out


# --------------------------------------------------------------------------- GPU-only checks
def run_child(mode: str, *args: str, timeout=900):
    """This file as a script, with TRITON_INTERPRET unset (see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")]))
    child = subprocess.run([sys.executable, __file__, mode, *args], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=timeout)
    assert child.returncode == 0, f"{mode} failed:\n{child.stdout[-4000:]}\n{child.stderr[-8000:]}"
    return child.stdout


# Opt-in shared memory per block: A100 (sm_80) 163 KiB, H100 (sm_90) 227 KiB; 255 registers/thread.
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}
MAX_REGISTERS = 255


def test_kernels_compile_for_sm80_and_sm90(tmp_path):
    """Both kernels at V4-Flash sizes (decode, prefill, each dtype) build for sm_80 and sm_90
    with no spills, registers and shared memory within the device limits, and bf16/fp16 dots on
    tensor cores. The report goes to a temporary directory."""
    report = tmp_path / "moe_compile.json"
    run_child("compile", str(report))
    rows = json.loads(report.read_text())
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"_moe_gate_up_kernel", "_moe_down_kernel"}
    assert {r["target"] for r in rows} == {"sm_80", "sm_90"}
    for r in rows:
        cc = int(r["target"][3:])
        assert r["spill_stores"] == r["spill_loads"] == 0, r
        assert r["registers"] <= MAX_REGISTERS and r["shared_bytes"] <= MAX_SHARED[cc], r
        if "fp32" not in r["case"]:
            assert r["tensor_cores"], r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
def test_native_cuda_matches_loop_and_captures():
    run_child("gpu")


# --------------------------------------------------------------------------- child processes
def v4_flash_launches():
    """(case, kernel, args, kwargs) of each launch at V4-Flash sizes, recorded from the real
    launcher on meta tensors."""
    from ds4_torch.kernels import triton_moe as tm

    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((case, self.kernel, args, kwargs))

    for name in ("_moe_gate_up_kernel", "_moe_down_kernel"):
        setattr(tm, name, Recorder(getattr(tm, name)))
    H, I, E, k = 4096, 2048, 256, 6
    # Token counts reach each BLOCK_M (16, 32, 64: 6, 48 and 192 pairs per expert).
    for case, N, dtype in (("decode_bf16", 1, torch.bfloat16), ("prefill256_bf16", 256, torch.bfloat16),
                           ("prefill2048_bf16", 2048, torch.bfloat16), ("prefill8192_bf16", 8192, torch.bfloat16),
                           ("prefill8192_fp16", 8192, torch.float16), ("decode_fp32", 1, torch.float32),
                           ("prefill2048_fp32", 2048, torch.float32), ("prefill8192_fp32", 8192, torch.float32)):
        def meta(*shape, dtype=dtype):
            return torch.empty(*shape, dtype=dtype, device="meta")

        tm.moe(meta(N, H), meta(N, k, dtype=torch.int64), meta(N, k), meta(E, 2 * I, H), meta(E, H, I), 10.0)
    # packed experts as DeepSeek ships them: FP4 with e8m0 per-32 scales, FP8 with e8m0 128x128 blocks
    for case, N, packing in (("decode_fp4_bf16", 1, 2), ("prefill2048_fp4_bf16", 2048, 2),
                             ("decode_fp8_bf16", 1, 1), ("prefill2048_fp8_bf16", 2048, 1)):
        def meta(*shape, dtype=torch.bfloat16):
            return torch.empty(*shape, dtype=dtype, device="meta")

        weights = torch.int8 if packing == 2 else torch.float8_e4m3fn
        block = (1, 32) if packing == 2 else (128, 128)
        tm.moe(meta(N, H), meta(N, k, dtype=torch.int64), meta(N, k), meta(E, 2 * I, H // packing, dtype=weights),
               meta(E, H, I // packing, dtype=weights), 10.0,
               meta(E, 2 * I // block[0], H // block[1], dtype=torch.uint8),
               meta(E, H // block[0], I // block[1], dtype=torch.uint8))
    return launches


def compile_report(path):
    from test_kernel_compile import compile_launches

    rows = compile_launches(v4_flash_launches())
    Path(path).write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(r)


def gpu_checks():
    """Native Triton on the GPU: matches the loop in every dtype, syncs nothing, and replays in a
    CUDA graph with new routing written into the captured buffers."""
    from ds4_torch.kernels.moe import moe_torch

    device = torch.device("cuda")
    # V4-Flash widths, 16 experts; low precision only: fp32 sums over 4096 terms drift past the
    # 1e-5 absolute tolerance meant for the small cases, whatever the summation order.
    v4_flash_like = [("v4_flash_like_decode", 1, 6, 16, 4096, 2048, None),
                     ("v4_flash_like_prefill", 256, 6, 16, 4096, 2048, None)]
    for case, dtypes, small in [(c, DTYPES, True) for c in CASES] + [(c, DTYPES[1:], False) for c in v4_flash_like]:
        for dtype in dtypes:
            args = case_inputs(case, dtype)
            cuda_args = [a.to(device) for a in args]
            if small:
                expected = loop_reference(*args, LIMIT)
            else:  # the torch implementation in float64, on the GPU (the Python loop would take minutes)
                expected = moe_torch(*(a.double() if a.is_floating_point() else a for a in cuda_args), LIMIT).cpu()
            first = torch.ops.ds4.moe(*cuda_args, LIMIT, "auto")  # compiles the kernels
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # from here any host sync inside the op raises
            again = torch.ops.ds4.moe(*cuda_args, LIMIT, "auto")
            torch.cuda.set_sync_debug_mode("default")
            assert torch.equal(first, again)  # no atomics: bitwise reproducible
            assert_close(again.cpu(), expected, dtype)
            print("ok", case[0], dtype)

    hidden, ids, weights, gate_up, down = (a.to(device) for a in case_inputs(CASES[6], torch.bfloat16))
    static = [hidden.clone(), ids.clone(), weights.clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (triton compiles) outside the capture
        torch.ops.ds4.moe(*static, gate_up, down, LIMIT, "auto")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.ds4.moe(*static, gate_up, down, LIMIT, "auto")
    for seed in (1, 2):
        new_hidden, new_ids, new_weights, _, _ = case_inputs(CASES[6], torch.bfloat16, seed=seed)
        for buffer, value in zip(static, (new_hidden, new_ids, new_weights)):
            buffer.copy_(value)
        graph.replay()
        expected = loop_reference(new_hidden, new_ids, new_weights, gate_up.cpu(), down.cpu(), LIMIT)
        assert_close(out.cpu(), expected, torch.bfloat16)
    print("ok cuda graph replay")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run the child checks with TRITON_INTERPRET unset (see the module docstring)")
    if sys.argv[1] == "compile":
        compile_report(sys.argv[2])
    elif sys.argv[1] == "gpu":
        gpu_checks()
    else:
        sys.exit(f"unknown mode {sys.argv[1]!r}")
