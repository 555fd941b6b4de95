"""ds4_torch: a PyTorch implementation of DeepSeek-V4 (DS4) models.

Public names are imported lazily (module-level ``__getattr__``) so that light modules
such as ``ds4_torch.tokenizer`` import without pulling in the model code.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# CPU decode runs torch's ops on torch's OpenMP threads and the native products on helper threads
# of their own (kernels/cpu_linear.c). OpenMP's default wait spins for a while after each torch op,
# holding the core a helper needs (2 threads then decoded a 2-layer checkpoint 1.4x faster than one;
# with a passive wait, 1.7-1.9x). OpenMP reads the policy once, when torch loads it: so it is set
# here, before torch is imported, unless the environment already names one.
OMP_WAIT_POLICY_DEFAULTED = "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ
if OMP_WAIT_POLICY_DEFAULTED:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

# public name -> submodule that defines it
_LAZY = {
    "DS4Config": "config",
    "DS4ForCausalLM": "model",
    "DS4Cache": "cache",
    "PagedDS4Cache": "paged",
    "BlockPool": "paged",
    "BlockTable": "paged",
    "load_tokenizer": "tokenizer",
    "generate": "generation",
    "SamplingParams": "sampling",
    "make_decoder": "decode",
    "prefill": "decode",
    "capabilities": "hardware",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # for type checkers and IDEs only
    from .cache import DS4Cache
    from .paged import BlockPool, BlockTable, PagedDS4Cache
    from .hardware import capabilities
    from .config import DS4Config
    from .decode import make_decoder, prefill
    from .generation import generate
    from .sampling import SamplingParams
    from .model import DS4ForCausalLM
    from .tokenizer import load_tokenizer


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # cache: __getattr__ is only consulted on a miss
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
