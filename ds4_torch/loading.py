"""Streaming loader for DeepSeek-V4 safetensors checkpoints.

The target module's ``state_dict`` keys follow transformers'
``DeepseekV4ForCausalLM`` (``model.layers.N.self_attn.q_a_proj.weight``,
``model.layers.N.mlp.experts.gate_up_proj`` ...). Accepted checkpoint layouts:

* HF names (exact state-dict keys), single ``model.safetensors`` or sharded
  ``model.safetensors.index.json``; a missing/extra ``model.`` prefix is fixed up.
* Upstream DeepSeek names (``embed.weight``, ``layers.N.attn.wq_a.weight``,
  ``layers.N.ffn.experts.E.w1.weight`` ...), also with a ``model.`` prefix as
  written by transformers' ``save_pretrained`` (which reverse-maps to them).
  Renames follow transformers' ``conversion_mapping["deepseek_v4"]``; per-expert
  ``w1``/``w3``/``w2`` are copied into slices of ``gate_up_proj``/``down_proj``.
* FP8 block-quantized weights (``<p>.scale`` / ``<p>.weight_scale_inv``) and FP4
  packed experts, dequantized to the parameter dtype (``quantized="dequantize"``)
  or kept quantized (``quantized="keep"``, see :mod:`ds4_torch.quant`).

Tensors are read one at a time with ``safe_open`` (stacked 3-D tensors one
expert at a time) and copied into the already-allocated parameters (or, with
``allocate_meta``, into meta-device ones allocated after the checks); problems
(missing, unexpected, mis-shaped, unreadable) are collected and raised as a
single :class:`CheckpointError` before any data is copied.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import quant as Q

__all__ = [
    "CheckpointError",
    "read_config_dict",
    "checkpoint_tensor_names",
    "checkpoint_fingerprint",
    "rename_checkpoint_key",
    "load_checkpoint_into",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
MAX_LISTED = 20

# checkpoint_fingerprint: bytes hashed from each file's data region, at this many evenly spaced
# points (the first at its start, the last ending at its end).
FINGERPRINT_SAMPLE_BYTES = 4096
FINGERPRINT_SAMPLE_POINTS = 5
# safetensors refuses headers above 100 MB; a larger length prefix means a corrupt file.
MAX_SAFETENSORS_HEADER = 100_000_000

# Checkpoint keys silently skipped (multi-token-prediction layers) by a model built without them,
# as transformers does.
IGNORED_KEYS = re.compile(r"(^|\.)mtp\.")
# An MTP layer's upstream names (`mtp.K.attn.wq_a.weight`, ...) are a decoder layer's, plus its
# own norm and mHC head, which the layer renames would take for a compressor's and the model's.
MTP_KEY = re.compile(r"^mtp\.(\d+)\.(.*)$")
MTP_OWN = {"norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base",
           "hc_head_scale": "hc_head.hc_scale"}

# Upstream DeepSeek-V4 -> HF renames, applied in order, each at most once, to the key
# with any leading "model." removed (transformers' conversion_mapping["deepseek_v4"]).
# Order matters: ".attn." must become ".self_attn." before the indexer rules, and the
# generic ".norm." -> ".kv_norm." only hits attention/compressor/indexer norms
# (the top-level "norm.weight" has no leading dot; *_norm names don't match).
RENAMES: tuple[tuple[re.Pattern, str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"\.attn\.", ".self_attn."),
        (r"\.ffn\.", ".mlp."),
        (r"\.indexer\.compressor\.", ".compressor.indexer."),
        (r"^embed\.weight$", "embed_tokens.weight"),
        (r"^head\.weight$", "lm_head.weight"),
        (r"^hc_head_fn$", "hc_head.hc_fn"),
        (r"^hc_head_base$", "hc_head.hc_base"),
        (r"^hc_head_scale$", "hc_head.hc_scale"),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.hc_attn_fn$", ".attn_hc.fn"),
        (r"\.hc_attn_base$", ".attn_hc.base"),
        (r"\.hc_attn_scale$", ".attn_hc.scale"),
        (r"\.hc_ffn_fn$", ".ffn_hc.fn"),
        (r"\.hc_ffn_base$", ".ffn_hc.base"),
        (r"\.hc_ffn_scale$", ".ffn_hc.scale"),
        (r"\.attn_sink$", ".sinks"),
        (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
        (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
        (r"\.norm\.", ".kv_norm."),
        (r"\.ape$", ".position_bias"),
        (r"\.wq_a\.", ".q_a_proj."),
        (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
        (r"\.wkv\.", ".kv_proj."),
        (r"\.wgate\.", ".gate_proj."),
        (r"\.wo_a\.", ".o_a_proj."),
        (r"\.wo_b\.", ".o_b_proj."),
        (r"\.q_norm\.", ".q_a_norm."),
        (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
        (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
        (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
        (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    )
)

# Per-expert tensors (after renaming): <prefix>.experts.<E>.<w>.weight
EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<w>w[123]|gate_proj|up_proj|down_proj)\.weight$")
# expert weight -> (stacked tensor, part)
EXPERT_PARTS = {
    "w1": ("gate_up_proj", "gate"),
    "gate_proj": ("gate_up_proj", "gate"),
    "w3": ("gate_up_proj", "up"),
    "up_proj": ("gate_up_proj", "up"),
    "w2": ("down_proj", "down"),
    "down_proj": ("down_proj", "down"),
}
PART_LABEL = {"gate": "w1/gate", "up": "w3/up", "down": "w2/down"}

# safetensors dtype strings
_FP8_ST = {"F8_E4M3", "F8_E5M2"}
_FP4_ST = {"I8", "U8", "F4"}
_E8M0_ST = {"F8_E8M0", "U8"}


class CheckpointError(ValueError):
    """Problem with a checkpoint. ``missing``/``unexpected``/``mismatched``/``unreadable``
    hold the offending names (mismatched: ``(name, expected_shape, found_shape)``)."""

    def __init__(self, message: str, *, missing=(), unexpected=(), mismatched=(), unreadable=()):
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)
        self.unreadable = list(unreadable)


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _format_list(title: str, items: list[str]) -> str:
    lines = [f"{title} ({len(items)}):"]
    lines += [f"  {x}" for x in items[:MAX_LISTED]]
    if len(items) > MAX_LISTED:
        lines.append(f"  ... and {len(items) - MAX_LISTED} more")
    return "\n".join(lines)


def _raise_collected(path, missing=(), unexpected=(), mismatched=(), unreadable=()):
    if not (missing or unexpected or mismatched or unreadable):
        return
    missing = sorted(set(missing), key=_natural_key)
    unexpected = sorted(set(unexpected), key=_natural_key)
    parts = [f"Cannot load checkpoint {path}:"]
    if unreadable:
        parts.append(_format_list("Unreadable", list(unreadable)))
    if missing:
        parts.append(_format_list("Missing tensors", missing))
    if unexpected:
        parts.append(_format_list("Unexpected tensors", unexpected))
    if mismatched:
        parts.append(
            _format_list(
                "Shape mismatches (name: expected -> found)",
                [f"{n}: expected {tuple(e)}, found {tuple(f)}" for n, e, f in mismatched],
            )
        )
    raise CheckpointError(
        "\n".join(parts), missing=missing, unexpected=unexpected, mismatched=mismatched, unreadable=unreadable
    )


# --------------------------------------------------------------------------- files


def read_config_dict(path) -> dict:
    """``path/config.json`` as a dict (``path`` may also be the json file itself)."""
    p = Path(path)
    cfg = p if p.is_file() and p.suffix == ".json" else p / CONFIG_NAME
    if not cfg.is_file():
        raise CheckpointError(f"Missing config file: {cfg}", unreadable=[str(cfg)])
    try:
        with open(cfg, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"Invalid config file {cfg}: {e}", unreadable=[str(cfg)]) from e
    if not isinstance(data, dict):
        raise CheckpointError(f"Invalid config file {cfg}: expected a JSON object", unreadable=[str(cfg)])
    return data


def _safetensor_keys(file: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises several error types
        raise CheckpointError(f"Unreadable safetensors file {file}: {e}", unreadable=[str(file)]) from e


def checkpoint_tensor_names(path) -> dict[str, str]:
    """Map every tensor name of the checkpoint to the path of the shard holding it.

    ``path`` is a directory with ``model.safetensors.index.json`` (weight_map) or
    ``model.safetensors`` (or, failing both, ``*.safetensors`` files), or a
    ``.safetensors`` / ``.index.json`` file.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"Checkpoint path does not exist: {p}", unreadable=[str(p)])
    if p.is_file():
        if p.name.endswith(".json"):
            return _names_from_index(p)
        return {k: str(p) for k in _safetensor_keys(p)}
    if (p / INDEX_NAME).is_file():
        return _names_from_index(p / INDEX_NAME)
    if (p / SINGLE_NAME).is_file():
        return {k: str(p / SINGLE_NAME) for k in _safetensor_keys(p / SINGLE_NAME)}
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"No {INDEX_NAME}, {SINGLE_NAME} or *.safetensors file in {p}", unreadable=[str(p / SINGLE_NAME)]
        )
    out: dict[str, str] = {}
    for file in files:
        for k in _safetensor_keys(file):
            out.setdefault(k, str(file))
    return out


