"""Helpers for the checkpoint-loading tests: tiny transformers DeepSeek-V4 models and
checkpoints written in every supported layout (HF names, sharded, upstream names,
FP8 block-quantized linears, FP4 packed experts).

Everything here is written independently of ds4_torch.loading / ds4_torch.quant (its own
HF -> upstream mapping and its own quantizers and reference dequantizers), so the tests
compare two implementations.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    partial_rotary_factor=0.25,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=4,
    sliding_window=8,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    hc_mult=2,
    bos_token_id=0,
    eos_token_id=1,
)


def hf_config(**overrides):
    from transformers import DeepseekV4Config

    raw = copy.deepcopy(TINY)
    raw.update(copy.deepcopy(overrides))
    return DeepseekV4Config(**copy.deepcopy(raw))  # the config mutates nested dicts


def new_model(config):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(1234)
    return DeepseekV4ForCausalLM(config).eval()


@torch.no_grad()
def randomise(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    n_exp = model.config.n_routed_experts
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.randint(0, n_exp, b.shape, generator=g))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g))
    return model


@torch.no_grad()
def zeroed(model):
    for t in list(model.parameters()) + [b for n, b in model.named_buffers() if "inv_freq" not in n]:
        t.zero_()
    return model


# ---------------------------------------------------------------- HF -> upstream names

_TOP = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "norm.weight": "norm.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
# (HF module path inside a layer, upstream module path, leaf renames)
_COMPRESSOR_LEAVES = {"kv_proj": "wkv", "gate_proj": "wgate", "kv_norm": "norm", "position_bias": "ape"}
_GROUPS = [
    ("self_attn.compressor.indexer.scorer.", "attn.indexer.", {}),
    ("self_attn.compressor.indexer.", "attn.indexer.compressor.", {**_COMPRESSOR_LEAVES, "q_b_proj": "<wq_b>"}),
    ("self_attn.compressor.", "attn.compressor.", _COMPRESSOR_LEAVES),
    (
        "self_attn.",
        "attn.",
        {"q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b", "kv_proj": "wkv", "kv_norm": "kv_norm",
         "o_a_proj": "wo_a", "o_b_proj": "wo_b", "sinks": "attn_sink"},
    ),
    ("mlp.shared_experts.", "ffn.shared_experts.", {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}),
    ("mlp.gate.", "ffn.gate.", {"e_score_correction_bias": "bias"}),
    ("input_layernorm.", "attn_norm.", {}),
    ("post_attention_layernorm.", "ffn_norm.", {}),
    ("attn_hc.", "hc_attn_", {}),
    ("ffn_hc.", "hc_ffn_", {}),
]


# An MTP layer's own tensors (upstream `MTPBlock`): the rest of it is named as a layer is.
_MTP_OWN = {"hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}


def to_upstream(hf_key: str) -> str:
    """HF name -> DeepSeek upstream name (stacked experts are handled by upstream_state).
    MTP layers: `mtp.K.<layer name>` -> `mtp.K.<upstream layer name>`."""
    k = hf_key[len("model."):] if hf_key.startswith("model.") else hf_key
    if k in _TOP:
        return _TOP[k]
    mtp = re.fullmatch(r"mtp\.(\d+)\.(.+)", k)
    if mtp:
        depth, rest = mtp.groups()
        if rest in _MTP_OWN:
            return f"mtp.{depth}.{_MTP_OWN[rest]}"
        if rest.split(".")[0] in ("enorm", "hnorm", "e_proj", "h_proj", "norm"):
            return k
        return "mtp." + to_upstream(f"layers.{depth}.{rest}")[len("layers."):]
    layer, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", k).groups()
    for hf_prefix, up_prefix, leaves in _GROUPS:
        if rest.startswith(hf_prefix):
            tail = rest[len(hf_prefix):]
            head, _, suffix = tail.partition(".")
            head = leaves.get(head, head)
            if head == "<wq_b>":  # indexer query projection lives on the indexer itself upstream
                return f"layers.{layer}.attn.indexer.wq_b." + suffix
            return f"layers.{layer}.{up_prefix}{head}" + ("." + suffix if suffix else "")
    raise KeyError(hf_key)


def upstream_state(state: dict) -> dict:
    """HF state dict -> upstream names, routed experts split into per-expert w1/w3/w2."""
    out = {}
    for k, v in state.items():
        m = re.fullmatch(r"(model\.layers|mtp)\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", k)
        if m:
            group, layer, which = m.groups()
            for e in range(v.shape[0]):
                base = f"{'mtp' if group == 'mtp' else 'layers'}.{layer}.ffn.experts.{e}"
                if which == "gate_up_proj":
                    half = v.shape[1] // 2
                    out[f"{base}.w1.weight"] = v[e, :half].clone()
                    out[f"{base}.w3.weight"] = v[e, half:].clone()
                else:
                    out[f"{base}.w2.weight"] = v[e].clone()
        else:
            out[to_upstream(k)] = v.clone()
    return out


# ---------------------------------------------------------------- writing checkpoints


def write_config(model, directory):
    Path(directory).mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(str(Path(directory) / "config.json"))


def save_single(state: dict, directory, config_model=None):
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    if config_model is not None:
        write_config(config_model, directory)
    return directory


def save_sharded(state: dict, directory, n_shards=2, config_model=None):
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    keys = sorted(state)
    weight_map = {}
    for i in range(n_shards):
        part = keys[i::n_shards]
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({k: state[k].contiguous() for k in part}, str(directory / fname))
        weight_map.update({k: fname for k in part})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    if config_model is not None:
        write_config(config_model, directory)
    return directory


# ---------------------------------------------------------------- quantizers + references

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x.clamp_min(2.0**-100))))


def fp8_quantize(w: torch.Tensor, scale_fmt="float32", block=128):
    """Per 128x128 block: scale = amax/448 (or its power-of-two ceiling for e8m0)."""
    rows, cols = w.shape
    sr, sc = math.ceil(rows / block), math.ceil(cols / block)
    scale = torch.empty(sr, sc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s = blk.abs().max().clamp_min(1e-12) / 448.0
            if scale_fmt != "float32":
                s = _pow2_ceil(s)
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).to(torch.float8_e4m3fn)
    return q, encode_scale(scale, scale_fmt)


def encode_scale(scale: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "float32":
        return scale
    if fmt == "e8m0":
        return scale.to(torch.float8_e8m0fnu)
    if fmt == "uint8":
        return (torch.log2(scale).round() + 127).to(torch.uint8)
    raise ValueError(fmt)


def decode_scale(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:
        return torch.tensor([[2.0 ** (int(b) - 127) for b in row] for row in scale.tolist()])
    return scale.float()


def fp8_reference(q: torch.Tensor, scale: torch.Tensor, block=128) -> torch.Tensor:
    s = decode_scale(scale)
    out = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rs, cs = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rs, cs] = q[rs, cs].float() * s[i, j]
    return out


def fp4_quantize(w: torch.Tensor, scale_fmt="e8m0"):
    """[out, in] -> (packed int8 [out, in/2] low nibble first, e8m0 scale [out, in/32], exact dequant)."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // 32, 32)
    scale = _pow2_ceil(groups.abs().amax(-1) / 6.0)  # [rows, cols/32]
    x = groups / scale[..., None]
    grid = torch.tensor(E2M1)
    mag = (x.abs()[..., None] - grid).abs().argmin(-1)  # nearest magnitude code 0..7
    code = mag + 8 * (x < 0).long()
    values = grid[mag] * torch.where(x < 0, -1.0, 1.0)
    dequant = (values * scale[..., None]).reshape(rows, cols)
    code = code.reshape(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, encode_scale(scale, scale_fmt), dequant


# ---------------------------------------------------------------- quantized checkpoints

# Linear weights quantized to FP8 in the FP8 tests (HF names relative to a layer).
FP8_LINEARS = re.compile(
    r"(self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)|self_attn\.compressor\.indexer\.q_b_proj"
    r"|shared_experts\.(gate_proj|up_proj|down_proj))\.weight$|^lm_head\.weight$"
)


def state_of(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fp8_checkpoint(model, scale_fmt: str, upstream: bool):
    """(checkpoint dict, expected state): FP8_LINEARS quantized, scales as `.scale` (upstream)
    or `.weight_scale_inv` (HF)."""
    expected = state_of(model)
    ckpt = dict(expected)
    for k in list(expected):
        short = re.sub(r"^model\.layers\.\d+\.", "", k)
        if FP8_LINEARS.search(short):
            q, s = fp8_quantize(expected[k], scale_fmt)
            expected[k] = fp8_reference(q, s)
            ckpt[k] = q
            ckpt[k[: -len(".weight")] + ".weight_scale_inv"] = s
    if upstream:
        up = {}
        for k, v in ckpt.items():
            if k.endswith(".weight_scale_inv"):
                up[to_upstream(k[: -len("_scale_inv")])[: -len(".weight")] + ".scale"] = v
            elif not k.endswith(("gate_up_proj", "down_proj")):
                up[to_upstream(k)] = v
        up.update({k: v for k, v in upstream_state(expected).items() if ".experts." in k})
        ckpt = up
    return ckpt, expected


def fp4_experts(model, scale_fmt="e8m0"):
    """Per layer: packed/scale tensors per expert + the exact dequantized stacked weights."""
    expected = state_of(model)
    quantized = {}
    for k in list(expected):
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", k)
        if not m:
            continue
        packs, scales, deq = [], [], []
        for e in range(expected[k].shape[0]):
            p, s, d = fp4_quantize(expected[k][e], scale_fmt)
            packs.append(p), scales.append(s), deq.append(d)
        quantized[k] = (torch.stack(packs), torch.stack(scales))
        expected[k] = torch.stack(deq)
    return quantized, expected


def fp4_upstream_checkpoint(model, scale_fmt="e8m0", f4_dtype=False):
    """(upstream-named checkpoint with FP4 per-expert w1/w3/w2 + scales, expected dequantized
    state, {stacked HF key: (packed, scale)})."""
    quantized, expected = fp4_experts(model, scale_fmt)
    ckpt = {k: v for k, v in upstream_state(state_of(model)).items() if ".experts." not in k}
    for k, (packed, scale) in quantized.items():
        layer = k.split(".")[2]
        if f4_dtype:
            packed = packed.view(torch.float4_e2m1fn_x2)
        for e in range(packed.shape[0]):
            base = f"layers.{layer}.ffn.experts.{e}"
            if k.endswith("gate_up_proj"):
                half = packed.shape[1] // 2
                for w, rows in (("w1", slice(0, half)), ("w3", slice(half, None))):
                    ckpt[f"{base}.{w}.weight"] = packed[e, rows].clone()
                    ckpt[f"{base}.{w}.scale"] = scale[e, rows].clone()
            else:
                ckpt[f"{base}.w2.weight"] = packed[e].clone()
                ckpt[f"{base}.w2.scale"] = scale[e].clone()
    return ckpt, expected, quantized
