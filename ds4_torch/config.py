"""DS4Config: the DeepSeek-V4 architecture description.

Built from a `config.json` in either of the two spellings found in the wild:
- transformers' keys: `layer_types`, `mlp_layer_types`, `compress_rates`, `rope_parameters`,
  `partial_rotary_factor`;
- the upstream hub keys: `compress_ratios` (one int per layer, 0 = sliding only, plus an MTP
  slot), `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`.
Everything is resolved once here, so the model never looks at raw keys.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}

# Keys we understand but do not need (training knobs, HF bookkeeping, quantization metadata).
_IGNORED_KEYS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "initializer_range",
    "attention_bias", "mlp_bias", "attention_dropout", "keys_to_ignore_at_inference",
    "quantization_config", "expert_dtype", "auto_map", "n_group",
    "topk_group", "topk_method", "first_k_dense_replace", "moe_layer_freq", "ep_size",
    "aux_loss_alpha", "seq_aux", "num_key_value_heads", "tie_word_embeddings", "pad_token_id",
    "bos_token_id", "eos_token_id", "norm_topk_prob", "hidden_act", "intermediate_size",
    "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "scale_fmt", "index_topk_freq",
}


@dataclass(frozen=True)
class RopeSpec:
    """One rotary flavour: plain RoPE (`yarn_factor is None`) or YaRN."""

    theta: float
    yarn_factor: float | None = None
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class DS4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    compress_rates: dict = field(default_factory=lambda: dict(DEFAULT_COMPRESS_RATES))
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    mlp_layer_types: tuple[str, ...] = ()
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_main: RopeSpec = RopeSpec(theta=10000.0)
    rope_compress: RopeSpec = RopeSpec(theta=160000.0)
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 0
    eos_token_id: int | list | None = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    # Multi-token prediction (MTP) layers: their count and attention kinds (the MTP slots of the
    # upstream `compress_ratios`; sliding when a config does not name them).
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()

    def __post_init__(self):
        _validate(self)

    # ----------------------------------------------------------------- derived
    def compress_rate(self, layer_idx: int) -> int:
        """Compression rate m of a layer; 0 for sliding-only layers."""
        kind = self.layer_types[layer_idx]
        return 0 if kind == SLIDING else int(self.compress_rates[kind])

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, (list, tuple)):
            return tuple(int(e) for e in self.eos_token_id)
        return (int(self.eos_token_id),)

    def mtp_config(self) -> "DS4Config":
        """The config an MTP layer and its cache are built from: its layers are the MTP layers
        (routed by score, never hashed: they sit past the hash layers)."""
        n = self.num_nextn_predict_layers
        return self.replace(num_hidden_layers=n, layer_types=self.mtp_layer_types, mlp_layer_types=("moe",) * n,
                            num_nextn_predict_layers=0, mtp_layer_types=())

    # ------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, raw: dict) -> "DS4Config":
        return cls(**_resolve(copy.deepcopy(dict(raw))))

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "DS4Config":
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"config.json at {path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"config.json at {path} must hold a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "DS4Config":
        """The config of a checkpoint directory. Its MTP layers count only when its weights hold
        `mtp.*` tensors: transformers writes `num_nextn_predict_layers: 1` and drops the weights."""
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no config.json in {path}")
        config = cls.from_json_file(file)
        if config.num_nextn_predict_layers:
            from .loading import CheckpointError, checkpoint_tensor_names

            try:
                names = checkpoint_tensor_names(path)
            except CheckpointError:  # a directory with a config alone (`ds4-torch info`): as configured
                return config
            if not any(n.startswith(("mtp.", "model.mtp.")) for n in names):
                config = config.replace(num_nextn_predict_layers=0, mtp_layer_types=())
        return config

    def replace(self, **changes) -> "DS4Config":
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict:
        """The config in transformers' spelling: what `DeepseekV4Config(**d)` accepts."""

        def rope_dict(spec: RopeSpec) -> dict:
            d = {"rope_theta": spec.theta, "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim}
            if spec.yarn_factor is None:
                d["rope_type"] = "default"
            else:
                d.update(rope_type="yarn", factor=spec.yarn_factor,
                         original_max_position_embeddings=spec.original_max_position,
                         beta_fast=spec.beta_fast, beta_slow=spec.beta_slow,
                         attention_factor=spec.attention_factor, truncate=spec.truncate)
            return d

        return {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "compress_rates": dict(self.compress_rates),
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "mlp_layer_types": list(self.mlp_layer_types),
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": 1,
            "num_experts_per_tok": self.num_experts_per_tok,
            "scoring_func": self.scoring_func,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_main.theta,
            "compress_rope_theta": self.rope_compress.theta,
            "rope_parameters": {"main": rope_dict(self.rope_main), "compress": rope_dict(self.rope_compress)},
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            # transformers ignores both (and every `mtp.*` weight); ds4_torch reads them back
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "mtp_layer_types": list(self.mtp_layer_types),
        }

    def save(self, directory: str | os.PathLike) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.to_hf_dict(), f, indent=2)


