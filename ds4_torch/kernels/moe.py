"""The routed-experts op: `torch.ops.ds4.moe`, one op for decode and prefill.

    ds4::moe(hidden [N, H], expert_ids [N, k] int64, routing_weights [N, k],
             gate_up [E, 2I, H], down [E, H, I], swiglu_limit: float, backend: str,
             gate_up_scale: Tensor? = None, down_scale: Tensor? = None) -> [N, H]

For each (token n, slot j) pair with e = expert_ids[n, j]:
    gate, up = (hidden[n] @ gate_up[e].T).chunk(2)                      # in hidden's dtype
    y        = (silu(gate.clamp(max=L)) * up.clamp(-L, L)) @ down[e].T
    out[n]  += y * routing_weights[n, j].to(hidden.dtype)               # sum over j in fp32, rounded once
the semantics of the model's `Experts` (and transformers' DeepseekV4Experts). `hidden`, `gate_up`
and `down` share one floating dtype, the compute dtype.

Quantized experts (`quant.FP8Experts` / `quant.FP4Experts` storage) come with their scales:
`gate_up`/`down` float8_e4m3fn (128x128 blocks) or FP4 bytes (int8, two e2m1 codes each, the last
dim halved, an e8m0 scale per 32 inputs), and `gate_up_scale` [E, 2*SR, SC] the gate grid stacked
on the up grid, `down_scale` [E, SR', SC']. The math is the dense one on the dequantized weights
(`quant.dequantize`), in hidden's dtype; no dense copy of an expert outlives its use, and an
expert no pair selected is never read. A pair whose id is outside [0, E) (e.g.
-1) picks no expert and adds nothing, in every implementation; that is how a caller hands the op
only part of the experts (`Experts` with quantized storage feeds one dequantized expert at a time).

Implementations (chosen as for the attention ops, `ops.kernel_for`; backend "auto" | "torch" |
"triton"):
- every device without a kernel of its own (CPU, MPS), and "torch": `moe_torch` below, a loop
  over the experts actually selected that multiplies each expert's token group by *views* of its
  weights (never a gathered copy of the selected set); on a CPU, when most experts are hit
  anyway by small groups, one grouped product per projection instead (`moe_grouped`). Quantized experts are unpacked there, only
  when selected, tile by tile into a reused buffer (`quantized.py`); FP4 experts with at most
  `cpu_linear.MAX_ROWS` tokens each (decode) are read by the native products instead, all the
  selected experts in one call per projection (`_fp4_experts_at_once`). It reads the expert counts on the host; as
  one opaque op under `make_fx` / `torch.compile` that sync is not part of any traced graph.
- CUDA ("auto" / "triton"), or CPU under TRITON_INTERPRET=1 with "triton": the fused Triton kernels
  of `triton_moe.py`, with no host sync and no data-dependent shape (CUDA-graph capturable).
The op never mutates its inputs and returns a fresh tensor.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..quant import is_fp4_packed_dtype
from . import cpu_linear
from .ops import kernel_for
from .registration import define_op
from .linear import fastest_linear as _linear
from .quantized import expert_block, expert_down, expert_gate_up

__all__ = ["moe", "moe_torch", "swiglu", "check_moe_inputs"]


def check_moe_inputs(hidden: Tensor, expert_ids: Tensor, routing_weights: Tensor, gate_up: Tensor,
                     down: Tensor, gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None) -> None:
    """Shapes and dtypes only (no data is read): raises ValueError naming the mismatch."""
    if hidden.dim() != 2:
        raise ValueError(f"moe: hidden must be [tokens, hidden], got shape {tuple(hidden.shape)}")
    N, H = hidden.shape
    if expert_ids.dim() != 2 or expert_ids.shape[0] != N:
        raise ValueError(f"moe: expert_ids must be [{N}, k], got shape {tuple(expert_ids.shape)}")
    if expert_ids.dtype != torch.int64:
        raise ValueError(f"moe: expert_ids must be int64, got {expert_ids.dtype}")
    if routing_weights.shape != expert_ids.shape or not routing_weights.is_floating_point():
        raise ValueError(f"moe: routing_weights must be floating with expert_ids' shape {tuple(expert_ids.shape)}, "
                         f"got {routing_weights.dtype} {tuple(routing_weights.shape)}")
    if (gate_up_scale is None) != (down_scale is None):
        raise ValueError("moe: quantized experts need both gate_up_scale and down_scale")
    quantized = gate_up_scale is not None
    if quantized:
        check_quantized_experts(H, gate_up, down, gate_up_scale, down_scale)
        if not hidden.is_floating_point():
            raise ValueError(f"moe: hidden must be floating, got {hidden.dtype}")
        return
    if gate_up.dim() != 3 or gate_up.shape[2] != H or gate_up.shape[1] % 2:
        raise ValueError(f"moe: gate_up must be [experts, 2*intermediate, {H}], got shape {tuple(gate_up.shape)}")
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    if tuple(down.shape) != (E, H, I):
        raise ValueError(f"moe: down must be [{E}, {H}, {I}] to match gate_up, got shape {tuple(down.shape)}")
    if not (hidden.dtype == gate_up.dtype == down.dtype) or not hidden.is_floating_point():
        raise ValueError(f"moe: hidden, gate_up and down must share one floating dtype, got "
                         f"{hidden.dtype}, {gate_up.dtype}, {down.dtype}")


def check_quantized_experts(H: int, gate_up: Tensor, down: Tensor, gate_up_scale: Tensor, down_scale: Tensor) -> None:
    """Quantized storage (see the module docstring): raises ValueError naming the mismatch."""
    fp8 = gate_up.dtype == torch.float8_e4m3fn
    if not (fp8 or is_fp4_packed_dtype(gate_up.dtype)) or down.dtype != gate_up.dtype:
        raise ValueError(f"moe: quantized experts must be float8_e4m3fn or FP4 bytes (int8), got gate_up "
                         f"{gate_up.dtype} and down {down.dtype}")
    per_byte = 1 if fp8 else 2
    if gate_up.dim() != 3 or gate_up.shape[2] * per_byte != H or gate_up.shape[1] % 2:
        raise ValueError(f"moe: gate_up must be [experts, 2*intermediate, {H // per_byte}] ({gate_up.dtype}), "
                         f"got shape {tuple(gate_up.shape)}")
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    if tuple(down.shape) != (E, H, I // per_byte):
        raise ValueError(f"moe: down must be [{E}, {H}, {I // per_byte}] to match gate_up, got {tuple(down.shape)}")
    for name, w, s, rows in (("gate_up", gate_up, gate_up_scale, I), ("down", down, down_scale, H)):
        if s.dim() != 3 or s.shape[0] != E or (name == "gate_up" and s.shape[1] % 2):
            raise ValueError(f"moe: {name}_scale must be [{E}, rows, cols] (gate_up: the gate grid on the up "
                             f"grid), got {tuple(s.shape)}")
        expert_block(w[0], s[0], rows)  # raises ValueError when the grid fits no block size


def swiglu(gate_up: Tensor, limit: float) -> Tensor:
    """Clamped SwiGLU on the [..., 2I] output of the gate_up projection (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)




