"""How compressed KV rows are stored, and what they cost per token of context.

FP8 rows (`quantize_rows` / `dequantize_rows`). A compressed (CSA/HCA) or indexer row of D
channels is split into its first D - r channels and its last r RoPE channels. The first part is
stored as float8_e4m3fn in groups of 64 channels (`FP8_GROUP`), each with a power-of-two scale
held as one e8m0 byte (2 ** (byte - 127), the same encoding as the checkpoints' weight scales,
`quant.scale_to_float`); the RoPE part stays in the model dtype when `rope_dim` = r > 0 (r = 0:
every channel in fp8). A group's scale is the smallest power of two s with max|x| / s <= 448
(e4m3's largest value), so the largest value of each group keeps e4m3's full 3-bit mantissa,
and dividing by s is exact. Round-trip error per value: |x - x'| <= max(|x| / 16, s / 1024)
(half an e4m3 ulp, relative 2^-4 for normals; 2^-10 * s in e4m3's subnormal range).
Dequantized values (e4m3 * 2^k) are exact in bf16, fp16 (within range) and fp32, so a cache that
keeps rows in the model dtype after a quantize -> dequantize round trip (`DS4Cache(...,
kv_rows="fp8")`) computes exactly what one storing fp8 and dequantizing where it loads would.
Non-finite values become NaN (e4m3fn has no infinity); the other values of their group keep
the scale of the finite ones.

Bytes per token (`kv_bytes_per_token`): per token of context, the compressed rows of every
layer of rate m (1 / m rows per token, and as many indexer rows on CSA layers), layer by layer:
what a paged cache holds for each token it covers. The window ring (W rows per layer and
sequence), the open windows and the CSA overlap are per running sequence, fixed whatever the
context: `sequence_fixed_bytes` gives them, in the model dtype (they stay full precision).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import CSA, HCA, SLIDING, DS4Config
from .quant import scale_to_float

__all__ = ["FP8_GROUP", "E4M3_MAX", "KVRowFormat", "KV_ROW_FORMATS", "row_format", "quantize_rows",
           "dequantize_rows", "round_trip_rows", "row_bytes", "kv_bytes_per_token", "layer_bytes_per_token",
           "sequence_fixed_bytes", "static_sequence_bytes", "paged_sequence_bytes", "sessions_that_fit",
           "SESSION_LENGTHS", "session_table", "format_session_table"]

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


KV_ROW_FORMATS = {
    "full": KVRowFormat("full"),                              # the cache dtype
    "fp8": KVRowFormat("fp8", fp8=True),                      # every channel fp8
    "fp8-rope": KVRowFormat("fp8-rope", fp8=True, keep_rope=True),  # RoPE channels in the model dtype
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


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The rows `quantize_rows` took apart, [..., D] in `dtype` (default: rope's)."""
    g, n = _groups(values)
    body = (g * scale_to_float(scales)[..., None]).flatten(-2)[..., :n]
    dtype = rope.dtype if dtype is None else dtype
    return torch.cat([body.to(dtype), rope.to(dtype)], dim=-1)


def round_trip_rows(rows: torch.Tensor, rope_dim: int = 0) -> torch.Tensor:
    """`rows` as an fp8 store gives them back (quantized, then dequantized to rows' dtype)."""
    return dequantize_rows(*quantize_rows(rows, rope_dim), dtype=rows.dtype)


# --------------------------------------------------------------------------- sizes
def row_bytes(dim: int, fmt: KVRowFormat, kept: int, dtype: torch.dtype) -> int:
    """Bytes of one stored row of `dim` channels: `dtype` for a full row; for fp8, one byte per
    quantized channel and per 64 of them (the scale), plus the `kept` (RoPE) channels in
    `dtype`."""
    if not fmt.fp8:
        return dim * dtype.itemsize
    q = dim - kept
    return q + math.ceil(q / FP8_GROUP) + kept * dtype.itemsize


def layer_bytes_per_token(config: DS4Config, fmt: str | KVRowFormat, dtype: torch.dtype) -> list[float]:
    """Compressed-row bytes per token of context of each layer (0 for sliding layers): the
    compressed row, plus the indexer row on CSA layers, over the rate."""
    fmt = row_format(fmt)
    r = fmt.rope_kept(config)  # attention rows only: indexer rows are all fp8 in either fp8 format
    out = []
    for i, kind in enumerate(config.layer_types):
        if kind == SLIDING:
            out.append(0.0)
            continue
        per_row = row_bytes(config.head_dim, fmt, r, dtype)
        if kind == CSA:
            per_row += row_bytes(config.index_head_dim, fmt, 0, dtype)
        out.append(per_row / config.compress_rate(i))
    return out


def kv_bytes_per_token(config: DS4Config, fmt: str | KVRowFormat, dtype: torch.dtype) -> float:
    """Compressed-row bytes per token of context, all layers (MTP layers included): what a
    paged cache holds per token it covers. The window ring is excluded (`sequence_fixed_bytes`)."""
    total = sum(layer_bytes_per_token(config, fmt, dtype))
    if config.num_nextn_predict_layers:
        total += sum(layer_bytes_per_token(config.mtp_config(), fmt, dtype))
    return total


