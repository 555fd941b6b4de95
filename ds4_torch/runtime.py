"""Choosing and loading a model for a run: the one loader the CLI, the server and the benchmarks
share, the device and dtype names they accept, and their argument validators.

Everything here raises `UserError` for what the user can fix (a missing directory, a bad config, a
device this machine lacks); the command lines print it as one line and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch


class UserError(Exception):
    """An error the user can fix; printed as one line, without a traceback."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICE_HELP = "torch device: auto (cuda, else mps, else cpu), cpu, cuda, cuda:1, mps, ..."


# --------------------------------------------------------------------------- argument validators
def _int_at_least(s: str, lo: int) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
    return v


def positive_int(s: str) -> int:
    return _int_at_least(s, 1)


def non_negative_int(s: str) -> int:
    return _int_at_least(s, 0)


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not v > 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def add_model_arguments(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    """--model, --device and --dtype, the same for every command that loads a model."""
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (config.json, *.safetensors, "
                                                  "tokenizer.json); default: the built-in default model")
    p.add_argument("--device", default="auto", help=DEVICE_HELP + " (default auto)")
    if dtype:
        p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                       help="dtype of weights and cache (default float32)")
    p.add_argument("--quantized", choices=("dequantize", "keep"), default="dequantize",
                   help="FP8/FP4 weights of a quantized checkpoint (DeepSeek's release): dequantize them to "
                        "--dtype at load, or keep them quantized (about half the memory; multiplied packed, "
                        "unpacked tile by tile). No effect on an unquantized checkpoint (default dequantize)")
    p.add_argument("--allow-vocab-mismatch", action="store_true",
                   help="load a tokenizer whose vocabulary is smaller than the model's (with a warning): token "
                        "ids past the tokenizer's decode to no text")


def add_tp_argument(p: argparse.ArgumentParser) -> None:
    """--tp N: one model split over N processes (run under torchrun, see ds4_torch.parallel)."""
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="tensor + expert parallel over N processes started by torchrun "
                        "(`torchrun --nproc-per-node N -m ds4_torch ... --tp N`; multi-node: torchrun's "
                        "--nnodes/--rdzv-endpoint); NCCL on CUDA, gloo on CPU (default 1)")


def check_tp_launcher(tp: int) -> None:
    """UserError when `--tp tp` (> 1) has no launcher to join (`parallel.check_launcher`): said
    before the tokenizer or the model loads."""
    if tp > 1:
        from .parallel import check_launcher

        try:
            check_launcher(tp)
        except ValueError as e:
            raise UserError(str(e)) from None


# --------------------------------------------------------------------------- device and dtype
def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """'auto' (or None): CUDA if available, else MPS, else CPU; otherwise the named device, which
    must exist on this machine."""
    from .hardware import default_device

    if name is None or name == "auto":
        return default_device()
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise UserError(f"bad device {name!r}: {e}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {name!r}: CUDA is not available on this machine (or in this torch build)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device {name!r}: MPS is not available on this machine")
    return device


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


# --------------------------------------------------------------------------- loading
def model_dir(path: str | os.PathLike) -> Path:
    d = Path(path)
    if not d.is_dir():
        raise UserError(f"model directory not found: {path}")
    if not (d / "config.json").is_file():
        raise UserError(f"no config.json in model directory {path}")
    return d


def load_config(model: str | None):
    """The DS4Config of a checkpoint directory, or of the built-in default model (None)."""
    if model is None:
        from .default_model import default_config

        return default_config()
    from .config import DS4Config

    d = model_dir(model)
    try:
        return DS4Config.from_pretrained(d)
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"bad config in {d}: {e}") from e


def load_model(model: str | None = None, device: str | torch.device | None = "auto",
               dtype: str | torch.dtype = "float32", attn_backend: str = "auto", tp: int = 1,
               quantized: str = "dequantize"):
    """The model of a checkpoint directory, or the built-in default model (None), on `device` in
    `dtype`, ready for inference (eval mode). `tp` > 1: this process's share of the model split
    over the launcher's N processes (`DS4ForCausalLM.from_pretrained(tp=...)`)."""
    from safetensors import SafetensorError

    from .model import DS4ForCausalLM

    device, dtype = resolve_device(device), resolve_dtype(dtype)
    if tp > 1:
        from .parallel import rank_device

        device = rank_device(device)
    if model is None:
        from .default_model import build_default_model

        try:
            return build_default_model(dtype=dtype, device=device, attn_backend=attn_backend, tp=tp,
                                       quantized=quantized)
        except ValueError as e:  # no launcher, or sizes that do not split
            raise UserError(str(e)) from e
    load_config(model)  # a bad config.json gets its own message before any weight is read
    d = model_dir(model)
    try:
        return DS4ForCausalLM.from_pretrained(d, dtype=dtype, device=device, attn_backend=attn_backend, tp=tp,
                                              quantized=quantized).eval()
    # Bad config, missing/corrupt/mismatched weights: the user's to fix. Anything else
    # (ImportError, TypeError, ...) is our bug and keeps its traceback.
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        raise UserError(f"cannot load model from {d}: {e}") from e


def load_model_tokenizer(model: str | None = None):
    """The tokenizer of a checkpoint directory, or of the built-in default model (None)."""
    if model is None:
        from .default_model import default_tokenizer

        return default_tokenizer()
    from .tokenizer import load_tokenizer

    try:
        return load_tokenizer(model_dir(model))
    except (OSError, ValueError) as e:
        raise UserError(str(e)) from e


def check_tokenizer_vocabulary(tokenizer, model_vocab_size: int, allow_mismatch: bool = False) -> None:
    """Refuse a tokenizer that does not cover the model's vocabulary: ids it lacks decode to no
    text, so a sampled one would vanish from the output without a word. `allow_mismatch` (the
    --allow-vocab-mismatch flag) turns a smaller tokenizer into a warning; a larger one can
    encode ids the model cannot embed and is always refused."""
    size = tokenizer.vocab_size
    if size == model_vocab_size:
        return
    if size < model_vocab_size and allow_mismatch:
        print(f"warning: the tokenizer has {size} tokens, the model {model_vocab_size}: sampled ids {size} and "
              "above decode to no text", file=sys.stderr)
        return
    hint = (" (pass --allow-vocab-mismatch to use it anyway: sampled ids past the tokenizer's decode to no text)"
            if size < model_vocab_size else " (it can encode ids the model cannot embed)")
    raise UserError(f"the tokenizer's vocabulary ({size} tokens) does not match the model's vocab_size "
                    f"({model_vocab_size}){hint}")

