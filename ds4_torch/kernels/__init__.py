"""Attention op backends for DS4.

The model calls attention math only through an `AttentionOps` bundle, so a backend is one
object:
- `TORCH_OPS` ("torch"): the `ds4::*` custom ops over the pure-torch reference; every device.
- `TRITON_OPS` ("triton"): the `ds4::*_triton` custom ops over the Triton kernels; a CUDA GPU,
  or CPU under the Triton interpreter (TRITON_INTERPRET=1, tests only: it is slow).
`resolve_backend(name, device)` picks one; the environment variable DS4_TORCH_ATTN_BACKEND,
when set, overrides `name`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from . import ops


@dataclass(frozen=True)
class AttentionOps:
    name: str
    attention: Callable
    compress_rows: Callable
    indexer_topk: Callable


TORCH_OPS = AttentionOps("torch", ops.attention, ops.compress_rows, ops.indexer_topk)
TRITON_OPS = AttentionOps("triton", ops.attention_triton, ops.compress_rows_triton, ops.indexer_topk_triton)
BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "DS4_TORCH_ATTN_BACKEND"


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(name: str, device) -> AttentionOps:
    """The op bundle for `name` on `device` ('auto' picks the best one the device can run)."""
    name = os.environ.get(ENV_VAR) or name
    if name not in BACKENDS:
        raise ValueError(f"unknown attn_backend {name!r}; available: {', '.join(BACKENDS)}")
    kind = torch.device(device if device is not None else "cpu").type
    if name == "auto":
        return TRITON_OPS if kind == "cuda" and _triton_available() else TORCH_OPS
    if name == "torch":
        return TORCH_OPS
    # name == "triton"
    if not _triton_available():
        raise ValueError("attn_backend 'triton' needs the triton package, which is not installed")
    if kind == "cuda":
        return TRITON_OPS
    if kind == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return TRITON_OPS
        raise ValueError("attn_backend 'triton' needs a CUDA GPU, or TRITON_INTERPRET=1 (set before "
                         "triton is imported) to run its kernels in the interpreter on CPU")
    raise ValueError(f"attn_backend 'triton' is not supported on {kind!r}: Triton needs a CUDA GPU "
                     "(or TRITON_INTERPRET=1 on CPU); use 'torch' or 'auto'")
