"""How compressed KV rows are stored: full precision, or fp8 with power-of-two scales.

FP8 rows (`quantize_rows` / `dequantize_rows`). A compressed (CSA/HCA) or indexer row of D
channels is split into its first D - r channels and its last r RoPE channels. The first part is
stored as float8_e4m3fn in groups of 64 channels (`FP8_GROUP`), each with a power-of-two scale
held as one e8m0 byte (2 ** (byte - 127), the same encoding as the checkpoints' weight scales,
`quant.scale_to_float`); the RoPE part stays in the model dtype when `rope_dim` = r > 0 (r = 0:
every channel in fp8). A group's scale is the smallest power of two s with max|x| / s <= 448
(e4m3's largest value), so the largest value of each group keeps e4m3's full 3-bit mantissa,
and dividing by s is exact. Round-trip error per value: |x - x'| <= max(|x| / 16, s / 1024)
(half an e4m3 ulp, relative 2^-4 for normals; 2^-10 * s in e4m3's subnormal range).
Dequantized values (e4m3 * 2^k) are exact in bf16, fp16 (within range) and fp32, so a cache
storing fp8 and dequantizing where it reads computes exactly what one keeping the round trip's
values (`round_trip_rows`) in the model dtype would. Non-finite values become NaN (e4m3fn has no
infinity); the other values of their group keep the scale of the finite ones.

Storage (`row_parts`): a cache (`DS4Cache(..., kv_rows="fp8")`) holds a row as up to three
tensors of one row each: `rows` (the e4m3 channels, float8_e4m3fn), `row_scales` (uint8) and,
with RoPE channels kept, `row_rope` (the model dtype); a full row is `rows` alone. Exported
sequences and disk snapshots carry the same parts under the same names, so a state says its own
format.

Sizes (bytes per token of each format, sessions that fit) are in `footprint`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import DS4Config
from .quant import scale_to_float

__all__ = ["FP8_GROUP", "E4M3_MAX", "KVRowFormat", "KV_ROW_FORMATS", "row_format", "quantize_rows",
           "dequantize_rows", "round_trip_rows", "ROW_PARTS", "row_parts", "rows_from_parts"]

FP8_GROUP = 64  # channels per power-of-two scale
E4M3_MAX = 448.0
_E8M0_BIAS = 127


@dataclass(frozen=True)
class KVRowFormat:
    """How compressed and indexer rows are stored: `fp8` False: in the cache dtype; True: fp8
    with a scale byte per 64 channels, an attention row's RoPE channels in the model dtype when
    `keep_rope` (indexer rows, which only rank, are all fp8 either way: vLLM's layout too)."""

    name: str
    fp8: bool = False
    keep_rope: bool = False

    def rope_kept(self, config: DS4Config) -> int:
        """Trailing channels of a row left in the model dtype."""
        return config.qk_rope_head_dim if self.fp8 and self.keep_rope else 0

    def fp8_rope_kept(self, config: DS4Config, part: str) -> int | None:
        """How a compressor's (`part` "compressor") or indexer's ("indexer") rows are stored
        (`row_parts`' argument): None in the cache dtype, else fp8 with that many RoPE channels
        kept."""
        if not self.fp8:
            return None
        return self.rope_kept(config) if part == "compressor" else 0


KV_ROW_FORMATS = {
    "full": KVRowFormat("full"),                              # the cache dtype
    "fp8": KVRowFormat("fp8", fp8=True),                      # every channel fp8
    "fp8-keep-rope": KVRowFormat("fp8-keep-rope", fp8=True, keep_rope=True),  # RoPE channels: model dtype
}


def row_format(name: str | KVRowFormat) -> KVRowFormat:
    if isinstance(name, KVRowFormat):
        return name
    if name not in KV_ROW_FORMATS:
        raise ValueError(f"unknown KV row format {name!r}; expected one of {sorted(KV_ROW_FORMATS)}")
    return KV_ROW_FORMATS[name]


def _groups(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`x` [..., n] as fp32 [..., ceil(n / 64), 64], zero padded, and n."""
    n = x.shape[-1]
    pad = -n % FP8_GROUP
    x = x.float()
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(*x.shape[:-1], -1, FP8_GROUP), n


def quantize_rows(rows: torch.Tensor, rope_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rows` [..., D] -> (values float8_e4m3fn [..., D - rope_dim], scales uint8 e8m0
    [..., ceil((D - rope_dim) / 64)], rope [..., rope_dim] in rows' dtype)."""
    D = rows.shape[-1]
    if not 0 <= rope_dim <= D:
        raise ValueError(f"rope_dim {rope_dim} outside [0, {D}]")
    body, rope = rows[..., :D - rope_dim], rows[..., D - rope_dim:]
    g, n = _groups(body)
    finite = torch.isfinite(g)
    amax = torch.where(finite, g.abs(), 0).amax(dim=-1, keepdim=True)
    # the smallest k with amax <= 448 * 2^k: frexp's exponent, then one exact check each way
    _, k = torch.frexp(amax / E4M3_MAX)
    k = k.to(torch.int32)
    k = torch.where(amax > torch.ldexp(torch.full_like(amax, E4M3_MAX), k), k + 1, k)
    k = torch.where(amax <= torch.ldexp(torch.full_like(amax, E4M3_MAX), k - 1), k - 1, k)
    k = torch.where(amax > 0, k, 0).clamp(-_E8M0_BIAS, _E8M0_BIAS)
    scaled = torch.ldexp(g, -k).clamp(-E4M3_MAX, E4M3_MAX)  # the clamp only binds where k was clamped
    scaled = torch.where(finite, scaled, float("nan"))
    values = scaled.to(torch.float8_e4m3fn).flatten(-2)[..., :n]
    scales = (k + _E8M0_BIAS).to(torch.uint8).squeeze(-1)
    return values, scales, rope


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor | None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The rows `quantize_rows` took apart, [..., D] in `dtype` (default: rope's; rope None: no
    RoPE channels kept, `dtype` required)."""
    g, n = _groups(values)
    body = (g * scale_to_float(scales)[..., None]).flatten(-2)[..., :n]
    dtype = rope.dtype if dtype is None else dtype
    return body.to(dtype) if rope is None else torch.cat([body.to(dtype), rope.to(dtype)], dim=-1)


def round_trip_rows(rows: torch.Tensor, rope_dim: int = 0) -> torch.Tensor:
    """`rows` as an fp8 store gives them back (quantized, then dequantized to rows' dtype)."""
    return dequantize_rows(*quantize_rows(rows, rope_dim), dtype=rows.dtype)


# --------------------------------------------------------------------------- how a cache stores rows
ROW_PARTS = ("rows", "row_scales", "row_rope")  # every name a stored row's parts can have, in order


def row_parts(dim: int, dtype: torch.dtype, fp8_rope_kept: int | None) -> list[tuple[str, torch.dtype, int]]:
    """(name, dtype, channels) of each tensor a cache stores a row of `dim` channels in:
    `fp8_rope_kept` None: `rows` in `dtype`; n: `rows` (float8_e4m3fn, dim - n), `row_scales`
    (uint8, one per 64 of those) and, when n > 0, `row_rope` (`dtype`, the last n channels)."""
    if fp8_rope_kept is None:
        return [("rows", dtype, dim)]
    q = dim - fp8_rope_kept
    out = [("rows", torch.float8_e4m3fn, q), ("row_scales", torch.uint8, math.ceil(q / FP8_GROUP))]
    return out + ([("row_rope", dtype, fp8_rope_kept)] if fp8_rope_kept else [])


def rows_from_parts(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The rows [..., D] in `dtype` that stored `parts` (`row_parts` names -> tensors [..., width])
    hold: `rows` itself when full, else dequantized."""
    if "row_scales" not in parts:
        return parts["rows"]
    return dequantize_rows(parts["rows"], parts["row_scales"], parts.get("row_rope"), dtype)
