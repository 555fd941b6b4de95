"""Triton kernels for block-quantized weights: `ds4::fp8_linear` (semantics in `quantized.py`,
`quantized.fp8_linear_torch` is the oracle) and the in-register decoding `triton_moe.py` uses for
packed FP4/FP8 experts.

Built for a CUDA GPU; on CPU it runs under the Triton interpreter (TRITON_INTERPRET=1 set before
this module is imported).

The weight is read as bytes and decoded in registers inside the GEMM's K loop, tile by tile:
each [BLOCK_K, BLOCK_N] tile of weight bytes becomes fp32 values (integer bit moves, no lookup
table, exact for every e4m3 and e2m1 code, subnormals included), times its block scales
(e8m0 bytes: 2^(b-127), or float32), rounded to the dot dtype, then fed to `tl.dot` with fp32
accumulation. No dense weight exists anywhere, and a weight byte is read once per BLOCK_M rows of
activations (once per decode step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# weight formats the kernels decode (constexpr QUANT)
DENSE, FP8, FP4 = 0, 1, 2


@triton.jit
def e4m3_to_float(bits):
    """int32 tile of e4m3 bytes (0..255) -> fp32 values."""
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 7
    sign = (bits & 0x80) << 24
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2^-9
    subnormal = tl.where((bits & 0x80) != 0, -subnormal, subnormal)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def e2m1_to_float(code):
    """int32 tile of e2m1 codes (0..15, bit 3 the sign) -> fp32 values."""
    magnitude = code & 7
    exponent = magnitude >> 1
    half = (magnitude & 1).to(tl.float32) * 0.5
    value = tl.where(exponent == 0, half, tl.exp2((exponent - 1).to(tl.float32)) * (1.0 + half))
    return tl.where(code >= 8, -value, value)


@triton.jit
def load_weight_tile(w_rows, s_rows, rows, kk, mask, s_sr, BR, BC, QUANT: tl.constexpr, SCALE_E8M0: tl.constexpr):
    """[BLOCK_K, BLOCK_N] fp32 tile of a weight whose row r (of `rows`, [1, BLOCK_N]) starts at
    `w_rows` ([1, BLOCK_N] pointers) and input column k (of `kk`, [BLOCK_K, 1]): dense, FP8 bytes
    or FP4 bytes (two per byte, low nibble first) times the scale at `s_rows` (the row's scale
    grid row, [1, BLOCK_N] pointers) [row // BR * s_sr ..., k // BC]."""
    if QUANT == 0:
        return tl.load(w_rows + kk, mask=mask, other=0.0).to(tl.float32)
    if QUANT == 1:
        w = e4m3_to_float(tl.load(w_rows + kk, mask=mask, other=0).to(tl.int32) & 0xFF)
    else:
        byte = tl.load(w_rows + kk // 2, mask=mask, other=0).to(tl.int32) & 0xFF
        w = e2m1_to_float((byte >> ((kk & 1) * 4)) & 0xF)
    scale = tl.load(s_rows + (rows // BR) * s_sr + kk // BC, mask=mask, other=0)
    if SCALE_E8M0:
        scale = tl.exp2((scale.to(tl.int32) & 0xFF).to(tl.float32) - 127.0)
    return w * scale.to(tl.float32)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    N, R, K, BR, BC,
    s_xn,  # x [N, K], last dim contiguous
    s_wr,  # weight bytes [R, K]
    s_sr,  # scale [ceil(R/BR), ceil(K/BC)], last dim contiguous
    s_on,  # out [N, R]
    SCALE_E8M0: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    tokens = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tmask = tokens < N
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < R
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * s_xn
    w_rows = w_ptr + rows.to(tl.int64)[None, :] * s_wr  # int64: R*K passes 2^31 for a 129280-row head
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        kmask = kk < K
        x = tl.load(x_rows + kk[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0).to(COMPUTE)
        w = load_weight_tile(w_rows, s_ptr, rows[None, :], kk[:, None], kmask[:, None] & rmask[None, :], s_sr,
                             BR, BC, 1, SCALE_E8M0)
        acc = tl.dot(x, w.to(COMPUTE), acc, input_precision="ieee")
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * s_on + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tmask[:, None] & rmask[None, :])


# --------------------------------------------------------------------------- launcher
# True when the decorators above produced interpreter functions (TRITON_INTERPRET=1 at import).
INTERPRETED = not isinstance(_fp8_linear_kernel, triton.runtime.JITFunction)


def dot_dtype(dtype: torch.dtype):
    """Dtype of the dot operands (and of triton_moe's h): fp32 under the interpreter (its bf16
    arithmetic is broken) and for fp32 inputs; otherwise the input dtype, for tensor cores with
    fp32 accumulation."""
    if INTERPRETED or dtype == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def fp8_linear_config(tokens: int, dtype: torch.dtype) -> dict:
    """Block sizes from shapes only (not tuned on a GPU yet). Decode (<= 16 rows): the smallest
    tensor-core M and narrow N tiles, so many programs stream the weight; prefill: 64x64 tiles.
    fp32 (FMA dot) takes half the K tile."""
    block_m = 16 if tokens <= 16 else 32 if tokens <= 32 else 64
    return dict(BLOCK_M=block_m, BLOCK_N=32 if block_m == 16 else 64,
                BLOCK_K=64 if dtype == torch.float32 else 128, num_warps=4)


def is_e8m0_scale(scale: torch.Tensor) -> bool:
    return scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None)


def scale_argument(scale: torch.Tensor) -> torch.Tensor:
    """The scale as the kernels read it: e8m0 as its bytes, anything else as float32."""
    scale = scale.contiguous()
    return scale.view(torch.uint8) if is_e8m0_scale(scale) else scale.float()


def fp8_linear(x, weight, scale, block_rows: int, block_cols: int):
    """Triton version of `quantized.fp8_linear_torch` (same arguments)."""
    R, K = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    N = x2.shape[0]
    out = torch.empty(N, R, dtype=x.dtype, device=x.device)
    if N == 0 or R == 0:
        return out.reshape(*lead, R)
    weight_bytes = weight.contiguous().view(torch.uint8)
    s = scale_argument(scale)
    config = fp8_linear_config(N, x.dtype)
    grid = (triton.cdiv(N, config["BLOCK_M"]), triton.cdiv(R, config["BLOCK_N"]))
    _fp8_linear_kernel[grid](
        x2, weight_bytes, s, out, N, R, K, block_rows, block_cols,
        x2.stride(0), weight_bytes.stride(0), s.stride(0), out.stride(0),
        SCALE_E8M0=is_e8m0_scale(scale), COMPUTE=dot_dtype(x.dtype), **config,
    )
    return out.reshape(*lead, R)