# At most this many (token, expert) pairs per expert on average, the grouped product beats the
# per-expert loop (whose ~15 small ops per expert cost tens of microseconds on a CPU); above it,
# the CPU's grouped product is slower than the loop's BLAS calls (measured with the embedded
# model's experts: even at 64 rows an expert, 2.4x slower at 512).
GROUPED_MAX_PAIRS_PER_EXPERT = 16


def _grouped_pays(N: int, k: int, E: int, device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Most experts are hit anyway (N*k >= E) and their groups are small; CPU only (the grouped
    product has no MPS implementation, and CUDA runs the Triton kernels), in the dtypes it takes."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and E <= N * k <= GROUPED_MAX_PAIRS_PER_EXPERT * E)


def moe_grouped(hidden: Tensor, expert_ids: Tensor, routing_weights: Tensor, gate_up: Tensor, down: Tensor,
                swiglu_limit: float) -> Tensor:
    """The pairs sorted by expert and multiplied by `torch._grouped_mm`, one call per projection:
    the same products and the same fp32 sum over slots as the loop, with no host sync and a fixed
    number of ops (dense weights). A pair whose id is outside [0, E) sorts last, past every
    group, and adds nothing."""
    N, k = expert_ids.shape
    E = gate_up.shape[0]
    flat = expert_ids.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    order = torch.argsort(torch.where(valid, flat, E), stable=True)
    group_ends = torch.bincount(flat[valid], minlength=E).cumsum(0).to(torch.int32)
    x = hidden.index_select(0, order // k)
    h = swiglu(torch._grouped_mm(x, gate_up.transpose(1, 2), offs=group_ends), swiglu_limit)
    y = torch._grouped_mm(h, down.transpose(1, 2), offs=group_ends)
    y = torch.where(valid[order, None], y * routing_weights.reshape(-1).to(hidden.dtype)[order, None], 0.0)
    return torch.empty_like(y).index_copy_(0, order, y).view(N, k, -1).sum(1)


def moe_torch(hidden: Tensor, expert_ids: Tensor, routing_weights: Tensor, gate_up: Tensor, down: Tensor,
              swiglu_limit: float, gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None) -> Tensor:
    """The torch implementation (see the module docstring); also differentiable, for training
    (dense weights)."""
    N, H = hidden.shape
    k = expert_ids.shape[1]
    E = gate_up.shape[0]
    if gate_up_scale is None and _grouped_pays(N, k, E, hidden.device, hidden.dtype):
        return moe_grouped(hidden, expert_ids, routing_weights, gate_up, down, swiglu_limit)
    flat_ids = expert_ids.reshape(-1)
    pair_weights = routing_weights.reshape(-1).to(hidden.dtype)
    # Pairs sorted by expert; bins: [no expert below 0] [experts 0..E-1] [no expert at E and above].
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids.clamp(-1, E) + 1, minlength=E + 2).tolist()  # the host sync
    all_valid = counts[0] == 0 and counts[E + 1] == 0
    pair_out = hidden.new_empty(N * k, H) if all_valid else hidden.new_zeros(N * k, H)
    tokens, sorted_weights = order // k, pair_weights[order]  # per sorted pair; sliced per expert below
    begin = counts[0]
    if gate_up_scale is not None and _fp4_experts_at_once(hidden, tokens, counts, gate_up, down, gate_up_scale,
                                                          down_scale, swiglu_limit, order, sorted_weights, pair_out):
        return pair_out.view(N, k, H).sum(1)
    for e in range(E):
        n = counts[e + 1]
        if n == 0:
            continue
        end = begin + n
        x = hidden if N == 1 and n == 1 else hidden.index_select(0, tokens[begin:end])
        if gate_up_scale is None:
            h = swiglu(_linear(x, gate_up[e]), swiglu_limit)
            y = _linear(h, down[e])
        else:  # unpacked here, for this expert's tokens only
            h = swiglu(expert_gate_up(x, gate_up[e], gate_up_scale[e]), swiglu_limit)
            y = expert_down(h, down[e], down_scale[e])
        pair_out.index_copy_(0, order[begin:end], y * sorted_weights[begin:end, None])
        begin = end
    return pair_out.view(N, k, H).sum(1)


def _fp4_experts_at_once(hidden: Tensor, tokens: Tensor, counts: list[int], gate_up: Tensor, down: Tensor,
                         gate_up_scale: Tensor, down_scale: Tensor, swiglu_limit: float, order: Tensor,
                         sorted_weights: Tensor, pair_out: Tensor) -> bool:
    """The loop's products for FP4 experts with few tokens each (decode), the selected experts'
    rows in one native call per projection (`cpu_linear.fp4_linear_groups`: one handoff to the
    threads, and no per-expert torch ops between), writing the loop's values into `pair_out`;
    False (nothing written) where that cannot run."""
    if not is_fp4_packed_dtype(gate_up.dtype) or hidden.device.type != "cpu":
        return False
    E, N = gate_up.shape[0], hidden.shape[0]
    experts = [e for e in range(E) if counts[e + 1]]
    begin, xs = counts[0], []
    for e in experts:
        end = begin + counts[e + 1]
        xs.append(hidden if N == 1 and end - begin == 1 else hidden.index_select(0, tokens[begin:end]))
        begin = end
    gate_ups = cpu_linear.fp4_linear_groups(xs, gate_up, gate_up_scale, experts)
    if gate_ups is None:
        return False
    h = swiglu(torch.cat(gate_ups), swiglu_limit)
    ys = cpu_linear.fp4_linear_groups(list(h.split([counts[e + 1] for e in experts])), down, down_scale, experts)
    if ys is None:
        return False
    pairs = slice(counts[0], begin)  # the valid pairs, in expert order as `ys` is
    pair_out.index_copy_(0, order[pairs], torch.cat(ys) * sorted_weights[pairs, None])
    return True


def _implementation(backend: str, device: torch.device):
    if kernel_for(backend, device) == "torch":
        return moe_torch
    from . import triton_moe  # deferred: needs triton, and TRITON_INTERPRET is read at import

    return triton_moe.moe


# --------------------------------------------------------------------------- the op
def _moe_fake(hidden, expert_ids, routing_weights, gate_up, down, swiglu_limit, backend, gate_up_scale=None,
              down_scale=None):
    check_moe_inputs(hidden, expert_ids, routing_weights, gate_up, down, gate_up_scale, down_scale)
    return hidden.new_empty(hidden.shape)


@define_op("moe", _moe_fake)
def moe(hidden: Tensor, expert_ids: Tensor, routing_weights: Tensor, gate_up: Tensor, down: Tensor,
        swiglu_limit: float, backend: str, gate_up_scale: Optional[Tensor] = None,
        down_scale: Optional[Tensor] = None) -> Tensor:
    check_moe_inputs(hidden, expert_ids, routing_weights, gate_up, down, gate_up_scale, down_scale)
    return _implementation(backend, hidden.device)(hidden, expert_ids, routing_weights, gate_up, down, swiglu_limit,
                                                   gate_up_scale, down_scale)
