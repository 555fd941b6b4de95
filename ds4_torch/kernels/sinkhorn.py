"""mHC's Sinkhorn-Knopp projection as one op: `torch.ops.ds4.sinkhorn`.

    ds4::sinkhorn(comb [..., n, n] fp32, iters: int, eps: float, backend: str) -> [..., n, n] fp32

transformers' loop on each n x n matrix: columns normalised, then rows and columns iters-1 times,
each x / (sum + eps). 2 * iters - 1 dependent normalisations: as separate torch ops they were a
third of a decode step's ops, so each implementation runs the whole loop in one call:
- every device without a kernel of its own (CPU, MPS), and "torch": `sinkhorn_torch` below, two
  ops a normalisation whatever the number of matrices (also differentiable, for training);
- CPU with "auto", outside traces and autograd: the same loop in one native call
  (`native.sinkhorn`, C compiled on first use; the torch loop where it cannot be built);
- CUDA ("auto" / "triton"), or CPU under TRITON_INTERPRET=1 with "triton": one Triton kernel
  (`triton_kernels.sinkhorn`) that keeps each matrix in registers for the whole loop.
Backends are chosen as for the attention ops (`ops.kernel_for`). The op never mutates its input.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _eager_reference, native
from .ops import kernel_for
from .registration import define_op

__all__ = ["sinkhorn", "sinkhorn_op", "sinkhorn_torch"]


def sinkhorn_torch(comb: Tensor, iters: int, eps: float) -> Tensor:
    """The torch implementation. The N matrices are laid out [i, j, N] so that each normalisation
    is one batched matmul (the sums, eps added by it) and one division, whatever N: two ops a step
    instead of three, and no per-matrix matmul overhead in prefill."""
    n = comb.shape[-1]
    # [i, j, N], always a copy (with N = 1 the permuted view is already contiguous): divided in place
    m = comb.reshape(-1, n, n).permute(1, 2, 0).clone(memory_format=torch.contiguous_format)
    N = m.shape[-1]
    eps_t = m.new_full((1, 1, 1), eps)
    ones = m.new_ones(n, 1, n)
    one = ones[:1]
    grad = torch.is_grad_enabled()  # autograd keeps every step's input: out of place then
    row_sums, col_sums = m.new_empty(n, 1, N), m.new_empty(1, 1, n * N)

    def normalised(x, weights, sums):  # x / (weights @ x + eps)
        if grad:
            return x / torch.baddbmm(eps_t, weights, x)
        return x.div_(torch.baddbmm(eps_t, weights, x, out=sums))

    # Two views of one buffer: by rows [i, j, N] (sums over j) and by columns [1, i, (j, N)] (sums
    # over i). Dividing in place through one updates the other.
    rows, cols = m.view(n, n, N), m.view(1, n, n * N)
    cols = normalised(cols, one, col_sums)
    for _ in range(iters - 1):
        rows = normalised(cols.view(n, n, N) if grad else rows, ones, row_sums)
        cols = normalised(rows.view(1, n, n * N) if grad else cols, one, col_sums)
    return cols.view(n, n, N).permute(2, 0, 1).contiguous().view(comb.shape)  # back to [..., n, n]


def _native_or_torch(comb: Tensor, iters: int, eps: float) -> Tensor:
    """The native loop (`native.sinkhorn`: one C call) where it can run, else `sinkhorn_torch`."""
    out = native.sinkhorn(comb, iters, eps)
    return sinkhorn_torch(comb, iters, eps) if out is None else out


def check_sinkhorn_inputs(comb: Tensor, iters: int) -> None:
    if comb.dim() < 2 or comb.shape[-1] != comb.shape[-2] or comb.dtype != torch.float32:
        raise ValueError(f"sinkhorn: comb must be float32 [..., n, n], got {comb.dtype} {tuple(comb.shape)}")
    if iters < 1:
        raise ValueError(f"sinkhorn: iters must be >= 1, got {iters}")


def _implementation(backend: str, device: torch.device):
    if kernel_for(backend, device) == "torch":
        return _native_or_torch if backend == "auto" else sinkhorn_torch
    from . import triton_kernels  # deferred: needs triton, and TRITON_INTERPRET is read at import

    return triton_kernels.sinkhorn


def _sinkhorn_fake(comb, iters, eps, backend):
    check_sinkhorn_inputs(comb, iters)
    return comb.new_empty(comb.shape)


@define_op("sinkhorn", _sinkhorn_fake)
def sinkhorn_op(comb: Tensor, iters: int, eps: float, backend: str) -> Tensor:
    check_sinkhorn_inputs(comb, iters)
    return _implementation(backend, comb.device)(comb, iters, eps)


def sinkhorn(comb: Tensor, iters: int, eps: float, backend: str = "auto") -> Tensor:
    """What the model calls: the op, or `sinkhorn_torch` directly where the op would run it anyway
    in eager mode (the dispatch alone costs about what the loop does at decode sizes), and where
    autograd records (training: the op is forward-only)."""
    if (torch.is_grad_enabled() and comb.requires_grad) or _eager_reference(backend, comb):
        if backend == "auto":  # the native loop on CPU, when it can run (not inside a trace, no autograd)
            check_sinkhorn_inputs(comb, iters)
            return _native_or_torch(comb, int(iters), float(eps))
        return sinkhorn_torch(comb, int(iters), float(eps))
    return sinkhorn_op(comb, int(iters), float(eps), backend)
