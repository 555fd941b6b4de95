"""Block-quantized weight formats used by DeepSeek-V4 checkpoints, and the
modules that keep such weights quantized in memory (``quantized="keep"``).

Formats
-------
* **FP8 block**: weight ``torch.float8_e4m3fn`` ``[out, in]`` plus a block scale
  ``[ceil(out/128), ceil(in/128)]`` (float32, ``torch.float8_e8m0fnu`` or
  ``uint8`` holding an e8m0 exponent, i.e. ``2 ** (byte - 127)``).
  ``w = w_fp8.float() * scale`` expanded per 128x128 block (cropped at the edges
  when ``out``/``in`` are not multiples of 128).
* **FP4 (e2m1) experts**: weight ``int8`` (or ``torch.float4_e2m1fn_x2``)
  ``[out, in/2]``, two e2m1 codes per byte, LOW nibble first; scale
  ``[out, in/32]`` e8m0 per 32-wide group. Same semantics as transformers'
  ``Fp8Dequantize._unpack_fp4`` / ``_dequantize_one``.

All dequantization goes through :func:`dequantize` (leading batch dims are
allowed, e.g. stacked experts ``[E, out, in]`` with scales ``[E, sr, sc]``).

Keep-mode contract
------------------
* :class:`FP8BlockLinear` replaces *exact* ``nn.Linear`` instances and grouped
  projections (``nn.Linear`` subclasses with a ``groups`` attribute, whose forward
  maps ``[..., groups, in]`` to ``[..., groups, out/groups]``), under the same
  attribute name on the parent. Buffers: ``weight`` (float8_e4m3fn ``[out, in]``)
  and ``weight_scale_inv`` (float32 block scale); ``bias`` is the original bias
  Parameter (or None). ``forward(x)`` runs the ``ds4::fp8_linear`` op (the weight
  is never dequantized whole). ``dequantized_weight(dtype)`` is available for code
  that needs the matrix. Other ``nn.Linear`` subclasses are never swapped: the
  loader dequantizes them.
* Routed experts: the model's experts module must hold ``gate_up_proj``
  ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` and must fetch weights in its
  forward ONLY through ``self.packed_weights()`` (the packed tensors and scales
  the ``ds4::moe`` op multiplies in place, or None) or else
  ``self.expert_weights(expert_ids)`` returning
  ``(gate_up [..., 2I, H], down [..., H, I])`` (dense version:
  ``self.gate_up_proj[expert_ids], self.down_proj[expert_ids]``).
  :meth:`QuantizedExperts.convert_` swaps such a module *in place* to a cached
  subclass ``(FP4Experts|FP8Experts, OriginalClass)``: the MRO puts the
  quantized ``expert_weights`` first while ``forward`` and every other attribute
  (``limit``, ``act_fn``, ``num_experts``...) stay those of the original
  class/instance. The dense Parameters are removed and replaced by persistent
  buffers named like transformers' FP8Experts: ``gate_up_proj``,
  ``gate_up_proj_scale_inv``, ``down_proj``, ``down_proj_scale_inv``.
  ``expert_weights(ids, dtype=None)`` dequantizes only the requested experts to
  ``dtype`` (default: the dtype the dense parameters had).
  ``FP4Experts(...)`` / ``FP8Experts(...)`` can also be built standalone as
  plain storage modules (no forward).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = [
    "E2M1_VALUES",
    "FP8_BLOCK",
    "FP4_BLOCK",
    "is_fp8_dtype",
    "is_fp4_packed_dtype",
    "is_e8m0_dtype",
    "infer_block_size",
    "scale_to_float",
    "unpack_fp4",
    "dequantize_fp8",
    "dequantize_fp4",
    "dequantize",
    "FP8BlockLinear",
    "QuantizedExperts",
    "FP4Experts",
    "FP8Experts",
]

FP8_BLOCK = (128, 128)
FP4_BLOCK = (1, 32)

# e2m1 code -> value; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_FP4_X2 = getattr(torch, "float4_e2m1fn_x2", None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in _FP8_DTYPES


def is_fp4_packed_dtype(dtype: torch.dtype) -> bool:
    """int8/uint8 bytes or float4_e2m1fn_x2 holding two e2m1 codes each."""
    return dtype in (torch.int8, torch.uint8) or (_FP4_X2 is not None and dtype == _FP4_X2)


def is_e8m0_dtype(dtype: torch.dtype) -> bool:
    return dtype == torch.uint8 or (_E8M0 is not None and dtype == _E8M0)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scale tensor -> float32. ``uint8`` is an e8m0 exponent: ``2 ** (b - 127)``."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


def infer_block_size(shape, scale_shape, default=FP8_BLOCK, strict: bool = False) -> tuple[int, int]:
    """Block (rows, cols) such that ``scale_shape[-2:] == ceil(shape[-2:] / block)``.

    Prefers ``default``; unless ``strict``, falls back to an exact division (what
    transformers does). Raises ValueError when nothing fits.
    """
    if len(scale_shape) < 2:
        raise ValueError(f"scale shape {tuple(scale_shape)} is not a 2-D block grid")
    out = []
    for n, s, d in zip(tuple(shape)[-2:], tuple(scale_shape)[-2:], default):
        if d and s == math.ceil(n / d):
            out.append(d)
        elif not strict and s and n % s == 0:
            out.append(n // s)
        else:
            raise ValueError(
                f"scale grid {tuple(scale_shape)} does not match weight shape {tuple(shape)} "
                f"(expected ceil(shape/{tuple(default)}))"
            )
    return out[0], out[1]


def _apply_block_scale(w: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """``w`` float32 ``[..., R, C]``, ``scale`` ``[..., SR, SC]`` -> ``w * expanded scale``."""
    s = scale_to_float(scale)
    if s.numel() == 1:
        return w * s.reshape(())
    rows, cols = w.shape[-2:]
    bm, bn = block
    s = s.repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    return w * s


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 codes per byte (low nibble first) -> float32, last dim doubled."""
    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    low = lut[(u8 & 0xF).to(torch.int32)]
    high = lut[(u8 >> 4).to(torch.int32)]
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_fp8(weight, scale, dtype=torch.float32, block_size=None) -> torch.Tensor:
    w = weight.to(torch.float32)
    if scale.numel() == 1:
        return _apply_block_scale(w, scale, None).to(dtype)
    block = block_size or infer_block_size(w.shape, scale.shape, FP8_BLOCK)
    return _apply_block_scale(w, scale, block).to(dtype)


