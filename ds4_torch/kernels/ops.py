"""The DS4 attention ops as torch custom ops, so `torch.compile` / `make_fx` see one node each.

Registered ops (namespace `ds4`), each with a fake (meta) implementation for tracing:

    ds4::attention(q, ring, chunk_kv, start, comp, comp_sel?, rate, sinks, scale) -> Tensor
    ds4::compress_rows(kv, gate, norm_weight, eps, cos, sin) -> Tensor
    ds4::indexer_topk(q, head_weights, rows, start, rate, k) -> Tensor (int64)
        implementation: the torch reference (`reference.py`); runs on every device (CPU, CUDA, MPS).
    ds4::attention_triton, ds4::compress_rows_triton, ds4::indexer_topk_triton (same schemas)
        implementation: the Triton kernels (`triton_kernels.py`). On a CUDA GPU they compile; on
        CPU they run only under the Triton interpreter (TRITON_INTERPRET=1 set before the first
        call imports `triton_kernels`). `triton_kernels` is imported on first use, so this module
        loads on machines without Triton.

None of the ops mutates its inputs or returns an alias of one. Shapes and semantics: see
`reference.py`. The Python functions at the bottom (`attention`, `compress_rows`, ...) have the
reference signatures (comp_sel may be None, int rate, float scale/eps) and are what
`AttentionOps` bundles hold.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reference


def _triton():
    from . import triton_kernels  # deferred: needs triton, and TRITON_INTERPRET read at import

    return triton_kernels


# --------------------------------------------------------------------------- ops
# custom_op reads the schema from the annotations, so each op spells its signature out.
@torch.library.custom_op("ds4::attention", mutates_args=())
def attention_op(q: Tensor, ring: Tensor, chunk_kv: Tensor, start: Tensor, comp: Tensor,
                 comp_sel: Optional[Tensor], rate: int, sinks: Tensor, scale: float) -> Tensor:
    return reference.attention(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale)


@torch.library.custom_op("ds4::attention_triton", mutates_args=())
def attention_triton_op(q: Tensor, ring: Tensor, chunk_kv: Tensor, start: Tensor, comp: Tensor,
                        comp_sel: Optional[Tensor], rate: int, sinks: Tensor, scale: float) -> Tensor:
    return _triton().attention(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale)


@torch.library.custom_op("ds4::compress_rows", mutates_args=())
def compress_rows_op(kv: Tensor, gate: Tensor, norm_weight: Tensor, eps: float, cos: Tensor,
                     sin: Tensor) -> Tensor:
    return reference.compress_rows(kv, gate, norm_weight, eps, cos, sin)


@torch.library.custom_op("ds4::compress_rows_triton", mutates_args=())
def compress_rows_triton_op(kv: Tensor, gate: Tensor, norm_weight: Tensor, eps: float, cos: Tensor,
                            sin: Tensor) -> Tensor:
    return _triton().compress_rows(kv, gate, norm_weight, eps, cos, sin)


@torch.library.custom_op("ds4::indexer_topk", mutates_args=())
def indexer_topk_op(q: Tensor, head_weights: Tensor, rows: Tensor, start: Tensor, rate: int,
                    k: int) -> Tensor:
    return reference.indexer_topk(q, head_weights, rows, start, rate, k)


@torch.library.custom_op("ds4::indexer_topk_triton", mutates_args=())
def indexer_topk_triton_op(q: Tensor, head_weights: Tensor, rows: Tensor, start: Tensor, rate: int,
                           k: int) -> Tensor:
    return _triton().indexer_topk(q, head_weights, rows, start, rate, k)


# Fake implementations (shapes only), shared by the reference and the Triton op of each pair.
@attention_op.register_fake
@attention_triton_op.register_fake
def _attention_fake(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale):
    return q.new_empty(q.shape)


@compress_rows_op.register_fake
@compress_rows_triton_op.register_fake
def _compress_rows_fake(kv, gate, norm_weight, eps, cos, sin):
    B, J, _, D = kv.shape
    return kv.new_empty(B, J, D)


@indexer_topk_op.register_fake
@indexer_topk_triton_op.register_fake
def _indexer_topk_fake(q, head_weights, rows, start, rate, k):
    B, T = q.shape[:2]
    return q.new_empty(B, T, min(k, rows.shape[1]), dtype=torch.int64)


# --------------------------------------------------------------------------- wrappers
# The reference signatures, for AttentionOps. int()/float() keep the schema's scalar types even
# when a caller hands a numpy or tensor scalar.
def attention(q, ring, chunk_kv, start, comp, comp_sel, rate: int, sinks, scale: float):
    return attention_op(q, ring, chunk_kv, start, comp, comp_sel, int(rate), sinks, float(scale))


def compress_rows(kv, gate, norm_weight, eps: float, cos, sin):
    return compress_rows_op(kv, gate, norm_weight, float(eps), cos, sin)


def indexer_topk(q, head_weights, rows, start, rate: int, k: int):
    return indexer_topk_op(q, head_weights, rows, start, int(rate), int(k))


def attention_triton(q, ring, chunk_kv, start, comp, comp_sel, rate: int, sinks, scale: float):
    return attention_triton_op(q, ring, chunk_kv, start, comp, comp_sel, int(rate), sinks, float(scale))


def compress_rows_triton(kv, gate, norm_weight, eps: float, cos, sin):
    return compress_rows_triton_op(kv, gate, norm_weight, float(eps), cos, sin)


def indexer_topk_triton(q, head_weights, rows, start, rate: int, k: int):
    return indexer_topk_triton_op(q, head_weights, rows, start, int(rate), int(k))
