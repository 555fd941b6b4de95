"""The embedded default model: a tiny DS4 trained on Tiny Shakespeare, shipped in the package.

`ds4-torch generate`, `ds4-torch serve` and the notebooks use it when no `--model` is given, so
a fresh machine with no network gets a real, trained model. It has every DS4 layer kind
(sliding, CSA with its lightning indexer, HCA), MoE with a hash-routed layer and mHC, and a
window (32) and rates (4, 16) small enough that a few hundred tokens cross every cache
boundary. `examples/train_tiny.py` rebuilds it; `training.json` beside the weights records how.
"""

from __future__ import annotations

from pathlib import Path

import torch

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "tiny-shakespeare"


def default_config():
    from .config import DS4Config

    return DS4Config.from_pretrained(DEFAULT_MODEL_DIR)


def build_default_model(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        attn_backend: str = "auto", tp=None, quantized: str = "dequantize"):
    """The embedded model, in eval mode (`tp`: see `DS4ForCausalLM.from_pretrained`)."""
    from .model import DS4ForCausalLM

    return DS4ForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=dtype, device=device, attn_backend=attn_backend,
                                          progress=False, tp=tp, quantized=quantized)


def default_tokenizer():
    from .tokenizer import load_tokenizer

    return load_tokenizer(DEFAULT_MODEL_DIR)
