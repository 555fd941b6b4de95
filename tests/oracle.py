"""The numerical oracle: transformers' DeepseekV4ForCausalLM on tiny random configs.

`make_oracle(tmp_path, **overrides)` builds an HF model with every parameter and buffer
randomised (sinks, position biases, hc params, norms, correction bias, tid2eid: all matter),
saves it with `save_pretrained`, and returns (hf_model, checkpoint_dir).
"""

from __future__ import annotations

import copy

import torch

BASE_CONFIG = dict(
    vocab_size=101,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=5,
    num_attention_heads=4,
    head_dim=32,
    partial_rotary_factor=0.25,  # rope on the last 8 channels
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    sliding_window=6,  # not a multiple of either rate
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
    index_n_heads=8,
    index_head_dim=16,
    index_topk=3,
    n_routed_experts=6,
    num_experts_per_tok=2,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32.0, "beta_slow": 1.0},
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=1,
)


def hf_config(**overrides):
    from transformers import DeepseekV4Config

    raw = copy.deepcopy(BASE_CONFIG)
    raw.update(copy.deepcopy(overrides))
    # DeepseekV4Config mutates nested dicts it is given: hand it copies.
    return DeepseekV4Config(**copy.deepcopy(raw))


@torch.no_grad()
def randomise(model, seed: int) -> None:
    """Give every parameter and buffer a random value with a scale that keeps activations sane."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("scale"):  # hc scales
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        elif "norm" in name:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        elif "sinks" in name or "position_bias" in name or name.endswith("base"):
            p.copy_(torch.randn(p.shape, generator=g))
        elif "embed" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        elif "experts" in name and p.dim() == 3:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            n_exp, k = model.config.n_routed_experts, b.shape[-1]
            b.copy_(torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(b.shape[0])]))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))


def make_oracle(tmp_path, seed: int = 0, **overrides):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(**overrides)).float().eval()
    randomise(model, seed)
    out = tmp_path / f"hf_model_{seed}"
    model.save_pretrained(out)
    return model, out


@torch.no_grad()
def hf_logits_incremental(model, input_ids, chunks):
    """transformers' logits when feeding `input_ids` in chunks of the given sizes with its cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    outs, pos = [], 0
    for n in chunks:
        ids = input_ids[:, pos:pos + n]
        outs.append(model(ids, past_key_values=cache, use_cache=True).logits)
        pos += n
    return torch.cat(outs, dim=1)
