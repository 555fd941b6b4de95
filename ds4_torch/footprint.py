"""What a checkpoint holds in memory once loaded, per device, without reading its weights:
`weight_bytes_per_rank(path, dtype, quantized, tp)` for `ds4-torch info --quantized ... --tp N`;
and what a KV cache takes, so a server can size its context to the memory it has
(`cache_bytes`, `free_memory`, `fitting_context`).

The model is built on the meta device, split as each rank would split it, and handed to the
loader's planning step (`load_checkpoint_into(plan_only=True)`), which swaps in the quantized
modules exactly as a real load does (FP8 linears, FP4/FP8 experts; slices that cut through a
scale block dequantized), so the bytes are those a load allocates, not an estimate.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["weight_bytes_per_rank", "has_weights", "cache_bytes", "free_memory", "fitting_context"]


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


def cache_bytes(config, context: int, sequences: int, dtype: torch.dtype) -> int:
    """Bytes of a `DS4Cache` for `sequences` sequences of `context` tokens (built on the meta
    device: nothing is allocated), the MTP layer's cache included."""
    from .cache import DS4Cache

    return DS4Cache(config, sequences, context, dtype=dtype, device="meta").nbytes


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