# ---------------------------------------------------------------------- resolving raw keys
def _pop_int(raw: dict, key: str, default=None):
    value = raw.pop(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"config field `{key}` must be an integer, got {value!r}")
    return int(value)


def _rope_spec(raw: dict | None, theta: float, field_name: str) -> RopeSpec:
    raw = dict(raw or {})
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type == "default":
        return RopeSpec(theta=float(raw.get("rope_theta", theta)))
    if rope_type != "yarn":
        raise ValueError(f"config field `{field_name}`: rope type {rope_type!r} is not supported (default or yarn)")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in raw:
            raise ValueError(f"config field `{field_name}`: yarn needs `{key}`")
    factor = float(raw["factor"])
    attention_factor = raw.get("attention_factor")
    if attention_factor is None:  # transformers' YaRN default (V4 configs normally pin 1.0)
        mscale, mscale_all = raw.get("mscale"), raw.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
                            if mscale and mscale_all else get_mscale(factor))
    return RopeSpec(
        theta=float(raw.get("rope_theta", theta)),
        yarn_factor=factor,
        original_max_position=int(raw["original_max_position_embeddings"]),
        beta_fast=float(raw.get("beta_fast") or 32),
        beta_slow=float(raw.get("beta_slow") or 1),
        attention_factor=float(attention_factor),
        truncate=bool(raw.get("truncate", True)),
    )


