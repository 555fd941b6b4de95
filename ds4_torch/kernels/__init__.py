"""Attention op backends for DS4.

The model calls attention math only through an `AttentionOps` bundle, so a backend is one
object: `reference` (pure torch, every device) today; the Triton kernels plug in the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import reference


@dataclass(frozen=True)
class AttentionOps:
    name: str
    attention: Callable
    compress_rows: Callable
    indexer_topk: Callable


TORCH_OPS = AttentionOps("torch", reference.attention, reference.compress_rows, reference.indexer_topk)
BACKENDS = ("auto", "torch")


def resolve_backend(name: str, device) -> AttentionOps:
    """The op bundle for `name` on `device` ('auto' picks the best one the device can run)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attn_backend {name!r}; available: {', '.join(BACKENDS)}")
    return TORCH_OPS
