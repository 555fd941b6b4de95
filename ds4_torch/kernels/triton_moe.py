"""Triton fused MoE for `ds4::moe` (semantics in `moe.py`; `moe.moe_torch` is the oracle).

Built for a CUDA GPU; on CPU it runs under the Triton interpreter (TRITON_INTERPRET=1 set before
this module is imported).

Three steps, every shape fixed by (N tokens, k, E experts, block size), never by the routing, and
no host sync, so a decode step with this op captures in a CUDA graph:

1. `sort_pairs_by_expert` (torch ops on the device): the P = N*k (token, slot) pairs sorted by
   expert, each expert's run padded to a multiple of BLOCK_M, written into `pairs` (pair index,
   P = padding) of static length max_blocks*BLOCK_M with max_blocks = cdiv(P + min(P, E) *
   (BLOCK_M - 1), BLOCK_M): at most min(P, E) experts are hit and each wastes < BLOCK_M rows.
   `block_expert[b]` is the expert of block b, -1 past the used blocks (those programs exit).
2. `_moe_gate_up_kernel`, grid (max_blocks, cdiv(I, BLOCK_N)): one program = BLOCK_M pairs of one
   expert x BLOCK_N intermediate columns. It gathers the pairs' token rows, runs the gate and the
   up dot side by side over H (the two halves of gate_up, read once), applies the clamped SwiGLU
   in fp32 and writes `h` [max_blocks*BLOCK_M, I] in the dot dtype. Each expert's weights are
   read once per block of its pairs (once per expert in decode, where a block holds all of them).
3. `_moe_down_kernel`, grid (max_blocks, cdiv(H, BLOCK_N)): h @ down[e].T over I, times the pair's
   routing weight (rounded to the input dtype first, as the reference multiplies in that dtype),
   stored in fp32 at the pair's own row of `pair_out` [P, H]. No atomics: every pair row is
   written by exactly one program, and the per-token sum over the k slots is a plain reduction
   afterwards (deterministic, fp32, rounded once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantized import expert_block
from .triton_quantized import DENSE, FP4, FP8, dot_dtype, is_e8m0_scale, load_weight_tile, scale_argument


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, pairs_ptr, block_expert_ptr, h_ptr,
    P, TOP_K, H, I, limit, BR, BC, UP_SCALE_ROW0,
    s_xn,  # hidden [N, H], last dim contiguous
    s_we, s_wr,  # gate_up [E, 2I, H] (packed: bytes), last dim contiguous
    s_se, s_sr,  # gate_up scale [E, 2*SR, SC]: the gate grid, then the up grid from row UP_SCALE_ROW0
    s_hm,  # h [rows, I]
    COMPUTE: tl.constexpr, QUANT: tl.constexpr, SCALE_E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the used blocks
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < P
    token = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    ks = tl.arange(0, BLOCK_K)

    x_rows = x_ptr + token[:, None] * s_xn  # [BLOCK_M, 1]
    w_expert = w_ptr + expert.to(tl.int64) * s_we  # int64: E*2I*H passes 2^31 at V4-Flash sizes
    gate_cols = w_expert + cols.to(tl.int64)[None, :] * s_wr  # [1, BLOCK_N], rows 0..I-1
    up_cols = gate_cols + I * s_wr  # rows I..2I-1
    gate_scales = s_ptr + expert.to(tl.int64) * s_se
    up_scales = gate_scales + UP_SCALE_ROW0 * s_sr
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + ks
        kmask = kk < H
        x = tl.load(x_rows + kk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0).to(COMPUTE)
        wmask = kmask[:, None] & cmask[None, :]
        if QUANT == 0:
            w_gate = tl.load(gate_cols + kk[:, None], mask=wmask, other=0.0).to(COMPUTE)  # [BLOCK_K, BLOCK_N]
            w_up = tl.load(up_cols + kk[:, None], mask=wmask, other=0.0).to(COMPUTE)
        else:  # packed FP8/FP4: decoded and scaled in registers
            w_gate = load_weight_tile(gate_cols, gate_scales, cols[None, :], kk[:, None], wmask, s_sr, BR, BC,
                                      QUANT, SCALE_E8M0).to(COMPUTE)
            w_up = load_weight_tile(up_cols, up_scales, cols[None, :], kk[:, None], wmask, s_sr, BR, BC,
                                    QUANT, SCALE_E8M0).to(COMPUTE)
        acc_gate = tl.dot(x, w_gate, acc_gate, input_precision="ieee")
        acc_up = tl.dot(x, w_up, acc_up, input_precision="ieee")

    gate = tl.minimum(acc_gate, limit)
    up = tl.minimum(tl.maximum(acc_up, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up; padding rows are 0
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * s_hm + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=cmask[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, w_ptr, s_ptr, pairs_ptr, block_expert_ptr, rw_ptr, out_ptr,
    P, H, I, BR, BC,
    s_hm,  # h [rows, I]
    s_we, s_wr,  # down [E, H, I] (packed: bytes), last dim contiguous
    s_se, s_sr,  # down scale [E, SR, SC]
    s_on,  # pair_out [P, H]
    COMPUTE: tl.constexpr, QUANT: tl.constexpr, SCALE_E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < P
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < H
    ks = tl.arange(0, BLOCK_K)

    h_rows = h_ptr + rows.to(tl.int64)[:, None] * s_hm
    w_cols = w_ptr + expert.to(tl.int64) * s_we + cols.to(tl.int64)[None, :] * s_wr
    scales = s_ptr + expert.to(tl.int64) * s_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + ks
        kmask = kk < I
        h = tl.load(h_rows + kk[None, :], mask=kmask[None, :], other=0.0).to(COMPUTE)
        if QUANT == 0:
            w = tl.load(w_cols + kk[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0).to(COMPUTE)
        else:
            w = load_weight_tile(w_cols, scales, cols[None, :], kk[:, None], kmask[:, None] & cmask[None, :], s_sr,
                                 BR, BC, QUANT, SCALE_E8M0).to(COMPUTE)
        acc = tl.dot(h, w, acc, input_precision="ieee")

    weight = tl.load(rw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * s_on + cols[None, :], acc,
             mask=valid[:, None] & cmask[None, :])


# --------------------------------------------------------------------------- launcher
def moe_config(pairs: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Block sizes and warps, from shapes only (not tuned on a GPU yet). BLOCK_M follows the mean
    pairs per expert (decode: 16, the smallest tensor-core M; long prefills: up to 64). With
    BLOCK_M 16 the kernels stream weights, so BLOCK_N 32 doubles the programs reading them. fp32
    (no tensor cores, an FMA dot) takes half the K tile and 8 warps for BLOCK_M 64: with 4 the
    gate_up kernel's two accumulators spill at sm_80 (see tests/kernels/test_moe.py compile check)."""
    per_expert = pairs / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    fp32 = dtype == torch.float32
    return dict(BLOCK_M=block_m, BLOCK_N=32 if block_m == 16 else 64, BLOCK_K=32 if fp32 else 64,
                num_warps=8 if fp32 and block_m == 64 else 4)


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded blocks: each of the <= min(P, E) hit experts wastes < block_m rows."""
    return triton.cdiv(pairs + min(pairs, num_experts) * (block_m - 1), block_m)


def sort_pairs_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """(pairs [max_blocks*block_m] int32, block_expert [max_blocks] int32), see the module
    docstring. Device ops only: no sync, shapes from (P, E, block_m). Pairs whose id is outside
    [0, E) are left out (they land in a scratch slot past the end that no kernel reads)."""
    device = expert_ids.device
    flat = expert_ids.reshape(-1)
    P, E = flat.numel(), num_experts
    blocks = max_blocks(P, E, block_m)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    begin = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=device))  # first sorted pair of each expert
    counts = begin[1:] - begin[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    expert = sorted_ids.clamp(0, E - 1)
    slot = (padded_end - padded)[expert] + torch.arange(P, device=device) - begin[:-1][expert]
    slot = torch.where((sorted_ids >= 0) & (sorted_ids < E), slot, blocks * block_m)
    pairs = torch.full((blocks * block_m + 1,), P, dtype=torch.int32, device=device)
    pairs.scatter_(0, slot, order.to(torch.int32))
    block_start = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # first expert ending after it
    block_expert = torch.where(block_expert < E, block_expert, -1).to(torch.int32)
    return pairs[:-1], block_expert


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def moe(hidden, expert_ids, routing_weights, gate_up, down, swiglu_limit: float, gate_up_scale=None,
        down_scale=None):
    """Triton version of `moe.moe_torch` (same arguments)."""
    N, H = hidden.shape
    k = expert_ids.shape[1]
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up_scale is None:
        quant, gate_up_block, down_block = DENSE, (1, 1), (1, 1)
        gate_up_scale = down_scale = hidden.new_empty(1, 1, 1, dtype=torch.float32)  # never read
    else:  # packed experts: the kernels read their bytes and decode them in registers
        quant = FP8 if gate_up.dtype == torch.float8_e4m3fn else FP4
        gate_up_block = expert_block(gate_up[0], gate_up_scale[0], I)
        down_block = expert_block(down[0], down_scale[0], H)
        gate_up, down = gate_up.view(torch.uint8), down.view(torch.uint8)
    # each matrix's scale format on its own (a checkpoint may store them differently)
    gate_up_e8m0, down_e8m0 = is_e8m0_scale(gate_up_scale), is_e8m0_scale(down_scale)
    gate_up_scale, down_scale = scale_argument(gate_up_scale), scale_argument(down_scale)
    P = N * k
    if P == 0 or E == 0:
        return hidden.new_zeros(N, H)
    hidden, gate_up, down = (_last_dim_contiguous(x) for x in (hidden, gate_up, down))
    config = moe_config(P, E, hidden.dtype)
    block_m = config["BLOCK_M"]
    pairs, block_expert = sort_pairs_by_expert(expert_ids, E, block_m)
    blocks = block_expert.numel()
    compute = dot_dtype(hidden.dtype)
    h = torch.empty(blocks * block_m, I, device=hidden.device,
                    dtype=torch.float32 if compute == tl.float32 else hidden.dtype)
    # The reference multiplies by the weight in the input dtype: round it the same way here.
    pair_weights = routing_weights.reshape(-1).to(hidden.dtype).contiguous()
    pair_out = torch.zeros(P, H, dtype=torch.float32, device=hidden.device)  # rows of skipped pairs stay 0

    _moe_gate_up_kernel[(blocks, triton.cdiv(I, config["BLOCK_N"]))](
        hidden, gate_up, gate_up_scale, pairs, block_expert, h,
        P, k, H, I, float(swiglu_limit), *gate_up_block, gate_up_scale.shape[1] // 2,
        hidden.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1),
        h.stride(0),
        COMPUTE=compute, QUANT=quant, SCALE_E8M0=gate_up_e8m0, **config,
    )
    _moe_down_kernel[(blocks, triton.cdiv(H, config["BLOCK_N"]))](
        h, down, down_scale, pairs, block_expert, pair_weights, pair_out,
        P, H, I, *down_block, h.stride(0), down.stride(0), down.stride(1), down_scale.stride(0),
        down_scale.stride(1), pair_out.stride(0),
        COMPUTE=compute, QUANT=quant, SCALE_E8M0=down_e8m0, **config,
    )
    return pair_out.view(N, k, H).sum(1).to(hidden.dtype)
