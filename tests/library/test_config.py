"""DS4Config: both key spellings resolve like transformers does; bad configs name the field."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from ds4_torch import DS4Config
from ds4_torch.config import CSA, HCA, SLIDING
from ds4_torch.model import rope_inv_freq

LEGACY = dict(
    vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
    head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8, index_n_heads=8,
    index_head_dim=16, index_topk=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    compress_ratios=[0, 4, 128, 4, 128, 4],  # last entry: the MTP slot, past num_hidden_layers
    num_hash_layers=2, qk_rope_head_dim=8, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=65536, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
    swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}, expert_dtype="fp4",
)


def test_legacy_keys_resolve_like_transformers():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    ours = DS4Config.from_dict(LEGACY)
    theirs = DeepseekV4Config(**copy.deepcopy({k: v for k, v in LEGACY.items() if k != "expert_dtype"}))
    assert list(ours.layer_types) == theirs.layer_types == [SLIDING, CSA, HCA, CSA, HCA]
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types == ["hash_moe"] * 2 + ["moe"] * 3
    assert ours.qk_rope_head_dim == theirs.qk_rope_head_dim == 8
    rotary = DeepseekV4RotaryEmbedding(theirs)
    assert torch.equal(rope_inv_freq(ours.rope_main, 8), rotary.main_inv_freq)
    assert torch.equal(rope_inv_freq(ours.rope_compress, 8), rotary.compress_inv_freq)
    assert ours.rope_compress.attention_factor == rotary.compress_attention_scaling == 1.0


def test_hf_keys_round_trip_and_match_legacy():
    legacy = DS4Config.from_dict(LEGACY)
    hf_style = DS4Config.from_dict(legacy.to_hf_dict())
    assert hf_style == legacy
    from transformers import DeepseekV4Config

    theirs = DeepseekV4Config(**legacy.to_hf_dict())
    assert theirs.layer_types == list(legacy.layer_types)
    assert theirs.compress_rates == legacy.compress_rates


def test_from_pretrained_reads_config_json(tmp_path):
    DS4Config.from_dict(LEGACY).save(tmp_path)
    assert DS4Config.from_pretrained(tmp_path) == DS4Config.from_dict(LEGACY)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        DS4Config.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        DS4Config.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize("change,field", [
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(hidden_size="64"), "hidden_size"),
    (dict(compress_ratios=[0, 4, 7, 4, 128]), "compress_ratios"),
    (dict(compress_ratios=None, layer_types=[SLIDING, CSA]), "layer_types"),
    (dict(compress_ratios=None, layer_types=[SLIDING, CSA, HCA, CSA, "global"]), "layer_types"),
    (dict(compress_ratios=None), "layer_types"),
    (dict(mlp_layer_types=["moe"] * 4 + ["dense"]), "mlp_layer_types"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(qk_rope_head_dim=64), "qk_rope_head_dim"),
    (dict(index_head_dim=4), "index_head_dim"),
    (dict(o_groups=3), "o_groups"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(n_shared_experts=2), "n_shared_experts"),
    (dict(num_key_value_heads=4), "num_key_value_heads"),
    (dict(compress_rates={"compressed_sparse_attention": 0}), "compress_rates"),
    (dict(rope_scaling={"type": "longrope"}), "rope_parameters"),
    (dict(rope_scaling={"type": "yarn"}), "rope_parameters"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
])
def test_invalid_configs_name_the_field(change, field):
    raw = copy.deepcopy(LEGACY)
    for key, value in change.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    with pytest.raises(ValueError, match=field):
        DS4Config.from_dict(raw)


def test_config_json_must_be_an_object(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="JSON object"):
        DS4Config.from_pretrained(tmp_path)
