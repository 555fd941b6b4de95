"""Native CPU code for the loops whose torch ops are too many to dispatch one by one.

mHC's Sinkhorn projection is 2 * iters - 1 dependent normalisations of tiny n x n matrices (39
for the default 20 iterations, 4 x 4 matrices): as torch ops, two per normalisation, a third of a
CPU decode step's ops, each a few microseconds of dispatch around nanoseconds of arithmetic. Here
the whole loop is one C function over every matrix, the same arithmetic as `sinkhorn_torch` (each
sum accumulated in float, then x / (sum + eps)), called through ctypes.

The C source below is compiled on first use with the system's C compiler (`cc`, or `$CC`) into
`$DS4_TORCH_CACHE` (default `~/.cache/ds4_torch`), under a name holding the source's hash, and
loaded from there afterwards (`build`, which `cpu_linear.py` uses for its kernels too). Without a
compiler, or with `DS4_TORCH_NATIVE=0`, `sinkhorn()` returns None and callers run the torch loop.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger("ds4_torch")

SOURCE = r"""
/* count matrices of n x n floats, row-major, normalised in place: columns, then rows and columns
   iters - 1 times, each entry x / (sum + eps), each sum accumulated in float in index order. */
void ds4_sinkhorn(float *x, long count, long n, long iters, float eps) {
    for (long m = 0; m < count; m++) {
        float *a = x + m * n * n;
        for (long it = 0; it < iters; it++) {
            if (it > 0) {
                for (long i = 0; i < n; i++) {
                    float s = 0.0f;
                    for (long j = 0; j < n; j++) s += a[i * n + j];
                    s += eps;
                    for (long j = 0; j < n; j++) a[i * n + j] /= s;
                }
            }
            for (long j = 0; j < n; j++) {
                float s = 0.0f;
                for (long i = 0; i < n; i++) s += a[i * n + j];
                s += eps;
                for (long i = 0; i < n; i++) a[i * n + j] /= s;
            }
        }
    }
}
"""

def _cache_dir() -> Path:
    root = os.environ.get("DS4_TORCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ds4_torch")
    return Path(root)


def build(source: str, flags: list[str], name: str = "native") -> Path:
    """`source` (C) compiled into a shared library in the cache, named by the hash of the source,
    the compiler, the flags and (for -march=native) the CPU, built only when absent; its path.
    Raises when the compiler fails or is missing."""
    cc = os.environ.get("CC", "cc")
    salt = [cc, *flags] + ([_cpu_signature()] if any(f.startswith("-march=native") for f in flags) else [])
    digest = hashlib.sha256("\0".join([source, *salt]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            cmd = [cc, *flags, "-shared", "-fPIC", str(src), "-o", str(out)]
            subprocess.run(cmd, check=True, capture_output=True, timeout=300)
            os.replace(out, target)  # atomic: a process beside this one sees the whole file or none
    return target


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (a cache shared by hosts
    of different CPUs keeps one library per CPU)."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(dict.fromkeys(keep))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _build() -> ctypes.CDLL | None:
    # -ffp-contract=off: no fused multiply-adds, the same rounding as the torch loop's ops
    lib = ctypes.CDLL(str(build(SOURCE, ["-O2", "-ffp-contract=off"])))
    lib.ds4_sinkhorn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_float]
    lib.ds4_sinkhorn.restype = None
    return lib


class OnceBuilt:
    """A native library built on first call by `load` (compile, then declare its signatures), once
    per process behind a lock; None when native code is off (`DS4_TORCH_NATIVE=0`) or `load`
    fails (no compiler, a read-only cache: logged once, and the caller's torch path serves)."""

    def __init__(self, load, what: str):
        self.load, self.what = load, what
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def __call__(self) -> ctypes.CDLL | None:
        if self._tried:
            return self._lib
        with self._lock:
            if not self._tried:
                if os.environ.get("DS4_TORCH_NATIVE", "1") != "0":
                    try:
                        self._lib = self.load()
                    except Exception as e:  # noqa: BLE001 - see the class docstring
                        log.info("%s unavailable (%s: %s); using torch ops", self.what, type(e).__name__, e)
                self._tried = True
        return self._lib


library = OnceBuilt(_build, "native CPU kernels")


def sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor | None:
    """`sinkhorn_torch(comb, iters, eps)` in one native call (a new tensor; `comb` is left intact),
    or None when it cannot run here: not a CPU float32 tensor, native code unavailable, or inside
    a trace (make_fx, fake tensors: the call would be invisible to it)."""
    if comb.device.type != "cpu" or comb.dtype != torch.float32 or torch._C._len_torch_dispatch_stack() \
            or comb.requires_grad and torch.is_grad_enabled():
        return None
    lib = library()
    if lib is None:
        return None
    out = comb.contiguous().clone()
    n = out.shape[-1]
    if out.numel():
        lib.ds4_sinkhorn(out.data_ptr(), out.numel() // (n * n), n, int(iters), float(eps))
    return out