def _resolve(raw: dict) -> dict:
    """Turn either key spelling into DS4Config's constructor arguments."""
    out: dict = {}
    n_layers = _pop_int(raw, "num_hidden_layers", 43)
    out["num_hidden_layers"] = n_layers

    head_dim = _pop_int(raw, "head_dim", 512)
    out["head_dim"] = head_dim
    rope_dim = _pop_int(raw, "qk_rope_head_dim")
    partial = raw.pop("partial_rotary_factor", None)
    if rope_dim is None:
        rope_dim = int(head_dim * partial) if partial is not None else min(64, head_dim)
    elif partial is not None and int(head_dim * partial) != rope_dim:
        raise ValueError("config fields `qk_rope_head_dim` and `partial_rotary_factor` disagree")
    out["qk_rope_head_dim"] = rope_dim

    rates = dict(DEFAULT_COMPRESS_RATES)
    given_rates = raw.pop("compress_rates", None)
    if given_rates is not None:
        if not isinstance(given_rates, dict):
            raise ValueError("config field `compress_rates` must be a mapping of layer type to rate")
        rates.update(given_rates)
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        value = _pop_int(raw, legacy)
        if value is not None:
            rates[kind] = value
    for kind, rate in rates.items():
        if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
            raise ValueError(f"config field `compress_rates[{kind!r}]` must be a positive integer, got {rate!r}")
    out["compress_rates"] = rates

    layer_types = raw.pop("layer_types", None)
    ratios = raw.pop("compress_ratios", None)
    if layer_types is None and ratios is not None:
        if not isinstance(ratios, (list, tuple)):
            raise ValueError("config field `compress_ratios` must be a list of integers")
        by_rate = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
        bad = [r for r in ratios[:n_layers] if r not in by_rate]
        if bad:
            raise ValueError(f"config field `compress_ratios` has rates {bad}; expected 0, "
                             f"{rates[CSA]} (CSA) or {rates[HCA]} (HCA)")
        layer_types = [by_rate[r] for r in ratios]
    if layer_types is None:
        raise ValueError("config needs `layer_types` (or the legacy `compress_ratios`): the default "
                         "pattern differs between model sizes, so it is never guessed")
    out["layer_types"] = tuple(layer_types[:n_layers]) if isinstance(layer_types, (list, tuple)) else layer_types
    n_mtp = _pop_int(raw, "num_nextn_predict_layers", 0)
    mtp_types = raw.pop("mtp_layer_types", None)
    if mtp_types is None:  # the upstream spelling: the slots of `compress_ratios` past the layers
        extra = list(layer_types[n_layers:]) if isinstance(layer_types, (list, tuple)) else []
        mtp_types = (extra + [SLIDING] * n_mtp)[:n_mtp]
    out["num_nextn_predict_layers"] = n_mtp
    out["mtp_layer_types"] = tuple(mtp_types) if isinstance(mtp_types, (list, tuple)) else mtp_types

    mlp_types = raw.pop("mlp_layer_types", None)
    n_hash = _pop_int(raw, "num_hash_layers")
    if mlp_types is None:
        n_hash = 3 if n_hash is None else n_hash
        mlp_types = ["hash_moe"] * min(n_layers, n_hash) + ["moe"] * max(0, n_layers - n_hash)
    out["mlp_layer_types"] = tuple(mlp_types[:n_layers]) if isinstance(mlp_types, (list, tuple)) else mlp_types

    n_shared = _pop_int(raw, "n_shared_experts", 1)
    if n_shared != 1:
        raise ValueError(f"config field `n_shared_experts` must be 1 (DeepSeek-V4 has one shared expert), got {n_shared}")
    act = raw.pop("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config field `hidden_act` must be silu, got {act!r}")
    if raw.pop("num_key_value_heads", 1) != 1:
        raise ValueError("config field `num_key_value_heads` must be 1 (DeepSeek-V4 shares one KV head)")
    if raw.get("norm_topk_prob", True) is not True:
        raise ValueError("config field `norm_topk_prob` must be true (DeepSeek-V4 always renormalises)")

    rope_theta = float(raw.pop("rope_theta", 10000.0))
    compress_theta = float(raw.pop("compress_rope_theta", 160000.0))
    rope_params = raw.pop("rope_parameters", None)
    rope_scaling = raw.pop("rope_scaling", None)
    if isinstance(rope_params, dict) and isinstance(rope_params.get("main"), dict):
        out["rope_main"] = _rope_spec(rope_params["main"], rope_theta, "rope_parameters.main")
        out["rope_compress"] = _rope_spec(rope_params.get("compress"), compress_theta, "rope_parameters.compress")
    else:
        flat = dict(rope_params or rope_scaling or {})
        flat.pop("rope_theta", None)
        flat.pop("partial_rotary_factor", None)
        out["rope_main"] = RopeSpec(theta=rope_theta)
        if flat.get("rope_type", flat.get("type", "default")) == "yarn":
            flat.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin by YaRN's mscale
        out["rope_compress"] = _rope_spec(flat, compress_theta, "rope_parameters")

    for key in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads", "q_lora_rank",
                "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                "n_routed_experts", "num_experts_per_tok", "hc_mult", "hc_sinkhorn_iters",
                "max_position_embeddings"):
        if key in raw:
            out[key] = _pop_int(raw, key)
    for key in ("routed_scaling_factor", "swiglu_limit", "hc_eps", "rms_norm_eps"):
        if key in raw:
            value = raw.pop(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"config field `{key}` must be a number, got {value!r}")
            out[key] = float(value)
    for key in ("scoring_func", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if key in raw:
            out[key] = raw.pop(key)
    # Whatever remains is either ignorable metadata or harmless extras; unknown keys are kept
    # out of the dataclass rather than rejected, as real hub configs carry many of them.
    return out


def _validate(c: DS4Config) -> None:
    def positive(name):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"config field `{name}` must be a positive integer, got {value!r}")

    for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
                 "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok", "hc_mult",
                 "hc_sinkhorn_iters"):
        positive(name)
    if not isinstance(c.layer_types, tuple) or len(c.layer_types) != c.num_hidden_layers:
        got = f"{len(c.layer_types)} entries" if isinstance(c.layer_types, tuple) else repr(c.layer_types)
        raise ValueError(f"config field `layer_types` must list one type per layer ({c.num_hidden_layers}), got {got}")
    bad = sorted({t for t in c.layer_types if t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"config field `layer_types` has unknown types {bad}; allowed {list(LAYER_TYPES)}")
    if not isinstance(c.mlp_layer_types, tuple) or len(c.mlp_layer_types) != c.num_hidden_layers:
        got = f"{len(c.mlp_layer_types)} entries" if isinstance(c.mlp_layer_types, tuple) else repr(c.mlp_layer_types)
        raise ValueError(f"config field `mlp_layer_types` must list one type per layer ({c.num_hidden_layers}), got {got}")
    bad = sorted({t for t in c.mlp_layer_types if t not in MLP_LAYER_TYPES})
    if bad:
        raise ValueError(f"config field `mlp_layer_types` has unknown types {bad}; allowed {list(MLP_LAYER_TYPES)}")
    n_mtp = c.num_nextn_predict_layers
    if isinstance(n_mtp, bool) or not isinstance(n_mtp, int) or n_mtp < 0:
        raise ValueError(f"config field `num_nextn_predict_layers` must be an integer >= 0, got {n_mtp!r}")
    if not isinstance(c.mtp_layer_types, tuple) or len(c.mtp_layer_types) != n_mtp or \
            any(t not in LAYER_TYPES for t in c.mtp_layer_types):
        raise ValueError(f"config field `mtp_layer_types` must list one of {list(LAYER_TYPES)} per MTP layer "
                         f"({n_mtp}), got {c.mtp_layer_types!r}")
    for kind in (CSA, HCA):
        rate = c.compress_rates.get(kind)
        if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
            raise ValueError(f"config field `compress_rates[{kind!r}]` must be a positive integer, got {rate!r}")
    unknown = set(c.compress_rates) - {CSA, HCA}
    if unknown:
        raise ValueError(f"config field `compress_rates` has unknown layer types {sorted(unknown)}")
    if c.qk_rope_head_dim <= 0 or c.qk_rope_head_dim > c.head_dim or c.qk_rope_head_dim % 2:
        raise ValueError(f"config field `qk_rope_head_dim` must be even and in (0, head_dim={c.head_dim}], "
                         f"got {c.qk_rope_head_dim}")
    if c.index_head_dim < c.qk_rope_head_dim:
        raise ValueError(f"config field `index_head_dim` ({c.index_head_dim}) must be >= qk_rope_head_dim "
                         f"({c.qk_rope_head_dim}): the indexer ropes its last qk_rope_head_dim channels")
    if c.num_attention_heads % c.o_groups:
        raise ValueError(f"config field `o_groups` ({c.o_groups}) must divide num_attention_heads "
                         f"({c.num_attention_heads})")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ValueError(f"config field `num_experts_per_tok` ({c.num_experts_per_tok}) exceeds "
                         f"n_routed_experts ({c.n_routed_experts})")
    if c.scoring_func not in SCORING_FUNCS:
        raise ValueError(f"config field `scoring_func` must be one of {SCORING_FUNCS}, got {c.scoring_func!r}")
    for name in ("rms_norm_eps", "hc_eps"):
        if not getattr(c, name) > 0:
            raise ValueError(f"config field `{name}` must be > 0")
    if c.tie_word_embeddings:
        raise ValueError("config field `tie_word_embeddings` must be false: DeepSeek-V4 has a separate lm head")


# The hub's V4-Flash pattern (`compress_ratios`): 2 sliding layers, then CSA (4) and HCA (128)
# alternating, 21 CSA and 20 HCA; the last entry is the MTP slot.
V4_FLASH_COMPRESS_RATIOS = (0, 0) + (4, 128) * 20 + (4, 0)


def v4_flash_config() -> DS4Config:
    """V4-Flash's shapes, no weights needed: the dataclass defaults are its sizes, with its layer
    pattern (for sizes and benchmarks)."""
    return DS4Config.from_dict({"compress_ratios": list(V4_FLASH_COMPRESS_RATIOS)})
