"""The shipped default model: real weights that transformers loads too, with the same numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ds4_torch.config import CSA, HCA, SLIDING
from ds4_torch.default_model import DEFAULT_MODEL_DIR, build_default_model, default_tokenizer

# The first 2,400 characters of the last 10% of Tiny Shakespeare (public domain): the split
# train_tiny.py held out, as much of it as the loss test reads.
HELD_OUT = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare_held_out.txt"


@pytest.fixture(scope="module")
def models():
    from transformers import DeepseekV4ForCausalLM

    theirs = DeepseekV4ForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    return build_default_model(), theirs


def test_shipped_files_and_architecture():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "training.json"):
        assert (DEFAULT_MODEL_DIR / name).is_file(), name
    assert (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size <= 20 * 2**20
    model = build_default_model()
    cfg = model.config
    assert {SLIDING, CSA, HCA} <= set(cfg.layer_types)
    assert "hash_moe" in cfg.mlp_layer_types and "moe" in cfg.mlp_layer_types and cfg.hc_mult > 1
    assert cfg.index_n_heads >= 8
    # a few hundred generated tokens cross every boundary: window fill, both emit rates, the indexer
    assert cfg.sliding_window < 100 and max(cfg.compress_rates.values()) * cfg.index_topk < 300
    tok = default_tokenizer()
    # No Jinja template: the official DeepSeek-V4 encoding, whose markup the model has tokens for.
    assert tok.chat_template is None
    assert tok.render_chat([{"role": "user", "content": "Hi"}]) == \
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    for marker in ("<think>", "</think>", "<｜DSML｜tool_calls>", "</｜DSML｜invoke>", "<tool_result>"):
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker
        assert tok.decode(tok.encode(marker, add_special_tokens=False)) == marker  # kept when decoding
    assert tok.vocab_size == cfg.vocab_size
    assert tok.eos_token_id == cfg.eos_token_ids[0]


def held_out_tokens(n: int) -> torch.Tensor:
    held = HELD_OUT.read_text(encoding="utf-8")
    assert len(held) >= 8 * n, "tests/data holds too short a slice for this many tokens"
    return torch.tensor([default_tokenizer().encode(held[:8 * n])[:n]])


@torch.no_grad()
def test_logits_and_held_out_loss_match_transformers(models):
    ours, theirs = models
    ids = held_out_tokens(300)
    a, b = ours(ids), theirs(ids).logits
    assert (a - b).abs().max().item() <= 1e-4
    loss_ours = F.cross_entropy(a[0, :-1], ids[0, 1:]).item()
    loss_theirs = F.cross_entropy(b[0, :-1], ids[0, 1:]).item()
    assert abs(loss_ours - loss_theirs) <= 1e-5
    recorded = json.loads((DEFAULT_MODEL_DIR / "training.json").read_text())["held_out_loss"]
    assert loss_ours < recorded + 0.5  # no worse than the full held-out evaluation recorded at training
    assert loss_ours < 5.0  # far below a uniform guess (ln 1038 = 6.9): it has learned the text


@torch.no_grad()
def test_logits_past_the_old_4k_context_match_transformers(tmp_path):
    """Past 4,096 positions (the model's context before long-context training), where only the
    compressed layers' YaRN-scaled rotary keeps far positions apart: the same logits as
    transformers. The indexer keeps every row here (index_topk raised on a copy of the model):
    with 8 of ~1,150 rows, near-equal scores make either implementation's top-k a coin toss
    (torch.topk's order among equals depends on the tensor's size), which is not what this tests."""
    import shutil

    from transformers import DeepseekV4ForCausalLM

    from ds4_torch.model import DS4ForCausalLM

    n = 4096 + 512
    copy = shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "model")
    config = json.loads((copy / "config.json").read_text())
    assert config["max_position_embeddings"] >= 131072
    config["index_topk"] = n // 4
    (copy / "config.json").write_text(json.dumps(config))
    ours = DS4ForCausalLM.from_pretrained(copy)
    theirs = DeepseekV4ForCausalLM.from_pretrained(copy, dtype=torch.float32).eval()
    ids = torch.randint(2, ours.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(5))
    a = ours(ids, logits_to_keep=256)
    b = theirs(ids, logits_to_keep=256).logits
    assert (a - b).abs().max().item() <= 1e-4


@torch.no_grad()
def test_rotary_tables_match_transformers_to_the_last_position(models):
    """Both rotary embeddings (sliding layers' default, compressed layers' YaRN) at positions up
    to max_position_embeddings - 1: the same angles as transformers' DeepseekV4RotaryEmbedding."""
    ours, theirs = models
    last = ours.config.max_position_embeddings - 1
    positions = torch.tensor([[0, 1, 31, 4095, 4096, 40000, 65535, last]])
    x = torch.zeros(1, dtype=torch.float32)
    for kind, rotary in (("main", ours.model.rotary_main), ("compress", ours.model.rotary_compress)):
        cos, sin = rotary(positions[0], torch.float32)
        cos_t, sin_t = theirs.model.rotary_emb(x, positions, layer_type=kind)
        half = cos.shape[-1]
        torch.testing.assert_close(cos.reshape(len(positions[0]), -1)[..., :half],
                                   cos_t[0].reshape(len(positions[0]), -1)[..., :half], atol=2e-5, rtol=0)
        torch.testing.assert_close(sin.reshape(len(positions[0]), -1)[..., :half],
                                   sin_t[0].reshape(len(positions[0]), -1)[..., :half], atol=2e-5, rtol=0)
