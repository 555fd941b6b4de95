"""The CPU's fastest dense product for a shape (the MoE's experts and the quantized linears use it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# oneDNN's fp32 matmul, the op inductor's CPU fusions call; None where torch was built without it.
ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None

# Weights below this many elements stay on F.linear (see fastest_linear).
ONEDNN_MIN_WEIGHT = 1 << 20


def fastest_linear(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear, routed to the fastest CPU kernel measured for the shape (one thread, AMD EPYC
    with AVX-512 and AVX512-BF16, 4096x4096 weight):
    - one bf16 row goes in as two: torch's 1-row bf16 product takes a slow path (4.2 ms) while two
      rows run oneDNN's bf16 kernel (2.6 ms); the duplicate row costs nothing next to the weight;
    - fp32 with two rows or more goes to oneDNN instead of the BLAS sgemm (6 rows 8.1 vs 10.6 ms,
      96 rows 160 vs 248 ms); one row stays on the BLAS gemv, as fast (3.3 ms). Only for weights
      of ONEDNN_MIN_WEIGHT elements or more: oneDNN's call costs about 9 us more, which a small
      weight never earns back (the embedded model's experts, 256x128: 2-6 rows 12-13 us on
      oneDNN, 3-6 us on F.linear; that made its 4-token verify forwards twice as slow as 3).
    Autograd only goes through F.linear (training)."""
    if x.device.type == "cpu" and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        if x.dtype == torch.bfloat16 and x.shape[0] == 1:
            return F.linear(x.expand(2, -1), weight)[:1]
        if (x.dtype == torch.float32 and x.shape[0] > 1 and ONEDNN_LINEAR is not None
                and weight.numel() >= ONEDNN_MIN_WEIGHT):
            return ONEDNN_LINEAR(x, weight, None, "none", [], "")
    return F.linear(x, weight)