def _names_from_index(index: Path) -> dict[str, str]:
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"Invalid index file {index}: {e}", unreadable=[str(index)]) from e
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(
            f"Invalid index file {index}: expected a 'weight_map' object of tensor name -> shard file",
            unreadable=[str(index)],
        )
    files = {v: index.parent / v for v in set(wm.values())}
    absent = sorted(str(f) for f in files.values() if not f.is_file())
    if absent:
        _raise_collected(index.parent, unreadable=[f"missing shard file {f}" for f in absent])
    return {k: str(files[v]) for k, v in wm.items()}


def checkpoint_fingerprint(path) -> str:
    """A sha256 hex digest identifying a checkpoint's weights, from metadata and a fixed byte sample.

    Hashed: ``config.json`` (if present next to the weights), the tensor name -> file map, and for
    each safetensors file its name, size, raw header (every tensor's name, dtype, shape and
    offsets) and ``FINGERPRINT_SAMPLE_POINTS`` chunks of ``FINGERPRINT_SAMPLE_BYTES`` spread over
    its data region, so a re-trained checkpoint with identical shapes still differs. Reads are
    bounded by headers + samples (O(files + tensors), never O(weight bytes)); a change to a
    weight byte outside the samples is, by design, not seen.
    """
    p = Path(path)
    names = checkpoint_tensor_names(p)
    root = p if p.is_dir() else p.parent
    files = sorted(set(names.values()))
    h = hashlib.sha256(b"ds4_torch checkpoint fingerprint v1\0")

    def put(tag: str, data: bytes) -> None:  # length-prefixed: no two inputs hash the same stream
        h.update(tag.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    config = root / CONFIG_NAME
    put("config", config.read_bytes() if config.is_file() else b"<absent>")
    put("names", json.dumps(sorted((n, os.path.relpath(f, root)) for n, f in names.items())).encode())
    for file in files:
        put("file", os.path.relpath(file, root).encode())
        try:
            with open(file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                prefix = f.read(8)
                header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
                if not 0 <= header_len <= min(size - 8, MAX_SAFETENSORS_HEADER):
                    raise CheckpointError(
                        f"Unreadable safetensors file {file}: header length {header_len} does not fit "
                        f"its size of {size} bytes",
                        unreadable=[file],
                    )
                put("size", str(size).encode())
                put("header", f.read(header_len))
                start = 8 + header_len
                chunk = min(FINGERPRINT_SAMPLE_BYTES, size - start)
                for i in range(FINGERPRINT_SAMPLE_POINTS):
                    f.seek(start + i * (size - start - chunk) // (FINGERPRINT_SAMPLE_POINTS - 1))
                    put("sample", f.read(chunk))
        except OSError as e:
            raise CheckpointError(f"Unreadable safetensors file {file}: {e}", unreadable=[file]) from e
    return h.hexdigest()


# --------------------------------------------------------------------------- names


def rename_checkpoint_key(name: str) -> str:
    """Upstream DeepSeek name -> HF name (without resolving the ``model.`` prefix)."""
    key = name[len("model."):] if name.startswith("model.") else name
    m = MTP_KEY.match(key)
    if m and m[2] in MTP_OWN:
        return f"mtp.{m[1]}.{MTP_OWN[m[2]]}"
    for pattern, repl in RENAMES:
        key = pattern.sub(repl, key, count=1)
    return key


def _resolve(key: str, model_keys) -> str | None:
    if key in model_keys:
        return key
    if "model." + key in model_keys:
        return "model." + key
    if key.startswith("model.") and key[6:] in model_keys:
        return key[6:]
    return None


def _target_of(name: str, model_keys):
    """Checkpoint name -> (model key, piece) or None. piece = (expert, part) for per-expert tensors."""
    direct = _resolve(name, model_keys)
    if direct is not None:
        return direct, None
    hf = rename_checkpoint_key(name)
    m = EXPERT_KEY.match(hf)
    if m:
        stacked, part = EXPERT_PARTS[m["w"]]
        target = _resolve(f"{m['prefix']}.{stacked}", model_keys)
        return (target, (int(m["e"]), part)) if target is not None else None
    target = _resolve(hf, model_keys)
    return (target, None) if target is not None else None


# --------------------------------------------------------------------------- plan


@dataclass
class _Src:
    name: str
    file: str
    dtype: str  # safetensors dtype string
    shape: tuple  # as stored in the header (F4: logical element count)

    @property
    def packed_shape(self) -> tuple:
        if self.dtype == "F4":
            return (*self.shape[:-1], self.shape[-1] // 2)
        return self.shape


@dataclass
class _Task:
    target: str
    piece: tuple | None  # None: whole tensor; (expert, "gate"|"up"|"down")
    weight: _Src  # data source ("scale" tasks: the scale tensor itself)
    scale: _Src | None = None
    mode: str = "copy"  # copy | raw | scale
    block: tuple = Q.FP8_BLOCK
    extra: dict = field(default_factory=dict)

    @property
    def fmt(self) -> str | None:
        if self.scale is None:
            return None
        return "fp4" if self.weight.dtype in _FP4_ST else "fp8"

    def label(self) -> str:
        return self.weight.name

    @property
    def logical_shape(self) -> tuple:
        """Shape of the (dequantized) weight this task provides."""
        if self.fmt == "fp4":
            packed = self.weight.packed_shape
            return (*packed[:-1], 2 * packed[-1])
        return tuple(self.weight.shape)

    def scale_problem(self):
        """None if the scale grid fits the weight (and record the block size), else the expected scale shape."""
        logical, sshape = self.logical_shape, tuple(self.scale.shape)
        if len(sshape) < 2 and math.prod(sshape) == 1:  # per-tensor scale
            self.extra["block"] = None
            return None
        default = Q.FP4_BLOCK if self.fmt == "fp4" else self.block
        expected = (*logical[:-2], *(math.ceil(n / b) for n, b in zip(logical[-2:], default)))
        if sshape[:-2] != tuple(logical[:-2]):
            return expected
        try:
            self.extra["block"] = Q.infer_block_size(logical, sshape, default, strict=True)
        except ValueError:
            return expected
        return None


def _pair_scales(names) -> dict[str, str]:
    """weight name -> scale name."""
    pairs = {}
    for n in names:
        if n.endswith("_scale_inv") and n[: -len("_scale_inv")] in names:
            pairs[n[: -len("_scale_inv")]] = n
        elif n.endswith(".scale") and n[: -len(".scale")] + ".weight" in names:
            pairs[n[: -len(".scale")] + ".weight"] = n
    return pairs


def _read_headers(name_to_file: dict[str, str]) -> tuple[dict[str, _Src], list[str]]:
    from safetensors import safe_open

    by_file = defaultdict(list)
    for n, f in name_to_file.items():
        by_file[f].append(n)
    srcs, unreadable = {}, []
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt") as f:
                present = set(f.keys())
                for n in names:
                    if n not in present:
                        unreadable.append(f"{n} (listed in the index but not in {file})")
                        continue
                    sl = f.get_slice(n)
                    srcs[n] = _Src(n, file, sl.get_dtype(), tuple(sl.get_shape()))
        except CheckpointError:
            raise
        except Exception as e:
            unreadable.append(f"{file}: {e}")
    return srcs, unreadable


def _fp8_block_from_config(path) -> tuple[int, int]:
    p = Path(path)
    cfg_dir = p if p.is_dir() else p.parent
    if not (cfg_dir / CONFIG_NAME).is_file():
        return Q.FP8_BLOCK
    try:
        qc = read_config_dict(cfg_dir).get("quantization_config") or {}
        bs = qc.get("weight_block_size")
        if isinstance(bs, (list, tuple)) and len(bs) == 2:
            return int(bs[0]), int(bs[1])
    except (CheckpointError, AttributeError, TypeError, ValueError):
        pass
    return Q.FP8_BLOCK


def _submodule(model: nn.Module, key: str):
    mod_name, _, attr = key.rpartition(".")
    try:
        return (model.get_submodule(mod_name) if mod_name else model), mod_name, attr
    except AttributeError:
        return None, mod_name, attr


def _set_submodule(model: nn.Module, mod_name: str, new: nn.Module):
    parent_name, _, child = mod_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _apply_keep(model: nn.Module, tasks: list[_Task], device) -> list[_Task]:
    """Swap modules for quantized storage and rewrite the affected tasks (raw + scale)."""
    out: list[_Task] = []
    by_module = defaultdict(list)
    for t in tasks:
        by_module[t.target.rpartition(".")[0]].append(t)
    for mod_name, mtasks in by_module.items():
        module, _, _ = _submodule(model, mtasks[0].target)
        lin = [t for t in mtasks if t.target.endswith(".weight") and t.piece is None]
        # --- FP8 Linear
        # (anything that does not fit is left to the dequantize path, whose checks report it)
        if (
            isinstance(module, nn.Linear)
            and len(lin) == 1
            and lin[0].fmt == "fp8"
            and lin[0].weight.dtype == "F8_E4M3"
            and lin[0].scale_problem() is None
            and lin[0].extra["block"] is not None
            and _keepable_linear(module, lin[0].extra["block"])
            and _sharded(lin[0].logical_shape, lin[0].extra.get("shard")) == tuple(module.weight.shape)
        ):
            t = lin[0]
            shard = t.extra.get("shard")
            scale_shard = _scale_shard(shard, t.extra["block"], t.scale.shape) if shard else None
            if shard and scale_shard is None:  # this rank's slice cuts scale blocks: dequantize it
                out.extend(mtasks)
                continue
            new = Q.FP8BlockLinear.from_linear(
                module, scale_shape=_sharded(tuple(t.scale.shape), scale_shard), block_size=t.extra["block"],
                device=_alloc_device(module.weight, device)
            )
            # tensor parallelism hooks its collectives on the module (parallelize): they move with it
            new._forward_pre_hooks.update(module._forward_pre_hooks)
            new._forward_hooks.update(module._forward_hooks)
            _set_submodule(model, mod_name, new)
            out.extend(x for x in mtasks if x is not t)
            raw = _Task(t.target, None, t.weight, mode="raw")
            scale = _Task(f"{mod_name}.weight_scale_inv", None, t.scale, mode="scale")
            if shard:
                raw.extra["shard"], scale.extra["shard"] = shard, scale_shard
            out += [raw, scale]
            continue
        # --- routed experts
        ex = [t for t in mtasks if t.target.rpartition(".")[2] in ("gate_up_proj", "down_proj")]
        fmts = {t.fmt for t in ex}
        w_dtypes = {t.weight.dtype for t in ex}
        if (
            ex
            and len(fmts) == 1
            and None not in fmts
            and (w_dtypes <= {"F8_E4M3"} or w_dtypes <= _FP4_ST)
            and all(_fits_dense(t, getattr(module, t.target.rpartition(".")[2])) for t in ex)
        ):
            out.extend(x for x in mtasks if x not in ex)
            out.extend(_convert_experts(module, mod_name, ex, fmts.pop(), device))
            continue
        out.extend(mtasks)
    return out


def _keepable_linear(module: nn.Linear, block) -> bool:
    """A plain nn.Linear, or a grouped projection (an nn.Linear subclass with `groups`, attention's
    wo_a) whose groups start on scale-block borders (each group is multiplied on its own)."""
    if type(module) is nn.Linear:
        return True
    groups, rows = getattr(module, "groups", None), module.weight.shape[0]
    return isinstance(groups, int) and rows % groups == 0 and (rows // groups) % block[0] == 0


def _sharded(shape: tuple, shard) -> tuple:
    """`shape` of a whole tensor, narrowed to this rank's slice `shard` (dim, start, length, full)."""
    if shard is None:
        return tuple(shape)
    dim, _, n, _ = shard
    return (*shape[:dim], n, *shape[dim + 1:])


def _scale_shard(shard, block, scale_shape) -> tuple | None:
    """The slice of a block-scale grid that goes with weight slice `shard`, or None when the
    slice does not start and end on block borders (a block would be shared by two ranks)."""
    dim, start, n, full = shard
    b = block[dim - (len(scale_shape) - 2)]
    if start % b or (n % b and start + n != full):
        return None
    return dim, start // b, -(-n // b), scale_shape[dim]


def _alloc_device(tensor: torch.Tensor, device):
    """Where to allocate quantized storage replacing ``tensor`` (meta tensors: the load device)."""
    if tensor.device.type == "meta":
        return torch.device(device) if device is not None else torch.device("cpu")
    return tensor.device


def _allocate_meta(model: nn.Module, device: torch.device) -> None:
    """Replace every meta parameter/buffer by an uninitialised one on ``device``; tied stay tied."""
    replaced: dict[int, tuple] = {}  # id(old) -> (old, new); holding old keeps its id unique
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in replaced:
                    data = torch.empty_like(t, device=device)
                    new = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
                    replaced[id(t)] = (t, new)
                store[name] = replaced[id(t)][1]


def _fits_dense(t: _Task, dense: torch.Tensor) -> bool:
    if t.piece is not None and (dense.dim() != 3 or t.piece[0] >= dense.shape[0]):
        return False
    region_shape = tuple(dense[_region(dense, t.piece)].shape)
    return _sharded(t.logical_shape, t.extra.get("shard")) == region_shape and t.scale_problem() is None


def _convert_experts(module, mod_name, ex: list[_Task], fmt: str, device) -> list[_Task]:
    if not callable(getattr(module, "expert_weights", None)):
        raise CheckpointError(
            f"quantized='keep': {mod_name} ({type(module).__name__}) has no expert_weights(expert_ids) "
            "method, so its quantized experts cannot be kept packed"
        )
    cls = Q.FP4Experts if fmt == "fp4" else Q.FP8Experts
    per_expert = any(t.piece is not None for t in ex)
    device = _alloc_device(module.gate_up_proj, device)
    storage, tasks = {}, []
    for name in ("gate_up_proj", "down_proj"):
        dense = getattr(module, name)
        mine = [t for t in ex if t.target.endswith("." + name)]
        if not mine:  # reported as missing later; allocate something sensible
            mine_w = _Src(name, "", "F8_E4M3" if fmt == "fp8" else "I8", tuple(dense.shape[1:]))
            mine_s = _Src(name, "", "F32", (1, 1))
        else:
            mine_w, mine_s = mine[0].weight, mine[0].scale
        w_shape = tuple(mine_w.packed_shape[-2:])
        s_shape = tuple(mine_s.shape[-2:])
        n = dense.shape[0]
        if per_expert and name == "gate_up_proj":
            w_shape = (2 * w_shape[0], w_shape[1])
            s_shape = (2 * s_shape[0], s_shape[1])
        w_dtype = torch.float8_e4m3fn if fmt == "fp8" else torch.int8
        s_dtype = torch.uint8 if mine_s.dtype in _E8M0_ST else torch.float32
        storage[name] = torch.empty(n, *w_shape, dtype=w_dtype, device=device)
        storage[name + "_scale_inv"] = torch.empty(n, *s_shape, dtype=s_dtype, device=device)
        for t in mine:
            raw = _Task(t.target, t.piece, t.weight, mode="raw")
            scale = _Task(t.target + "_scale_inv", t.piece, t.scale, mode="scale")
            if "shard" in t.extra:  # a stacked tensor split along the expert axis: its scales alike
                raw.extra["shard"] = scale.extra["shard"] = t.extra["shard"]
            tasks += [raw, scale]
    cls.convert_(
        module,
        storage["gate_up_proj"],
        storage["gate_up_proj_scale_inv"],
        storage["down_proj"],
        storage["down_proj_scale_inv"],
        split_gate_up=per_expert,
    )
    return tasks


def _region(tensor: torch.Tensor, piece):
    if piece is None:
        return ()
    e, part = piece
    if part == "down":
        return (e,)
    half = tensor.shape[1] // 2
    return (e, slice(0, half)) if part == "gate" else (e, slice(half, 2 * half))


def _expected_pieces(key: str, n: int):
    leaf = key.rpartition(".")[2]
    parts = ("gate", "up") if leaf.startswith("gate_up_proj") else ("down",)
    return {(e, p) for e in range(n) for p in parts}


def _piece_name(key: str, piece) -> str:
    e, part = piece
    return f"{key}[expert {e} {PART_LABEL[part]}]"


def _shard_tasks(tasks: list[_Task], shards: dict) -> list[_Task]:
    """Keep only what this rank's slices need: per-expert pieces of its own experts (renumbered
    from 0), and whole tensors marked with the slice to read."""
    out = []
    for t in tasks:
        spec = shards.get(t.target)
        if spec is None:
            out.append(t)
            continue
        if t.piece is not None:  # one expert of a stacked tensor: split along the expert axis
            e, part = t.piece
            first, count = spec[1], spec[2]
            if first <= e < first + count:
                t.piece = (e - first, part)
                out.append(t)
            continue
        t.extra["shard"] = spec
        out.append(t)
    return out


def _check_task(t: _Task, tensor: torch.Tensor, mismatched: list):
    """Append shape problems to ``mismatched``; False if the expert index is out of range."""
    if t.piece is not None and (tensor.dim() < 2 or t.piece[0] >= tensor.shape[0]):
        return False
    region = _region(tensor, t.piece)
    expected = tuple(tensor[region].shape)
    if "shard" in t.extra:  # the checkpoint holds the whole tensor; this rank a slice of it
        dim, full = t.extra["shard"][0], t.extra["shard"][3]
        expected = expected[:dim] + (full,) + expected[dim + 1:]
    label = t.label()
    if t.mode == "copy" and t.scale is not None:
        if t.logical_shape != expected:
            mismatched.append((label, expected, t.logical_shape))
            return True
        bad_scale = t.scale_problem()
        if bad_scale is not None:
            mismatched.append((t.scale.name, bad_scale, tuple(t.scale.shape)))
        return True
    found = t.weight.packed_shape if t.mode == "raw" else t.weight.shape
    if tuple(found) != expected:
        mismatched.append((label, expected, tuple(found)))
    return True


# --------------------------------------------------------------------------- load


def _read(handle, src: _Src, index=None) -> torch.Tensor:
    if index is None or src.dtype == "F4":  # safetensors cannot slice packed F4
        x = handle.get_tensor(src.name)
        return x if index is None else x[index]
    return handle.get_slice(src.name)[index]


def _read_shard(t: _Task, dst: torch.Tensor, hw, hs, dim: int, start: int, n: int, full: int) -> torch.Tensor:
    """Rows/columns [start, start+n) of dimension `dim` of the checkpoint tensor, converted. Block
    scaled weights read the whole blocks covering the slice (and their scales) and trim."""
    def along(lo, hi):
        return (slice(None),) * dim + (slice(lo, hi),)

    if hs is None:
        if t.weight.dtype == "F4":  # safetensors cannot slice packed F4
            return _convert(t, dst, _read(hw, t.weight), None).narrow(dim, start, n)
        return _convert(t, dst, _read(hw, t.weight, along(start, start + n)), None)
    block = t.extra.get("block")
    packed_last = t.fmt == "fp4" and dim == len(t.logical_shape) - 1
    if block is None or packed_last or t.weight.dtype == "F4":  # per-tensor scale, or no clean slice
        if block is None and not packed_last and t.weight.dtype != "F4":
            return _convert(t, dst, _read(hw, t.weight, along(start, start + n)), _read(hs, t.scale))
        return _convert(t, dst, _read(hw, t.weight), _read(hs, t.scale)).narrow(dim, start, n)
    b = block[dim - (len(t.logical_shape) - 2)]
    lo, hi = start // b * b, min(full, -(-(start + n) // b) * b)
    w = _read(hw, t.weight, along(lo, hi))
    s = _read(hs, t.scale, along(lo // b, -(-hi // b)))
    return _convert(t, dst, w, s).narrow(dim, start - lo, n)


def _convert(t: _Task, dst: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    if t.mode == "raw":
        if dst.dtype == torch.int8 and w.dtype != torch.int8:
            w = w.view(torch.int8)
        return w
    if t.mode == "scale":
        if dst.dtype == torch.uint8:
            return w.view(torch.uint8) if w.dtype != torch.uint8 else w
        return Q.scale_to_float(w)
    if s is not None:
        return Q.dequantize(w, s, dst.dtype, t.extra.get("block"))
    return w


def load_checkpoint_into(
    model: nn.Module,
    path,
    *,
    device=None,
    quantized: str = "dequantize",
    progress: bool | None = None,
    allocate_meta: bool = False,
    shards: dict | None = None,
    plan_only: bool = False,
) -> None:
    """Stream a safetensors checkpoint into ``model``'s existing parameters/buffers.

    ``plan_only``: read the headers, check them and (``"keep"``) swap in the quantized modules,
    allocated on ``device`` (``"meta"``: nowhere), then stop before reading any data: how
    ``ds4_torch.footprint`` learns what a load would hold.

    ``device``: where tensors are read and dequantized (default CPU); results are
    copied onto each parameter's own device. ``quantized``: ``"dequantize"``
    (FP8/FP4 -> parameter dtype) or ``"keep"`` (swap in :class:`FP8BlockLinear`
    and FP4/FP8 experts storage, see :mod:`ds4_torch.quant`). ``progress``: tqdm
    bar; ``None`` -> only when stderr is a TTY. ``allocate_meta``: allocate the
    parameters/buffers still on the meta device on ``device`` (uninitialised)
    once the checkpoint has been checked, instead of refusing them; with a model
    built on the meta device, ``"keep"`` then never allocates the dense weights
    it replaces (non-persistent buffers are left for the caller to fill).
    ``shards``: {model key: (dim, start, length, full length)} for parameters that hold only a
    slice of the checkpoint's tensor (tensor parallelism, :mod:`ds4_torch.parallel`): only that
    slice is read (FP8 blocks covering it; per-expert tensors of other ranks are not opened).
    With ``"keep"`` each rank keeps its slices quantized: its experts (the expert axis splits
    cleanly), and every FP8 linear whose slice starts and ends on scale-block borders; a slice
    that cuts through a block (two ranks would share its scale) is dequantized instead.
    Raises :class:`CheckpointError` listing every missing / unexpected /
    mis-shaped / unreadable tensor.
    """
    if quantized not in ("dequantize", "keep"):
        raise ValueError(f"quantized must be 'dequantize' or 'keep', got {quantized!r}")
    from safetensors import safe_open

    name_to_file = checkpoint_tensor_names(path)
    srcs, unreadable = _read_headers(name_to_file)
    fp8_block = _fp8_block_from_config(path)

    # ---- plan: checkpoint tensor -> model key (+ expert slice)
    names = set(srcs)
    scale_of = _pair_scales(names)
    scale_names = set(scale_of.values())
    model_keys = set(model.state_dict(keep_vars=True).keys())
    has_mtp = any(k.startswith("mtp.") for k in model_keys)
    tasks: list[_Task] = []
    unexpected: list[str] = []
    for name in sorted(names, key=_natural_key):
        if name in scale_names or (not has_mtp and IGNORED_KEYS.search(name)):
            continue
        hit = _target_of(name, model_keys)
        if hit is None:
            unexpected.append(name)
            continue
        scale = srcs.get(scale_of.get(name, ""), None)
        tasks.append(_Task(hit[0], hit[1], srcs[name], scale, block=fp8_block))

    if shards:
        tasks = _shard_tasks(tasks, shards)
    if quantized == "keep":
        tasks = _apply_keep(model, tasks, device)

    # ---- validate: duplicates, shapes, coverage
    state = model.state_dict(keep_vars=True)
    mismatched: list = []
    seen: dict = {}
    valid: list[_Task] = []
    for t in tasks:
        tensor = state.get(t.target)
        if tensor is None:
            unexpected.append(t.label())
            continue
        slot = (t.target, t.piece)
        if slot in seen:
            unexpected.append(f"{t.label()} (duplicate of {seen[slot]} for {t.target})")
            continue
        seen[slot] = t.label()
        if not _check_task(t, tensor, mismatched):
            unexpected.append(f"{t.label()} (expert index out of range for {t.target})")
            continue
        valid.append(t)

    # aliases (tied weights) share one tensor: filled if any alias is filled
    groups = defaultdict(list)
    for k, v in state.items():
        groups[id(v)].append(k)
    covered_whole = {t.target for t in valid if t.piece is None}
    pieces = defaultdict(set)
    for t in valid:
        if t.piece is not None:
            pieces[t.target].add(t.piece)
    missing = []
    for keys in groups.values():
        if any(k in covered_whole for k in keys):
            continue
        k = keys[0]
        got = set().union(*(pieces.get(a, set()) for a in keys))
        if not got:
            missing.extend(keys)
        else:
            lacking = _expected_pieces(k, state[k].shape[0]) - got
            missing.extend(_piece_name(k, p) for p in sorted(lacking))
    _raise_collected(path, missing, unexpected, mismatched, unreadable)
    if plan_only:
        return
    if allocate_meta:
        _allocate_meta(model, torch.device(device) if device is not None else torch.device("cpu"))
        state = model.state_dict(keep_vars=True)
    on_meta = sorted({t.target for t in valid if state[t.target].device.type == "meta"}, key=_natural_key)
    if on_meta:
        raise ValueError(
            "load_checkpoint_into needs allocated tensors; on the meta device: "
            + ", ".join(on_meta[:MAX_LISTED])
            + (f" ... and {len(on_meta) - MAX_LISTED} more" if len(on_meta) > MAX_LISTED else "")
        )

    # ---- stream: one tensor (or one expert of a stacked tensor) at a time
    show = progress if progress is not None else sys.stderr.isatty()
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=len(valid), desc="Loading checkpoint", unit="tensor")
    read_device = str(device) if device is not None else "cpu"
    valid.sort(key=lambda t: (t.weight.file, t.weight.name))
    handles: dict[str, object] = {}  # at most 2 open shards (a weight's scale may sit in another one)

    def handle(file):  # least-recently-used shard is closed first
        if file in handles:
            handles[file] = handles.pop(file)
        else:
            if len(handles) >= 2:
                handles.pop(next(iter(handles))).__exit__(None, None, None)
            try:
                handles[file] = safe_open(file, framework="pt", device=read_device).__enter__()
            except Exception as e:
                raise CheckpointError(f"Unreadable safetensors file {file}: {e}", unreadable=[file]) from e
        return handles[file]

    try:
        _stream(valid, state, handle, bar)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
        if bar is not None:
            bar.close()


def _stream(valid: list[_Task], state: dict, handle, bar) -> None:
    with torch.no_grad():
        for t in valid:
            dst = state[t.target]
            dst = dst.data if isinstance(dst, nn.Parameter) else dst
            region = dst[_region(dst, t.piece)]
            try:
                hw = handle(t.weight.file)
                hs = handle(t.scale.file) if (t.scale is not None and t.mode == "copy") else None
                shard = t.extra.get("shard")
                if t.piece is None and region.dim() == 3 and t.weight.dtype != "F4" and len(t.weight.shape) == 3:
                    scale3 = hs is not None and len(t.scale.shape) == 3
                    first = shard[1] if shard else 0  # 3-D tensors are split along the expert axis only
                    for e in range(region.shape[0]):
                        w = _read(hw, t.weight, first + e)
                        s = None if hs is None else (_read(hs, t.scale, first + e) if scale3 else _read(hs, t.scale))
                        region[e].copy_(_convert(t, region, w, s))
                elif shard is not None:
                    region.copy_(_read_shard(t, region, hw, hs, *shard))
                else:
                    w = _read(hw, t.weight)
                    s = None if hs is None else _read(hs, t.scale)
                    region.copy_(_convert(t, region, w, s))
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(
                    f"Failed to load {t.label()} from {t.weight.file} into {t.target}: {e}",
                    unreadable=[t.label()],
                ) from e
            if bar is not None:
                bar.update(1)
