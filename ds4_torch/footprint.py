"""What a checkpoint holds in memory once loaded, per device, without reading its weights:
`weight_bytes_per_rank(path, dtype, quantized, tp)` for `ds4-torch info --quantized ... --tp N`;
and what a KV cache takes, so a server can size its context to the memory it has
(`cache_bytes`, `free_memory`, `fitting_context`).

KV bytes per token of each row format (`kv_bytes_per_token`, `ds4_torch.kv_format`): per token
of context, the compressed rows of every layer of rate m (1 / m rows per token, and as many
indexer rows on CSA layers): what a paged cache holds for each token it covers. The window ring
(W rows per layer and sequence), the open windows and the CSA overlap are per running sequence,
fixed whatever the context: `sequence_fixed_bytes` gives them, in the model dtype (they stay full
precision). `static_sequence_bytes` / `paged_sequence_bytes` size one sequence of each kind and
`session_table` says how many sessions fit a memory budget.

The model is built on the meta device, split as each rank would split it, and handed to the
loader's planning step (`load_checkpoint_into(plan_only=True)`), which swaps in the quantized
modules exactly as a real load does (FP8 linears, FP4/FP8 experts; slices that cut through a
scale block dequantized), so the bytes are those a load allocates, not an estimate.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .config import CSA, SLIDING, DS4Config
from .kv_format import KVRowFormat, row_format, row_parts

__all__ = ["weight_bytes_per_rank", "has_weights", "cache_bytes", "free_memory", "fitting_context", "row_bytes",
           "kv_bytes_per_token", "layer_bytes_per_token", "sequence_fixed_bytes", "static_sequence_bytes",
           "paged_sequence_bytes", "sessions_that_fit", "SESSION_LENGTHS", "session_table", "format_session_table"]


def _model_bytes(model) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def has_weights(path) -> bool:
    from .loading import INDEX_NAME, SINGLE_NAME

    return any((Path(path) / name).is_file() for name in (INDEX_NAME, SINGLE_NAME))


def weight_bytes_per_rank(path, dtype: torch.dtype, quantized: str = "dequantize", tp: int = 1) -> list[int]:
    """Bytes of the tensors (parameters and buffers) each of `tp` ranks holds after loading the
    checkpoint at `path` with `quantized` ("dequantize" or "keep"), unquantized tensors in `dtype`.
    A directory with a config but no weight files: the dense model's bytes in `dtype`."""
    from .config import DS4Config
    from .loading import load_checkpoint_into
    from .model import DS4ForCausalLM
    from .parallel import TensorParallel, check_divisible, parallelize

    config = DS4Config.from_pretrained(path)
    if tp > 1:
        check_divisible(config, tp)
    out = []
    for rank in range(tp):
        with torch.device("meta"):
            model = DS4ForCausalLM(config)
        model.to_dtype(dtype)
        if tp > 1:
            parallelize(model, TensorParallel(None, rank, tp))
        if has_weights(path):
            load_checkpoint_into(model, path, device="meta", quantized=quantized,
                                 shards=getattr(model, "tp_slices", None), plan_only=True)
        out.append(_model_bytes(model))
    return out


def cache_bytes(config, context: int, sequences: int, dtype: torch.dtype, kv_rows: str = "full") -> int:
    """Bytes of a `DS4Cache` for `sequences` sequences of `context` tokens, rows stored as
    `kv_rows` (built on the meta device: nothing is allocated), the MTP layer's cache included."""
    from .cache import DS4Cache

    return DS4Cache(config, sequences, context, dtype=dtype, device="meta", kv_rows=kv_rows).nbytes


def free_memory(device) -> int:
    """Bytes a new allocation on `device` may still take: free device memory on CUDA, the
    recommended working set less what is allocated on MPS, available RAM on a CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        return max(0, torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    try:  # other Unixes
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2  # macOS: half of it, a guess


def fitting_context(config, dtype: torch.dtype, sequences: int, budget: int, granule: int = 1024) -> int:
    """The longest context, up to the model's `max_position_embeddings`, for which a cache of
    `sequences` sequences takes at most `budget` bytes: the maximum when it fits, else the
    largest multiple of `granule` that does; 0 when not even `granule` tokens fit."""
    maximum = config.max_position_embeddings
    if cache_bytes(config, maximum, sequences, dtype) <= budget:
        return maximum
    lo, hi = 0, maximum // granule  # in granules; a cache grows with its context
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cache_bytes(config, mid * granule, sequences, dtype) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * granule


# --------------------------------------------------------------------------- KV bytes per token
def row_bytes(dim: int, fp8_rope_kept: int | None, dtype: torch.dtype) -> int:
    """Bytes of one stored row of `dim` channels (`kv_format.row_parts`: `fp8_rope_kept` None: in
    `dtype`; else one byte per fp8 channel and per 64 of them (the scale), plus the kept RoPE
    channels in `dtype`)."""
    return sum(width * d.itemsize for _, d, width in row_parts(dim, dtype, fp8_rope_kept))


def layer_bytes_per_token(config: DS4Config, fmt: str | KVRowFormat, dtype: torch.dtype) -> list[float]:
    """Compressed-row bytes per token of context of each layer (0 for sliding layers): the
    compressed row, plus the indexer row on CSA layers, over the rate."""
    fmt = row_format(fmt)
    out = []
    for i, kind in enumerate(config.layer_types):
        if kind == SLIDING:
            out.append(0.0)
            continue
        per_row = row_bytes(config.head_dim, fmt.fp8_rope_kept(config, "compressor"), dtype)
        if kind == CSA:
            per_row += row_bytes(config.index_head_dim, fmt.fp8_rope_kept(config, "indexer"), dtype)
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
        for i, kind in enumerate(cfg.layer_types):
            if kind == SLIDING:
                continue
            rows = math.ceil(max_context / cfg.compress_rate(i)) + 1
            total += rows * row_bytes(cfg.head_dim, fmt.fp8_rope_kept(cfg, "compressor"), dtype)
            if kind == CSA:
                total += rows * row_bytes(cfg.index_head_dim, fmt.fp8_rope_kept(cfg, "indexer"), dtype)
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
