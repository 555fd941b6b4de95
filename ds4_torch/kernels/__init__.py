"""The DS4 attention kernels.

`ops` registers one `torch.ops.ds4.*` custom op per function (attention, compress_rows,
indexer_topk): the Triton kernel on CUDA, the torch reference (`reference`) elsewhere. The model
calls them through an `AttentionOps` bundle for a backend *name* ("auto", "torch", "triton"),
never bound to a device, so moving the model between devices switches kernels by itself.
A bundle is also the hook tools use to watch the calls (`attention_trace`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import torch

from . import ops, reference
from .ops import BACKENDS, ENV_VAR, backend_name, kernel_for, triton_available

__all__ = ["AttentionOps", "BACKENDS", "ENV_VAR", "attention_ops", "backend_name", "kernel_for", "ops",
           "triton_available"]


@dataclass(frozen=True)
class AttentionOps:
    """The attention math the model calls, with the reference signatures (see `reference.py`):
    `attention(..., comp_slots=None)` and `indexer_topk(..., rows_slots=None)` take a paged pool
    and its slots where a cache is paged."""
    name: str
    attention: Callable
    compress_rows: Callable
    indexer_topk: Callable


def _eager_reference(backend: str, x: torch.Tensor) -> bool:
    """Whether a call may run the reference directly instead of through its custom op: in eager
    mode (torch.compile keeps the op, one graph node) on a device whose kernel for `backend` is the
    reference anyway. The op's dispatch costs ~25 us a call on a CPU, about what the reference
    itself costs at decode sizes."""
    if torch.compiler.is_compiling():
        return False
    return backend == "torch" or (backend == "auto" and x.device.type != "cuda")


def _attention(backend, q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale, comp_slots=None):
    # int()/float() keep the schema's scalar types when a caller hands numpy or tensor scalars.
    if _eager_reference(backend, q):
        return reference.attention(q, ring, chunk_kv, start, comp, comp_sel, int(rate), sinks, float(scale),
                                   comp_slots)
    return ops.attention(q, ring, chunk_kv, start, comp, comp_sel, int(rate), sinks, float(scale), backend,
                         comp_slots)


def _compress_rows(backend, kv, gate, norm_weight, eps, cos, sin):
    if _eager_reference(backend, kv):
        return reference.compress_rows(kv, gate, norm_weight, float(eps), cos, sin)
    return ops.compress_rows(kv, gate, norm_weight, float(eps), cos, sin, backend)


def _indexer_topk(backend, q, head_weights, rows, start, rate, k, rows_slots=None):
    if _eager_reference(backend, q):
        return reference.indexer_topk(q, head_weights, rows, start, int(rate), int(k), rows_slots)
    return ops.indexer_topk(q, head_weights, rows, start, int(rate), int(k), backend, rows_slots)


@lru_cache(maxsize=None)
def attention_ops(backend: str = "auto") -> AttentionOps:
    """The `ds4::*` ops with `backend` ("auto", "torch" or "triton") fixed; valid on every device."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attn_backend {backend!r}; available: {', '.join(BACKENDS)}")
    return AttentionOps(backend, partial(_attention, backend), partial(_compress_rows, backend),
                        partial(_indexer_topk, backend))
