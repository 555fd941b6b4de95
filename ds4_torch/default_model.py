"""The built-in default model: a tiny DS4 with deterministic random weights.

It lets every command run on a fresh machine with no checkpoint. Its output is
meaningless text; it exercises every attention kind (sliding, CSA with its indexer,
HCA) and the byte tokenizer. Weights come from ``torch.manual_seed(0)``, so the same
torch build gives the same model everywhere.
"""
from __future__ import annotations

import torch

# Small enough to build in a fraction of a second on a laptop CPU, large enough that
# compressed rows and the indexer's top-k become active within a short prompt.
DEFAULT_CONFIG = {
    "vocab_size": 256,  # one token per byte: see tokenizer.ByteTokenizer
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 16,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "index_n_heads": 8,  # >= 8 heads: fewer make top-k ties at relu(0) common
    "index_head_dim": 16,
    "index_topk": 8,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "num_hash_layers": 1,
    "hc_mult": 4,
    "max_position_embeddings": 65536,
    # Bytes have no BOS/EOS: generation runs to its token limit.
    "bos_token_id": None,
    "eos_token_id": None,
}


def default_config():
    from .config import DS4Config

    return DS4Config.from_dict(DEFAULT_CONFIG)


def build_default_model(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The default model, in eval mode. Leaves the global RNG state untouched."""
    from .model import DS4ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DS4ForCausalLM(default_config())
    # to_dtype keeps the numerically sensitive small parameters in fp32.
    return model.to(device).to_dtype(dtype).eval()


def default_tokenizer():
    from .tokenizer import ByteTokenizer

    return ByteTokenizer()