def sequence_fixed_bytes(config: DS4Config, dtype: torch.dtype) -> int:
    """Bytes of one running sequence's state whatever its length, in the model dtype: the
    window ring, every compressor's and indexer's open window and CSA overlap, the position (a
    checkpoint's tensors, less its row counts), the MTP layers' included."""
    from .cache import checkpoint_nbytes

    configs = [config] + ([config.mtp_config()] if config.num_nextn_predict_layers else [])
    return sum(checkpoint_nbytes(c, dtype) - 8 * c.num_hidden_layers for c in configs)


def static_sequence_bytes(config: DS4Config, max_context: int, fmt: str | KVRowFormat, dtype: torch.dtype) -> int:
    """Bytes of one sequence of a static cache sized for `max_context` tokens (`DS4Cache`'s
    layout: ceil(max_context / m) rows plus a scratch row per compressor), rows in `fmt`: what
    a slot costs whatever its sequence's length."""
    fmt = row_format(fmt)
    total = sequence_fixed_bytes(config, dtype)
    for cfg in [config] + ([config.mtp_config()] if config.num_nextn_predict_layers else []):
        r = fmt.rope_kept(cfg)
        for i, kind in enumerate(cfg.layer_types):
            if kind == SLIDING:
                continue
            rows = math.ceil(max_context / cfg.compress_rate(i)) + 1
            total += rows * row_bytes(cfg.head_dim, fmt, r, dtype)
            if kind == CSA:
                total += rows * row_bytes(cfg.index_head_dim, fmt, 0, dtype)
    return total


def paged_sequence_bytes(config: DS4Config, tokens: int, fmt: str | KVRowFormat, dtype: torch.dtype,
                         block_tokens: int = 256, shared_tokens: int = 0) -> float:
    """Bytes one sequence of `tokens` tokens adds to a paged cache: its fixed part and the blocks
    its tokens reach, less the `shared_tokens` (whole blocks) another sequence already holds."""
    blocks = math.ceil(tokens / block_tokens) - shared_tokens // block_tokens
    return sequence_fixed_bytes(config, dtype) + blocks * block_tokens * kv_bytes_per_token(config, fmt, dtype)


def sessions_that_fit(budget: float, per_session: float, shared: float = 0.0) -> int:
    """How many sessions of `per_session` bytes fit `budget` once `shared` bytes are held."""
    return max(0, int((budget - shared) // per_session)) if budget > shared else 0


SESSION_LENGTHS = (40 * 1024, 128 * 1024, 1024 * 1024)


def session_table(config: DS4Config, dtype: torch.dtype, budget: float, lengths=SESSION_LENGTHS,
                  max_context: int | None = None, block_tokens: int = 256, shared_prefix: int = 20 * 1024,
                  formats=("full", "fp8")) -> list[dict]:
    """Sessions of each length in `lengths` that fit `budget` bytes of KV memory (per device: the
    compressed rows are replicated on every tensor-parallel rank), per row format:

    - `static_max`: static slots sized for `max_context` (default: the model's maximum);
    - `static`: static slots sized for the session's length;
    - `paged`: blocks of `block_tokens` for the live tokens;
    - `paged_shared`: the same, every session starting with the same `shared_prefix` tokens,
      whose blocks are stored once;
    - `session_bytes`: one paged session's bytes.

    Lengths past the model's maximum context are left out."""
    max_context = config.max_position_embeddings if max_context is None else max_context
    out = []
    for n in (n for n in lengths if n <= config.max_position_embeddings):
        row = {"tokens": n}
        for fmt in formats:
            prefix = shared_prefix // block_tokens * block_tokens
            shared = prefix * kv_bytes_per_token(config, fmt, dtype)
            paged = paged_sequence_bytes(config, n, fmt, dtype, block_tokens)
            row[fmt] = {
                "session_bytes": paged,
                "static_max": sessions_that_fit(budget, static_sequence_bytes(config, max_context, fmt, dtype)),
                "static": sessions_that_fit(budget, static_sequence_bytes(config, n, fmt, dtype)),
                "paged": sessions_that_fit(budget, paged),
                "paged_shared": sessions_that_fit(
                    budget, paged_sequence_bytes(config, n, fmt, dtype, block_tokens, prefix), shared),
            }
        out.append(row)
    return out


def format_session_table(rows: list[dict], formats=("full", "fp8"), names=None) -> str:
    """`session_table`'s rows as a Markdown table."""
    names = names or {"full": "bf16", "fp8": "fp8"}
    cols = [("session_bytes", "GiB/session (paged)"), ("static_max", "static, --ctx max"),
            ("static", "static, --ctx = length"), ("paged", "paged"), ("paged_shared", "paged, shared prefix")]
    head = "| session tokens | " + " | ".join(f"{title} {names[f]}" for _, title in cols for f in formats) + " |"
    lines = [head, "|" + "---|" * (1 + len(cols) * len(formats))]
    for row in rows:
        cells = []
        for key, _ in cols:
            for f in formats:
                v = row[f][key]
                cells.append(f"{v / 2**30:.2f}" if key == "session_bytes" else f"{v:,}")
        lines.append(f"| {row['tokens']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
