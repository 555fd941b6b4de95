"""The CPU's fastest dense product for a shape (the MoE's experts, the quantized linears' prefill
tiles and the model's bf16 linears use it)."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_linear

# oneDNN's fp32 matmul, the op inductor's CPU fusions call; None where torch was built without it.
ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def fastest_linear(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear for x [N, K], routed to the fastest CPU kernel measured for the shape:
    - a bf16 weight and up to `cpu_linear.MAX_ROWS` rows: the native GEMV (`cpu_linear.bf16_linear`:
      the weight read once, rows split over torch's threads); on one thread of the Xeon this was
      measured on, 1.5x torch's bf16 product at one row (a 129280x4096 head), and torch's does not
      get faster with a second thread.
    Otherwise (one thread, AMD EPYC with AVX-512 and AVX512-BF16, 4096x4096 weight):
    - one bf16 row goes in as two: torch's 1-row bf16 product takes a slow path (4.2 ms) while two
      rows run oneDNN's bf16 kernel (2.6 ms); the duplicate row costs nothing next to the weight;
    - fp32 with enough work goes to oneDNN instead of the BLAS sgemm (6 rows 8.1 vs 10.6 ms,
      96 rows 160 vs 248 ms); one row stays on the BLAS gemv, as fast (3.3 ms). oneDNN costs
      about 13 us a call whatever the size, so a small product stays on the sgemm (`_onednn_pays`).
    Autograd only goes through F.linear (training)."""
    if x.device.type == "cpu" and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        if x.dtype == weight.dtype == torch.bfloat16:
            out = cpu_linear.bf16_linear(x, weight)
            if out is not None:
                return out
        if x.dtype == torch.bfloat16 and x.shape[0] == 1:
            return F.linear(x.expand(2, -1), weight)[:1]
        if x.dtype == torch.float32 and ONEDNN_LINEAR is not None and _onednn_pays(x.shape[0], weight.numel()):
            return ONEDNN_LINEAR(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def _onednn_pays(rows: int, weight_numel: int) -> bool:
    """fp32, one thread (same machine): oneDNN against the sgemm, in us. 256x128 weight: 16 rows
    16.4 vs 12.6, 64 rows 28.7 vs 41.3; 512x512: 2 rows 38.7 vs 23.9, 4 rows 38.3 vs 39.7, 16 rows
    63 vs 95; 2048x2048: 2 rows 457 vs 382, 4 rows 454 vs 800; 4096x4096: 2 rows 3043 vs 5149. So
    oneDNN from 4 rows once rows x weight reach 2**20, and from 2 rows past a 2**22 weight."""
    if rows < 2:
        return False
    return (rows >= 4 and rows * weight_numel >= 1 << 20) or weight_numel > 1 << 22


def _linear_forward(module: nn.Linear, x: Tensor) -> Tensor:
    """nn.Linear's forward, with the native GEMV for a bf16 weight and a few rows (decode): the
    same product, the weight read once, split over torch's threads."""
    out = cpu_linear.bf16_linear(x, module.weight) if module.weight.dtype == x.dtype == torch.bfloat16 else None
    if out is None:
        return F.linear(x, module.weight, module.bias)
    return out if module.bias is None else out + module.bias


def use_native_linears(model: nn.Module) -> None:
    """Every plain nn.Linear in `model` multiplies through `_linear_forward` from now on (an
    instance attribute `forward`: the module stays an nn.Linear for the loader, tensor parallelism
    and state dicts; hooks still run). Eager CPU decode only: on other devices, more rows, inside
    traces and torch.compile, and with autograd, it is F.linear."""
    for module in model.modules():
        if type(module) is nn.Linear and "forward" not in module.__dict__:
            module.forward = partial(_linear_forward, module)
