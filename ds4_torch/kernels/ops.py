"""The DS4 attention ops: one `torch.ops.ds4.*` custom op per function, dispatched by device.

    ds4::attention(q, ring, chunk_kv, start, comp, comp_sel?, rate, sinks, scale, backend,
                   comp_slots?) -> Tensor
    ds4::compress_rows(kv, gate, norm_weight, eps, cos, sin, backend) -> Tensor
    ds4::indexer_topk(q, head_weights, rows, start, rate, k, backend, rows_slots?) -> Tensor (int64)

`comp_slots` / `rows_slots` [B, C] int64 (paged caches): `comp` / `rows` is then a pool [P, D]
shared by every sequence, row w of sequence b at pool row slots[b, w]; the Triton kernels read it
in place, the reference gathers it. Without them (static caches) the rows are [B, C, D].

Each op has two implementations, picked by the dispatcher from the inputs' device:
- CUDA: the Triton kernel (`triton_kernels.py`), imported on first use;
- every other device (CPU, MPS, ...): the torch reference (`reference.py`).
plus a fake (shapes only) for `torch.compile` / `make_fx` tracing, so each op is one graph node.

`backend` forces a choice where a test or benchmark needs one: "auto" (the device's own
implementation), "torch" (the reference on any device), "triton" (the Triton kernel: on CUDA,
or on CPU under the Triton interpreter, TRITON_INTERPRET=1 set before triton is imported;
anything else raises ValueError naming the problem). Because the choice is an argument, not a
bundle bound to a device, `model.to("cuda")` switches kernels with no rebuild.

None of the ops mutates its inputs or returns an alias of one. Shapes and semantics: see
`reference.py`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch
from torch import Tensor

from . import reference
from .registration import define_op

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "DS4_TORCH_ATTN_BACKEND"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend_name(name: str | None) -> str:
    """The backend a model asked for, after the DS4_TORCH_ATTN_BACKEND override; validated."""
    name = os.environ.get(ENV_VAR) or name or "auto"
    if name not in BACKENDS:
        raise ValueError(f"unknown attn_backend {name!r} (from {ENV_VAR} or the argument); "
                         f"available: {', '.join(BACKENDS)}")
    return name


def kernel_for(backend: str, device) -> str:
    """Which implementation `backend` runs on `device`: "torch" or "triton". Raises ValueError
    when the choice cannot run there (checked on the host, before any kernel is launched)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attn_backend {backend!r}; available: {', '.join(BACKENDS)}")
    kind = torch.device(device if device is not None else "cpu").type
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if kind == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise ValueError("attn_backend 'triton' needs the triton package, which is not installed")
    if kind == "cuda":
        return "triton"
    if kind == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return "triton"
        raise ValueError("attn_backend 'triton' needs a CUDA GPU, or TRITON_INTERPRET=1 (set before "
                         "triton is imported) to run its kernels in the interpreter on CPU")
    raise ValueError(f"attn_backend 'triton' is not supported on {kind!r}: Triton needs a CUDA GPU "
                     "(or TRITON_INTERPRET=1 on CPU); use 'torch' or 'auto'")


def _kernels(backend: str, device: torch.device):
    if kernel_for(backend, device) == "torch":
        return reference
    from . import triton_kernels  # deferred: needs triton, and TRITON_INTERPRET is read at import

    return triton_kernels


# --------------------------------------------------------------------------- fakes (shapes only)
def _attention_fake(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale, backend, comp_slots=None):
    return q.new_empty(q.shape)


def _compress_rows_fake(kv, gate, norm_weight, eps, cos, sin, backend):
    B, J, _, D = kv.shape
    return kv.new_empty(B, J, D)


def _indexer_topk_fake(q, head_weights, rows, start, rate, k, backend, rows_slots=None):
    B, T = q.shape[:2]
    C = (rows if rows_slots is None else rows_slots).shape[1]  # a pool's rows are the slots'
    return q.new_empty(B, T, min(k, C), dtype=torch.int64)


# --------------------------------------------------------------------------- ops
# The schema is read from the annotations, so each op spells its signature out. The body serves
# every device: the Triton kernel on CUDA ("auto"/"triton"), the reference elsewhere (CPU, MPS) or
# when "torch" is forced, Triton's interpreter when forced off CUDA.
@define_op("attention", _attention_fake)
def attention(q: Tensor, ring: Tensor, chunk_kv: Tensor, start: Tensor, comp: Tensor,
              comp_sel: Optional[Tensor], rate: int, sinks: Tensor, scale: float, backend: str,
              comp_slots: Optional[Tensor] = None) -> Tensor:
    return _kernels(backend, q.device).attention(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale,
                                                 comp_slots)


@define_op("compress_rows", _compress_rows_fake)
def compress_rows(kv: Tensor, gate: Tensor, norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                  backend: str) -> Tensor:
    return _kernels(backend, kv.device).compress_rows(kv, gate, norm_weight, eps, cos, sin)


@define_op("indexer_topk", _indexer_topk_fake)
def indexer_topk(q: Tensor, head_weights: Tensor, rows: Tensor, start: Tensor, rate: int, k: int,
                 backend: str, rows_slots: Optional[Tensor] = None) -> Tensor:
    return _kernels(backend, q.device).indexer_topk(q, head_weights, rows, start, rate, k, rows_slots)
