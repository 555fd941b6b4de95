"""Block-quantized weights consumed in place: the `ds4::fp8_linear` and `ds4::fp8_linear_grouped`
ops and the CPU unpacking that `ds4::moe` uses for FP4/FP8 experts (formats: `ds4_torch.quant`).

    ds4::fp8_linear(x [..., K], weight [R, K] float8_e4m3fn, scale [ceil(R/bm), ceil(K/bn)],
                    block_rows: int, block_cols: int, backend: str) -> [..., R]

computes `x @ dequantize_fp8(weight, scale).T` in x's dtype (bf16, fp16 or fp32) with fp32
accumulation, and never builds the dense weight. `scale` is float32, e8m0 (`float8_e8m0fnu`)
or uint8 holding an e8m0 exponent.

    ds4::fp8_linear_grouped(x [..., G, K], weight [G * R, K], scale, block_rows, block_cols, backend)
        -> [..., G, R]

is a grouped projection (attention's `wo_a`): group g of x through its own R rows of the weight,
each group starting on a block row; `ds4::fp8_linear` group by group, except on a CPU for decode
rows, where one native call serves every group (`cpu_linear.fp8_linear_groups`).

Implementations (chosen as for the other ops, `ops.kernel_for`):
- CUDA ("auto"/"triton"), or CPU under TRITON_INTERPRET=1 with "triton": `triton_quantized.py`,
  the GEMM with dequantization in its inner loop.
- every other device, and "torch": `fp8_linear_cpu` below. On a CPU, the native products of
  `cpu_linear.py` where they run: up to `cpu_linear.MAX_ROWS` rows (decode) one pass over the
  FP8 bytes, unpacked in registers; more rows (prefill) tiles of rows unpacked natively in one
  pass for torch's dense product. Elsewhere, or without a C compiler (or DS4_TORCH_NATIVE=0),
  `fp8_linear_torch`. It unpacks the weight tile by tile
  (rows of the weight, a few megabytes each) into one reused buffer, so no dense copy of the
  whole weight is ever built. The unpack is three integer passes, no lookup and no float convert:
  an e4m3 byte, sign-extended and shifted, *is* the bit pattern of a bf16/fp32 number whose
  exponent field is the byte's (`_WIDE_BITS`); that number is the fp8 value times 2^-120, for
  normal and subnormal bytes alike (both formats' subnormals line up). The block scales and the
  2^120 are then applied to the activations when there are few rows (decode: `x * scale` per
  128-row block of the weight, a batched matmul), or to the tile when there are many (prefill).

FP4 experts (e2m1, two per byte, an e8m0 scale per 32 inputs) go through the native product
(`cpu_linear.fp4_linear`) or, for prefill and without native code, tiles unpacked through a lookup
table indexed by (scale exponent, byte) that yields both values of the byte already scaled, in one
`index_select` (`dequantize_fp4_rows`; natively `cpu_linear.dequantize_fp4_rows`).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from ..quant import E2M1_VALUES, FP4_BLOCK, FP8_BLOCK, infer_block_size, is_fp8_dtype, scale_to_float
from . import cpu_linear
from .linear import fastest_linear as _linear
from .ops import kernel_for
from .registration import define_op

__all__ = ["fp8_linear", "fp8_linear_cpu", "fp8_linear_torch", "dequantize_fp4_rows", "quantized_linear",
           "expert_block", "check_fp8_linear_inputs"]

# Elements per unpacked tile. Each tile costs a handful of op calls (~10 us each), so tiles are
# large; measured best on one thread of an AMD EPYC (bf16, one decode row): 2^22 for FP8 (a
# 32768x1024 q_b_proj: 4.9 ms against 4.2 ms dense, 6.9 ms at 2^19), 2^21 for FP4 (a 4096x4096
# expert gate_up: 5.3 ms against 1.6 ms dense, 6.2 ms at 2^19).
FP8_TILE_ELEMENTS = 1 << 22
FP4_TILE_ELEMENTS = 1 << 21
# Prefill (block scales on the tile: one more pass over it) keeps the tile in L2 instead: a
# 4096x8192 wo_b on 64 rows took 25 ms at 2^17 against 11 ms dense, 50-130 ms at 2^19-2^22.
FP8_PREFILL_TILE_ELEMENTS = 1 << 17
# Prefill with native unpacking (one pass writes the tile, nothing else touches it): bigger tiles,
# fewer dense products. Measured on one thread of a Xeon (Emerald Rapids; bf16, 64 rows, a
# 32768x1024 q_b_proj, CPU time): 2^17 46.6 ms, 2^19 32.1, 2^20 29.6, 2^22 34.6; the torch tiles 80.7.
NATIVE_TILE_ELEMENTS = 1 << 20
# Up to this many activation rows the block scales go on the activations (one copy of x per 128
# weight rows: cheap for decode), above it on the weight tile (one pass over the tile).
SCALE_ACTIVATIONS_MAX_ROWS = 16

# compute dtype -> (integer dtype of its width, left shift, mask): (int8 byte << shift) & mask puts
# the byte's sign on the sign bit and its 4 exponent + 3 mantissa bits at the bottom of the wide
# exponent field and the top of the mantissa, i.e. the fp8 value * 2^-120 (bias 127 vs 7).
_WIDE_BITS = {
    torch.bfloat16: (torch.int16, 4, 0x87F0 - (1 << 16)),
    torch.float32: (torch.int32, 20, 0x87F00000 - (1 << 32)),
}
_WIDE_EXPONENT_OFFSET = 120
# Activations are scaled by 2^64 and outputs by 2^56: every value stays far from both ends of the
# exponent range (a single 2^120 on the activations could overflow, none at all would make the
# products subnormal).
_ACTIVATION_SHIFT = 64

_thread_buffers = threading.local()


def _buffer(name: str, numel: int, dtype: torch.dtype, device) -> Tensor:
    """A flat scratch tensor reused across calls (grown, never shrunk); callers take views. One
    per thread (freed with it): two threads running models at once must not share a tile."""
    buffers = _thread_buffers.__dict__.setdefault("by_key", {})
    key = (name, dtype, torch.device(device))
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        # a normal tensor even when first needed under inference_mode: later calls outside it
        # (no_grad, tracing) write into it too, which an inference tensor refuses
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=dtype, device=device)
        buffers[key] = buf
    return buf[:numel]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in _WIDE_BITS else torch.float32


def check_fp8_linear_inputs(x: Tensor, weight: Tensor, scale: Tensor, block_rows: int, block_cols: int) -> None:
    """Shapes and dtypes only: raises ValueError naming the mismatch."""
    if weight.dim() != 2 or not is_fp8_dtype(weight.dtype) or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: weight must be a 2-D float8_e4m3fn matrix, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    R, K = weight.shape
    if x.shape[-1] != K or not x.is_floating_point():
        raise ValueError(f"fp8_linear: x must be floating with last dim {K}, got {x.dtype} {tuple(x.shape)}")
    if block_rows < 1 or block_cols < 1:
        raise ValueError(f"fp8_linear: block sizes must be positive, got {block_rows}x{block_cols}")
    expected = (math.ceil(R / block_rows), math.ceil(K / block_cols))
    if tuple(scale.shape) != expected:
        raise ValueError(f"fp8_linear: scale must be {list(expected)} for a {R}x{K} weight in "
                         f"{block_rows}x{block_cols} blocks, got {tuple(scale.shape)}")


def _unpack_fp8_rows(weight_rows: Tensor, bits: Tensor, compute: torch.dtype) -> Tensor:
    """fp8 rows -> `bits` (a buffer view of the same shape) read as `compute`: value * 2^-120."""
    _, shift, mask = _WIDE_BITS[compute]
    bits.copy_(weight_rows.view(torch.int8))  # sign-extending
    bits.bitwise_left_shift_(shift)
    bits.bitwise_and_(mask)
    return bits.view(compute)


def _column_scales(scale: Tensor, block_cols: int, K: int) -> Tensor:
    """[SR, SC] block scales -> [SR, K] float32: the scale of every input column, per row block."""
    return scale_to_float(scale).repeat_interleave(block_cols, dim=1)[:, :K]


def fp8_linear_torch(x: Tensor, weight: Tensor, scale: Tensor, block_rows: int, block_cols: int) -> Tensor:
    """The torch implementation of `ds4::fp8_linear` (see the module docstring)."""
    R, K = weight.shape
    lead = x.shape[:-1]
    compute = _compute_dtype(x.dtype)
    x2 = x.reshape(-1, K).to(compute)
    N = x2.shape[0]
    bm = block_rows
    blocks = math.ceil(R / bm)
    col_scale = _column_scales(scale, block_cols, K)  # [blocks, K]
    bits_dtype = _WIDE_BITS[compute][0]
    on_activations = N <= SCALE_ACTIVATIONS_MAX_ROWS
    tile_elements = FP8_TILE_ELEMENTS if on_activations else FP8_PREFILL_TILE_ELEMENTS
    tile_rows = max(1, tile_elements // max(K, 1) // bm) * bm
    buf = _buffer("fp8_tile", min(tile_rows, R) * K, bits_dtype, weight.device)
    if on_activations:
        # [blocks, N, K]: x times each row block's column scales (and 2^64), rounded once to compute
        xs = (x2.float()[None] * (col_scale * 2.0 ** _ACTIVATION_SHIFT)[:, None, :]).to(compute)
        out = x2.new_empty(blocks, N, bm)
    else:
        out = x2.new_empty(N, R)
        tile_scale = col_scale * 2.0 ** _WIDE_EXPONENT_OFFSET
        if not bool(torch.isfinite(tile_scale).all()):  # scales >= 2^8: apply the 2^120 in two steps
            tile_scale = None
    for r0 in range(0, R, tile_rows):
        r1 = min(R, r0 + tile_rows)
        w = _unpack_fp8_rows(weight[r0:r1], buf[:(r1 - r0) * K].view(r1 - r0, K), compute)
        b0, full = r0 // bm, (r1 - r0) // bm
        if on_activations:
            if full:
                torch.bmm(xs[b0:b0 + full], w[:full * bm].view(full, bm, K).transpose(1, 2), out=out[b0:b0 + full])
            if (r1 - r0) % bm:  # the weight's last, partial row block
                out[b0 + full, :, :r1 - r0 - full * bm] = F.linear(xs[b0 + full], w[full * bm:])
            continue
        # many rows: scale the tile (per 128-row block) and multiply it as a dense weight
        for b in range(b0, math.ceil(r1 / bm)):
            rows = w[(b - b0) * bm:min(r1 - r0, (b - b0 + 1) * bm)]
            if tile_scale is not None:
                rows.mul_(tile_scale[b])
            else:
                rows.mul_(2.0 ** 60).mul_(col_scale[b] * 2.0 ** 60)
        out[:, r0:r1] = _linear(x2, w)
    if on_activations:
        out = out.permute(1, 0, 2).reshape(N, blocks * bm)[:, :R] * 2.0 ** (_WIDE_EXPONENT_OFFSET - _ACTIVATION_SHIFT)
    return out.to(x.dtype).reshape(*lead, R)


def fp8_linear_cpu(x: Tensor, weight: Tensor, scale: Tensor, block_rows: int, block_cols: int) -> Tensor:
    """`ds4::fp8_linear` on a CPU: the native product for decode, natively unpacked tiles for
    prefill, `fp8_linear_torch` where native code cannot run (see the module docstring)."""
    out = cpu_linear.fp8_linear(x, weight, scale, block_rows, block_cols)
    if out is None:
        out = _native_tiles(x, weight, block_rows, lambda rows, blocks, tile: cpu_linear.dequantize_fp8_rows(
            weight[rows], scale[blocks], block_rows, block_cols, tile))
    return fp8_linear_torch(x, weight, scale, block_rows, block_cols) if out is None else out


def _native_tiles(x: Tensor, weight: Tensor, block_rows: int, unpack) -> Tensor | None:
    """x @ W.T with W unpacked natively `NATIVE_TILE_ELEMENTS` at a time (whole row blocks) into a
    reused buffer, each tile multiplied by torch's dense product; None where native unpacking does
    not run (`unpack(rows, block_rows_slice, tile)` returns False: nothing was computed)."""
    if (x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu" or not cpu_linear.available()
            or torch.is_grad_enabled() and x.requires_grad):  # autograd would keep the reused tile
        return None
    R = weight.shape[0]
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    tile_rows = max(1, NATIVE_TILE_ELEMENTS // max(K, 1) // block_rows) * block_rows
    buf = _buffer("native_tile", min(tile_rows, R) * K, x.dtype, x.device)
    out = x2.new_empty(x2.shape[0], R)
    for r0 in range(0, R, tile_rows):
        r1 = min(R, r0 + tile_rows)
        tile = buf[:(r1 - r0) * K].view(r1 - r0, K)
        if not unpack(slice(r0, r1), slice(r0 // block_rows, math.ceil(r1 / block_rows)), tile):
            return None
        out[:, r0:r1] = _linear(x2, tile)
    return out.view(*x.shape[:-1], R)


# --------------------------------------------------------------------------- FP4
_fp4_tables: dict = {}


def _fp4_table(dtype: torch.dtype, device) -> Tensor:
    """[256 exponents * 256 bytes] -> both e2m1 values of the byte times 2^(exponent - 127), as one
    integer holding the two `dtype` values (low nibble first). Computed in float32 and rounded to
    `dtype`, exactly as `quant.dequantize_fp4` rounds."""
    key = (dtype, torch.device(device))
    table = _fp4_tables.get(key)
    if table is None:
        with torch.inference_mode(False):  # a normal tensor, as in _buffer
            values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
            byte = torch.arange(256)
            pair = torch.stack([values[byte & 15], values[byte >> 4]], dim=-1)  # [256, 2]
            scales = (torch.arange(256, dtype=torch.float32) - 127).exp2()
            table = (scales[:, None, None] * pair[None]).to(dtype)  # [256, 256, 2]
            pair_int = {2: torch.int32, 4: torch.int64}[table.element_size()]
            table = table.view(pair_int).reshape(-1).to(device)
        _fp4_tables[key] = table
    return table


def dequantize_fp4_rows(packed: Tensor, scale: Tensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """FP4 rows [R, C/2] with per-32 e8m0 scales [R, C/32] -> [R, C] in `dtype`, equal to
    `quant.dequantize_fp4(packed, scale, dtype)`, written into `out` when given (a buffer view)."""
    R, half = packed.shape
    C = 2 * half
    out = torch.empty(R, C, dtype=dtype, device=packed.device) if out is None else out
    groups = scale.shape[-1]
    if scale.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) or groups * FP4_BLOCK[1] != C \
            or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        from ..quant import dequantize_fp4  # other scale formats and odd shapes: the plain formula

        out.copy_(dequantize_fp4(packed, scale, dtype))
        return out
    index = _buffer("fp4_index", R * half, torch.int32, packed.device).view(R, groups, FP4_BLOCK[1] // 2)
    index.copy_(packed.contiguous().view(torch.uint8).view(R, groups, -1))
    index.add_(scale.view(torch.uint8).to(torch.int32)[..., None] << 8)
    table = _fp4_table(dtype, packed.device)
    torch.index_select(table, 0, index.view(-1), out=out.view(-1).view(table.dtype))
    return out


# --------------------------------------------------------------------------- experts
def expert_block(weight: Tensor, scale: Tensor, rows: int) -> tuple[int, int]:
    """Block (rows, cols) of one expert matrix's scale grid; `rows` logical rows (a gate or up half
    for gate_up, whose grid is the gate grid stacked on the up grid)."""
    cols = weight.shape[-1] * (1 if is_fp8_dtype(weight.dtype) else 2)
    default = FP8_BLOCK if is_fp8_dtype(weight.dtype) else FP4_BLOCK
    return infer_block_size((rows, cols), (scale.shape[-2] * rows // weight.shape[-2], scale.shape[-1]), default)


def quantized_linear(x: Tensor, weight: Tensor, scale: Tensor, block: tuple[int, int]) -> Tensor:
    """x [N, K] @ dequantized(weight).T for one FP8 or FP4 matrix (CPU path of the quantized
    experts): the native product or natively unpacked tiles where they run, else torch's tiles."""
    if is_fp8_dtype(weight.dtype):
        return fp8_linear_cpu(x, weight, scale, *block)
    out = cpu_linear.fp4_linear(x, weight, scale)
    if out is None:
        out = _native_tiles(x, weight, 1, lambda rows, _, tile: cpu_linear.dequantize_fp4_rows(
            weight[rows], scale[rows], tile))
    if out is not None:
        return out
    R = weight.shape[0]
    K = 2 * weight.shape[1]
    compute = _compute_dtype(x.dtype)
    x2 = x.to(compute)
    out = x2.new_empty(x2.shape[0], R)
    tile_rows = max(1, FP4_TILE_ELEMENTS // max(K, 1))
    buf = _buffer("fp4_tile", min(tile_rows, R) * K, compute, weight.device)
    for r0 in range(0, R, tile_rows):
        r1 = min(R, r0 + tile_rows)
        w = dequantize_fp4_rows(weight[r0:r1], scale[r0:r1], compute, buf[:(r1 - r0) * K].view(r1 - r0, K))
        out[:, r0:r1] = _linear(x2, w)
    return out.to(x.dtype)


def expert_gate_up(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """x @ gate_up.T for one quantized expert whose scale grid is the gate grid on the up grid."""
    half = weight.shape[0] // 2
    block = expert_block(weight, scale, half)
    if half % block[0] == 0:  # the two grids meet on a block border: one matrix
        return quantized_linear(x, weight, scale, block)
    s_half = scale.shape[0] // 2
    return torch.cat([quantized_linear(x, weight[:half], scale[:s_half], block),
                      quantized_linear(x, weight[half:], scale[s_half:], block)], dim=-1)


def expert_down(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return quantized_linear(x, weight, scale, expert_block(weight, scale, weight.shape[0]))


# --------------------------------------------------------------------------- the op
def _implementation(backend: str, device):
    if kernel_for(backend, device) == "torch":
        return fp8_linear_cpu
    from . import triton_quantized  # deferred: needs triton, and TRITON_INTERPRET is read at import

    return triton_quantized.fp8_linear


def _fp8_linear_fake(x, weight, scale, block_rows, block_cols, backend):
    check_fp8_linear_inputs(x, weight, scale, block_rows, block_cols)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@define_op("fp8_linear", _fp8_linear_fake)
def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, block_rows: int, block_cols: int, backend: str) -> Tensor:
    check_fp8_linear_inputs(x, weight, scale, block_rows, block_cols)
    return _implementation(backend, x.device)(x, weight, scale, block_rows, block_cols)


# --------------------------------------------------------------------------- grouped projection
def check_grouped_inputs(x: Tensor, weight: Tensor, scale: Tensor, block_rows: int, block_cols: int) -> None:
    """x [..., G, K]: G groups of rows of the weight, each starting on a block row of the scale."""
    if x.dim() < 2:
        raise ValueError(f"a grouped fp8_linear takes x [..., groups, in], got {tuple(x.shape)}")
    G = x.shape[-2]
    if G < 1 or weight.dim() != 2 or weight.shape[0] % G or scale.dim() != 2 or scale.shape[0] % G \
            or (weight.shape[0] // G) % block_rows:
        raise ValueError(f"a grouped fp8_linear needs each of its {G} groups of weight rows ({tuple(weight.shape)}, "
                         f"scale {tuple(scale.shape)}) to start on a {block_rows}-row block border")
    check_fp8_linear_inputs(x[..., 0, :], weight[:weight.shape[0] // G], scale[:scale.shape[0] // G], block_rows,
                            block_cols)


def fp8_linear_grouped_impl(x: Tensor, weight: Tensor, scale: Tensor, block_rows: int, block_cols: int,
                            backend: str) -> Tensor:
    """Group g of x through rows [g * R, (g + 1) * R) of the weight: on a CPU, decode rows in one
    native call for all groups (one handoff to the threads, not one per group); else `ds4::fp8_linear`'s
    implementation group by group."""
    G = x.shape[-2]
    if kernel_for(backend, x.device) == "torch":
        out = cpu_linear.fp8_linear_groups(x, weight, scale, block_rows, block_cols)
        if out is not None:
            return out
    run = _implementation(backend, x.device)
    rows, blocks = weight.shape[0] // G, scale.shape[0] // G
    return torch.stack([run(x[..., g, :], weight[g * rows:(g + 1) * rows], scale[g * blocks:(g + 1) * blocks],
                            block_rows, block_cols) for g in range(G)], dim=-2)


def _fp8_linear_grouped_fake(x, weight, scale, block_rows, block_cols, backend):
    check_grouped_inputs(x, weight, scale, block_rows, block_cols)
    return x.new_empty(*x.shape[:-1], weight.shape[0] // x.shape[-2])


@define_op("fp8_linear_grouped", _fp8_linear_grouped_fake)
def fp8_linear_grouped(x: Tensor, weight: Tensor, scale: Tensor, block_rows: int, block_cols: int,
                       backend: str) -> Tensor:
    check_grouped_inputs(x, weight, scale, block_rows, block_cols)
    return fp8_linear_grouped_impl(x, weight, scale, block_rows, block_cols, backend)
