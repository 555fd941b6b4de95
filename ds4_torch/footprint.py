"""What a checkpoint holds in memory once loaded, per device, without reading its weights:
`weight_bytes_per_rank(path, dtype, quantized, tp)` for `ds4-torch info --quantized ... --tp N`.

The model is built on the meta device, split as each rank would split it, and handed to the
loader's planning step (`load_checkpoint_into(plan_only=True)`), which swaps in the quantized
modules exactly as a real load does (FP8 linears, FP4/FP8 experts; slices that cut through a
scale block dequantized), so the bytes are those a load allocates, not an estimate.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["weight_bytes_per_rank", "has_weights"]


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
