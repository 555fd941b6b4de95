"""Native CPU products for decode: x [N <= 16, K] times a weight read once, as it is stored.

    bf16_linear(x, weight [R, K] bf16)                                   the head, every dense linear
    fp8_linear(x, weight [R, K] e4m3, scale [ceil(R/bm), ceil(K/bn)], bm, bn)   attention, shared expert
    fp4_linear(x, packed [R, K/2] e2m1 x2, scale [R, K/32] e8m0)         routed experts

Each returns `x @ W.T` in x's dtype (bf16 or float32), W being the weight as `quant.dequantize`
gives it, with exact products summed in float32, or None when it cannot run here (not a CPU
tensor, another dtype, more than `MAX_ROWS` rows, autograd recording, inside a trace, or no
compiler): callers then run their torch code. For prefill (more rows), `dequantize_fp8_rows` /
`dequantize_fp4_rows` unpack a tile of rows in one pass for torch's dense product.

Why native code: torch has no product that reads FP8 block-scaled or FP4 bytes, so the torch path
unpacks each weight into a tile in several passes and multiplies that; and its 1-row bf16 product
is not the fastest GEMV on every CPU. Here each weight byte is read once per step, unpacked in
registers or a 4-row tile in L1 (`cpu_linear.c` says how), and the weight's rows are split over
torch's thread count (`torch.set_num_threads`, `--threads`): the calling thread and helper threads
of the library's own take units of rows as they come free, and the caller never waits for a
helper that has not started (OpenMP's closing barrier does: on a loaded machine a second thread
made a step many times slower).

The C source (`cpu_linear.c`) is compiled on first use with the system's C compiler (`cc`, or
`$CC`), `-O3 -march=native -pthread` (AVX-512 paths where the CPU has them, portable loops
elsewhere), into the cache of `native.py` (one library per CPU model). Without a
compiler, or with `DS4_TORCH_NATIVE=0`, nothing here runs.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from . import native

__all__ = ["MAX_ROWS", "available", "bf16_linear", "fp8_linear", "fp4_linear", "fp8_linear_groups",
           "fp4_linear_groups", "dequantize_fp8_rows", "dequantize_fp4_rows", "features", "read_words"]

# Rows of x the native products take. Above it (prefill) a dense product (oneDNN, AMX where the CPU
# has it) on unpacked tiles is faster than a GEMV that re-reads the tile for every 4 rows.
MAX_ROWS = 16

SOURCE = Path(__file__).with_name("cpu_linear.c")
# Tried in order: the first that compiles serves (a compiler without -march=native, a system
# without pthreads: one thread).
FLAG_SETS = (["-O3", "-march=native", "-pthread"], ["-O3", "-pthread"], ["-O3", "-DDS4_SINGLE_THREAD"])

_long, _int, _ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "ds4_linear_bf16": [_ptr, _int, _long, _long, _ptr, _long, _long, _ptr, _int, _long, _int],
    "ds4_linear_fp8": [_ptr, _int, _long, _long, _ptr, _long, _long, _ptr, _long, _long, _long, _ptr, _int, _long,
                       _int],
    "ds4_linear_fp4": [_ptr, _int, _long, _long, _ptr, _long, _long, _ptr, _long, _ptr, _int, _long, _int],
    "ds4_linear_fp4_groups": [_long, _ptr, _ptr, _int, _long, _ptr, _long, _long, _ptr, _long, _ptr, _int, _long,
                              _int],
    "ds4_linear_fp8_groups": [_long, _ptr, _ptr, _int, _long, _ptr, _long, _long, _ptr, _long, _long, _long, _ptr,
                              _int, _long, _int],
    "ds4_dequantize_fp8": [_ptr, _long, _long, _long, _ptr, _long, _long, _long, _ptr, _int, _int],
    "ds4_dequantize_fp4": [_ptr, _long, _long, _long, _ptr, _long, _ptr, _int, _int],
    "ds4_features": [],
    "ds4_read_words": [_ptr, _long, _int],
}


def _load() -> ctypes.CDLL:
    source = SOURCE.read_text()
    errors = []
    for flags in FLAG_SETS:
        try:
            lib = ctypes.CDLL(str(native.build(source, flags, "cpu_linear")))
            break
        except Exception as e:  # noqa: BLE001 - the next flag set, or the torch path
            errors.append(f"{' '.join(flags)}: {type(e).__name__}: {getattr(e, 'stderr', b'')[-300:] or e}")
    else:
        raise RuntimeError("; ".join(errors))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_uint64 if name == "ds4_read_words" else ctypes.c_int
    return lib


library = native.OnceBuilt(_load, "native CPU linears")


def available() -> bool:
    return library() is not None


def features() -> dict:
    """What the compiled library uses on this CPU (for reports and tests): {} when unavailable."""
    lib = library()
    if lib is None:
        return {}
    bits = lib.ds4_features()
    return {"avx512": bool(bits & 1), "threads": bool(bits & 4)}


def read_words(data: Tensor, threads: int) -> int | None:
    """The sum (mod 2^64) of a contiguous CPU tensor's 64-bit words, read by `threads` threads as
    the products read their weights; None without native code. What `bench quant` times as the
    machine's read bandwidth (torch's own sum does not read faster with more threads here)."""
    lib = library()
    if lib is None or data.device.type != "cpu" or not data.is_contiguous() or data.nbytes % 8:
        return None
    return lib.ds4_read_words(data.data_ptr(), data.nbytes // 8, threads)


def _runnable(x: Tensor, *weights: Tensor) -> bool:
    """CPU, x bf16/float32, outside traces (make_fx, fake tensors: a ctypes call is invisible to
    them), torch.compile and autograd."""
    return (not torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
            and all(w.device.type == "cpu" for w in weights) and not torch._C._len_torch_dispatch_stack()
            and not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))))


def _rows_view(w: Tensor) -> bool:
    """Rows of contiguous elements, as a slice of a bigger matrix may be."""
    return w.dim() == 2 and (w.stride(1) == 1 or w.shape[1] <= 1) and w.stride(0) >= w.shape[1]


def _prepare(x: Tensor, K: int, weight: Tensor, max_rows: int):
    if not _runnable(x, weight) or not _rows_view(weight) or x.shape[-1] != K:
        return None
    x2 = x.reshape(-1, K)
    if x2.shape[0] > max_rows or x2.shape[0] == 0:
        return None
    lib = library()
    if lib is None:
        return None
    x2 = x2.contiguous()
    return lib, x2, x2.new_empty(x2.shape[0], weight.shape[0])


def _finish(rc: int, x: Tensor, out: Tensor) -> Tensor | None:
    if rc != 0:  # out of memory in the kernel: the caller's torch path
        return None
    return out.view(*x.shape[:-1], out.shape[-1])


def bf16_linear(x: Tensor, weight: Tensor, max_rows: int = MAX_ROWS) -> Tensor | None:
    """x [..., K] @ weight.T for a bf16 weight [R, K]; None where it cannot run (see the module)."""
    if weight.dtype != torch.bfloat16:
        return None
    prepared = _prepare(x, weight.shape[-1], weight, max_rows)
    if prepared is None:
        return None
    lib, x2, out = prepared
    R, K = weight.shape
    rc = lib.ds4_linear_bf16(x2.data_ptr(), x2.dtype == torch.bfloat16, x2.shape[0], K, weight.data_ptr(),
                             weight.stride(0), R, out.data_ptr(), out.dtype == torch.bfloat16, R,
                             torch.get_num_threads())
    return _finish(rc, x, out)


def _float_scale(scale: Tensor) -> Tensor:
    from ..quant import scale_to_float

    return scale_to_float(scale).contiguous()


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, block_rows: int, block_cols: int,
               max_rows: int = MAX_ROWS) -> Tensor | None:
    """x [..., K] @ dequantize_fp8(weight, scale).T, float8_e4m3fn weight [R, K] with a block
    scale [ceil(R / block_rows), ceil(K / block_cols)]; None where it cannot run."""
    if weight.dtype != torch.float8_e4m3fn or block_cols % 32 or block_rows < 1:
        return None
    prepared = _prepare(x, weight.shape[-1], weight, max_rows)
    if prepared is None:
        return None
    lib, x2, out = prepared
    R, K = weight.shape
    s = _float_scale(scale)
    rc = lib.ds4_linear_fp8(x2.data_ptr(), x2.dtype == torch.bfloat16, x2.shape[0], K, weight.data_ptr(),
                            weight.stride(0), R, s.data_ptr(), block_rows, block_cols, s.stride(0), out.data_ptr(),
                            out.dtype == torch.bfloat16, R, torch.get_num_threads())
    return _finish(rc, x, out)


def _e8m0_bytes(scale: Tensor, rows: int, K: int) -> Tensor | None:
    """FP4 scales as e8m0 bytes [rows, K/32] (row stride free), or None for another format."""
    from ..quant import is_e8m0_dtype

    if not is_e8m0_dtype(scale.dtype) or K % 32 or tuple(scale.shape) != (rows, K // 32):
        return None
    scale = scale.view(torch.uint8)
    return scale if scale.stride(-1) == 1 else scale.contiguous()


def fp4_linear(x: Tensor, packed: Tensor, scale: Tensor, max_rows: int = MAX_ROWS) -> Tensor | None:
    """x [..., K] @ dequantize_fp4(packed, scale).T, FP4 bytes [R, K/2] with e8m0 scales [R, K/32]
    (uint8 or float8_e8m0fnu); None where it cannot run (float32 scales among others)."""
    R, K = packed.shape[0], 2 * packed.shape[-1]
    s = _e8m0_bytes(scale, R, K)
    if s is None or packed.element_size() != 1:
        return None
    prepared = _prepare(x, K, packed, max_rows)
    if prepared is None:
        return None
    lib, x2, out = prepared
    rc = lib.ds4_linear_fp4(x2.data_ptr(), x2.dtype == torch.bfloat16, x2.shape[0], K, packed.data_ptr(),
                            packed.stride(0), R, s.data_ptr(), s.stride(0), out.data_ptr(),
                            out.dtype == torch.bfloat16, R, torch.get_num_threads())
    return _finish(rc, x, out)


def fp8_linear_groups(x: Tensor, weight: Tensor, scale: Tensor, block_rows: int, block_cols: int,
                      max_rows: int = MAX_ROWS) -> Tensor | None:
    """A grouped FP8 projection (attention's wo_a) in one native call: x [..., G, K], group g
    times its own rows of weight [G * R, K] (each group starting on a block row of scale): out
    [..., G, R], the same bits as `fp8_linear` on each group. None where it cannot run."""
    G, K = x.shape[-2], x.shape[-1]
    if weight.dtype != torch.float8_e4m3fn or block_cols % 32 or block_rows < 1 or weight.shape[0] % G \
            or (weight.shape[0] // G) % block_rows or scale.shape[0] % G:
        return None
    R, blocks = weight.shape[0] // G, scale.shape[0] // G
    n = x[..., 0, 0].numel()
    if not _runnable(x, weight) or not _rows_view(weight) or weight.shape[1] != K or not 1 <= n <= max_rows:
        return None
    lib = library()
    if lib is None:
        return None
    xg = x.reshape(n, G, K).transpose(0, 1).contiguous()  # [G, n, K]: each group's rows together
    out = xg.new_empty(n, G, R)
    s = _float_scale(scale)
    esize, pointers = xg.element_size(), ctypes.c_void_p * G
    rc = lib.ds4_linear_fp8_groups(
        G, pointers(*[xg.data_ptr() + g * n * K * esize for g in range(G)]), (ctypes.c_long * G)(*[n] * G),
        xg.dtype == torch.bfloat16, K, pointers(*[weight.data_ptr() + g * R * weight.stride(0) for g in range(G)]),
        weight.stride(0), R, pointers(*[s.data_ptr() + g * blocks * s.stride(0) * 4 for g in range(G)]),
        block_rows, block_cols, s.stride(0), pointers(*[out.data_ptr() + g * R * esize for g in range(G)]),
        out.dtype == torch.bfloat16, G * R, torch.get_num_threads())
    return out.view(*x.shape[:-1], R) if rc == 0 else None


def fp4_linear_groups(xs: list[Tensor], packed: Tensor, scale: Tensor, experts: list[int],
                      max_rows: int = MAX_ROWS) -> list[Tensor] | None:
    """[xs[i] @ dequantize_fp4(packed[experts[i]], scale[experts[i]]).T for each i] in one native
    call (the same bits as `fp4_linear` on each), FP4 bytes [E, R, K/2] with e8m0 scales
    [E, R, K/32]; each xs[i] [n_i, K] with 1 <= n_i <= max_rows, one dtype. None where it cannot run.
    What a decode step's routed experts use: their rows go to the threads as one piece of work."""
    if not xs or packed.dim() != 3 or packed.element_size() != 1 or len(xs) != len(experts):
        return None
    from ..quant import is_e8m0_dtype

    E, R, K = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
    if tuple(scale.shape) != (E, R, K // 32) or not is_e8m0_dtype(scale.dtype) or K % 32 \
            or not _rows_view(packed[0]) or not all(0 <= e < E for e in experts):
        return None
    dtype = xs[0].dtype
    if any(x.dtype != dtype or x.dim() != 2 or x.shape[1] != K or not 1 <= x.shape[0] <= max_rows
           or not _runnable(x, packed) for x in xs):
        return None
    lib = library()
    if lib is None:
        return None
    s = scale.view(torch.uint8)
    if s.stride(2) != 1:
        s = s.contiguous()
    xs = [x.contiguous() for x in xs]
    outs = [x.new_empty(x.shape[0], R) for x in xs]
    G = len(xs)
    pointers = (ctypes.c_void_p * G)
    rc = lib.ds4_linear_fp4_groups(
        G, pointers(*[x.data_ptr() for x in xs]), (ctypes.c_long * G)(*[x.shape[0] for x in xs]),
        dtype == torch.bfloat16, K, pointers(*[packed.data_ptr() + e * packed.stride(0) for e in experts]),
        packed.stride(1), R, pointers(*[s.data_ptr() + e * s.stride(0) for e in experts]), s.stride(1),
        pointers(*[o.data_ptr() for o in outs]), dtype == torch.bfloat16, R, torch.get_num_threads())
    return outs if rc == 0 else None


def _into_ok(weight: Tensor, out: Tensor, K: int) -> bool:
    return (_rows_view(weight) and out.dtype in (torch.bfloat16, torch.float32) and out.is_contiguous()
            and tuple(out.shape) == (weight.shape[0], K) and _runnable(out, weight))


def dequantize_fp8_rows(weight: Tensor, scale: Tensor, block_rows: int, block_cols: int, out: Tensor) -> bool:
    """out [R, K] (bf16 or float32, contiguous) = dequantize_fp8(weight, scale) in one pass; False
    (out untouched) where it cannot run. `scale` is the grid of these rows (block row 0 first)."""
    K = weight.shape[-1]
    if weight.dtype != torch.float8_e4m3fn or not _into_ok(weight, out, K) or library() is None:
        return False
    s = _float_scale(scale)
    return library().ds4_dequantize_fp8(weight.data_ptr(), weight.stride(0), weight.shape[0], K, s.data_ptr(),
                                        block_rows, block_cols, s.stride(0), out.data_ptr(),
                                        out.dtype == torch.float32, torch.get_num_threads()) == 0


def dequantize_fp4_rows(packed: Tensor, scale: Tensor, out: Tensor) -> bool:
    """out [R, K] (bf16 or float32, contiguous) = dequantize_fp4(packed, scale) in one pass; False
    (out untouched) where it cannot run."""
    R, K = packed.shape[0], 2 * packed.shape[-1]
    s = _e8m0_bytes(scale, R, K)
    if s is None or packed.element_size() != 1 or not _into_ok(packed, out, K) or library() is None:
        return False
    return library().ds4_dequantize_fp4(packed.data_ptr(), packed.stride(0), R, K, s.data_ptr(), s.stride(0),
                                        out.data_ptr(), out.dtype == torch.float32, torch.get_num_threads()) == 0