def dequantize_fp4(packed, scale, dtype=torch.float32, block_size=None) -> torch.Tensor:
    w = unpack_fp4(packed)
    block = block_size or infer_block_size(w.shape, scale.shape, FP4_BLOCK)
    return _apply_block_scale(w, scale, block).to(dtype)


def dequantize(weight, scale, dtype=torch.float32, block_size=None) -> torch.Tensor:
    """Dispatch on the weight dtype: FP4-packed bytes, FP8, or plain float * block scale."""
    if is_fp4_packed_dtype(weight.dtype):
        return dequantize_fp4(weight, scale, dtype, block_size)
    return dequantize_fp8(weight, scale, dtype, block_size)


class FP8BlockLinear(nn.Module):
    """Linear layer with a float8_e4m3fn weight and a block scale, multiplied in place by the
    `ds4::fp8_linear` op (no dense weight is built). `groups` > 1: a grouped projection (the
    model's `GroupedLinear`, attention's `wo_a`): x [..., groups, in], each group through its own
    `out/groups` rows, which must start on a block border."""

    # Which ds4::fp8_linear implementation runs: "auto" (Triton on CUDA, torch elsewhere), "torch"
    # or "triton"; the same names as the attention backends.
    backend = "auto"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        block_size=FP8_BLOCK,
        scale_shape=None,
        device=None,
        dtype: torch.dtype = torch.bfloat16,
        groups: int = 1,
    ):
        super().__init__()
        self.groups = groups
        self.in_features = in_features
        self.out_features = out_features
        if scale_shape is None:
            scale_shape = (math.ceil(out_features / block_size[0]), math.ceil(in_features / block_size[1]))
        self.block_size = infer_block_size((out_features, in_features), scale_shape, block_size)
        self.compute_dtype = dtype
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        if groups > 1 and (out_features % groups or scale_shape[0] % groups
                           or (out_features // groups) % self.block_size[0]):
            raise ValueError(f"a grouped FP8 projection needs each of its {groups} groups of rows "
                             f"({out_features} rows) to start on a {self.block_size[0]}-row block border")
        self.register_buffer("weight_scale_inv", torch.empty(*scale_shape, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scale_shape=None, block_size=FP8_BLOCK, device=None) -> "FP8BlockLinear":
        # The weight's shape, not in/out_features: tensor parallelism narrows the weight in place.
        out_features, in_features = linear.weight.shape
        new = cls(
            in_features,
            out_features,
            bias=False,
            block_size=block_size,
            scale_shape=scale_shape,
            device=device if device is not None else linear.weight.device,
            dtype=linear.weight.dtype,
            groups=getattr(linear, "groups", 1),
        )
        new.bias = linear.bias  # keep the very same Parameter (or None)
        return new

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale_inv, dtype or self.compute_dtype, self.block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The registered ops (ds4_torch.kernels.quantized, imported with the model): the kernels
        # import this module's formats, so this module does not import them.
        if self.groups == 1:
            out = torch.ops.ds4.fp8_linear(x, self.weight, self.weight_scale_inv, *self.block_size, self.backend)
        else:  # x [..., groups, in]: group g through its own rows of the weight
            out = torch.ops.ds4.fp8_linear_grouped(x, self.weight, self.weight_scale_inv, *self.block_size,
                                                   self.backend)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, block_size={self.block_size}"
            + (f", groups={self.groups}" if self.groups > 1 else "")
        )


class QuantizedExperts(nn.Module):
    """Quantized storage for routed experts (see the module docstring).

    Buffers: ``gate_up_proj`` ``[E, 2I, *]``, ``gate_up_proj_scale_inv``,
    ``down_proj`` ``[E, H, *]``, ``down_proj_scale_inv``. When
    ``split_gate_up`` is True the gate_up scale grid is two grids stacked on
    dim 1 (gate rows then up rows), as produced from separate per-expert
    ``w1``/``w3`` tensors whose FP8 blocks do not straddle the gate/up border.
    """

    default_block = FP8_BLOCK

    def __init__(self, gate_up_proj, gate_up_proj_scale_inv, down_proj, down_proj_scale_inv,
                 dtype: torch.dtype = torch.bfloat16, split_gate_up: bool = False):
        super().__init__()
        self._set_storage(gate_up_proj, gate_up_proj_scale_inv, down_proj, down_proj_scale_inv, dtype, split_gate_up)

    def _set_storage(self, gate_up, gate_up_scale, down, down_scale, dtype, split_gate_up):
        self.register_buffer("gate_up_proj", gate_up)
        self.register_buffer("gate_up_proj_scale_inv", gate_up_scale)
        self.register_buffer("down_proj", down)
        self.register_buffer("down_proj_scale_inv", down_scale)
        self.compute_dtype = dtype
        self.split_gate_up = split_gate_up

    _class_cache: dict = {}

    @classmethod
    def convert_(cls, module: nn.Module, gate_up_proj, gate_up_proj_scale_inv, down_proj, down_proj_scale_inv,
                 split_gate_up: bool = False) -> nn.Module:
        """Turn a dense experts ``module`` into quantized storage *in place*; returns it."""
        if not callable(getattr(module, "expert_weights", None)):
            raise TypeError(
                f"{type(module).__name__} has no expert_weights(expert_ids) method; "
                "quantized experts need it (see ds4_torch.quant docstring)"
            )
        base = type(module)
        if isinstance(module, QuantizedExperts):
            base = next(b for b in base.__mro__[1:] if not issubclass(b, QuantizedExperts))
        dtype = getattr(module, "compute_dtype", None) or module.gate_up_proj.dtype
        for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
            module._parameters.pop(name, None)
            module._buffers.pop(name, None)
            module.__dict__.pop(name, None)
        key = (cls, base)
        new_cls = cls._class_cache.get(key)
        if new_cls is None:
            new_cls = type(f"{cls.__name__}{base.__name__}", (cls, base), {"__module__": cls.__module__})
            cls._class_cache[key] = new_cls
        module.__class__ = new_cls
        module._set_storage(gate_up_proj, gate_up_proj_scale_inv, down_proj, down_proj_scale_inv, dtype, split_gate_up)
        return module

    def _dequant(self, w, s, dtype):
        return dequantize(w, s, dtype, infer_block_size(self._logical_shape(w), s.shape, self.default_block))

    def _logical_shape(self, w):
        return w.shape

    def packed_weights(self):
        """(gate_up, down, gate_up_scale, down_scale) as the ``ds4::moe`` op takes them (the
        gate_up grid: the gate grid stacked on the up grid), or None when this storage's grid
        has a block straddling the gate/up border (then only ``expert_weights`` serves it)."""
        if not self.split_gate_up:  # one grid over the 2I rows: the two grids only if no block straddles
            block = infer_block_size(self._logical_shape(self.gate_up_proj), self.gate_up_proj_scale_inv.shape,
                                     self.default_block)
            if (self.gate_up_proj.shape[-2] // 2) % block[0]:
                return None
        return self.gate_up_proj, self.down_proj, self.gate_up_proj_scale_inv, self.down_proj_scale_inv

    def expert_weights(self, expert_ids: torch.Tensor, dtype: torch.dtype | None = None):
        dtype = dtype or self.compute_dtype
        gu, gus = self.gate_up_proj[expert_ids], self.gate_up_proj_scale_inv[expert_ids]
        if self.split_gate_up:
            h, hs = gu.shape[-2] // 2, gus.shape[-2] // 2
            gate_up = torch.cat(
                [self._dequant(gu[..., :h, :], gus[..., :hs, :], dtype),
                 self._dequant(gu[..., h:, :], gus[..., hs:, :], dtype)],
                dim=-2,
            )
        else:
            gate_up = self._dequant(gu, gus, dtype)
        down = self._dequant(self.down_proj[expert_ids], self.down_proj_scale_inv[expert_ids], dtype)
        return gate_up, down


class FP8Experts(QuantizedExperts):
    """float8_e4m3fn expert weights with 128x128 block scales."""

    default_block = FP8_BLOCK


class FP4Experts(QuantizedExperts):
    """e2m1 expert weights packed two per int8 byte, e8m0 scale per 32 inputs."""

    default_block = FP4_BLOCK

    def _logical_shape(self, w):
        return (*w.shape[:-1], 2 * w.shape[-1])
