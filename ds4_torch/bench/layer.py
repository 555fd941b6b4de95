"""`ds4-torch bench layer`: one decode step of one V4-Flash attention layer at long context.

The whole attention block of a CSA or HCA layer at real V4-Flash sizes (hidden 4096, 64 query
heads x 512, one KV head, q rank 1024, 8 output groups x 1024, window 128; CSA: rate 4 and the
indexer, 64 heads x 128, top-k 512; HCA: rate 128): q/kv projections and norms, the compressor
(and for CSA the indexer's compressor, its scan of every compressed row and its top-k), the
attention and the grouped output projection, for one new token at position `context - 2` (an
ordinary step: no window closes). The cache holds random state of that length (prefilling 256K
tokens on a CPU would take hours). transformers' `DeepseekV4Attention` runs the same step on the
same weights and the same state (window, compressed and indexer rows, open-window buffers,
overlap), and its output must agree with ours. MoE and mHC are left out: their cost does not
depend on the context. transformers runs in fp32 only (its bf16 step at 256K takes minutes).
"""

from __future__ import annotations

import math
import time

import torch

from .report import machine, progress, write_csv

FLASH = {
    "vocab_size": 1024, "hidden_size": 4096, "num_hidden_layers": 1, "num_attention_heads": 64, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    # The MoE is never run here: the smallest one the config accepts.
    "moe_intermediate_size": 8, "n_routed_experts": 2, "num_experts_per_tok": 1, "num_hash_layers": 0, "hc_mult": 4,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
}
KINDS = {"CSA": "compressed_sparse_attention", "HCA": "heavily_compressed_attention"}


def _best_times(fns: dict, repeats: int, before: dict) -> dict:
    """Best wall time of each function over `repeats` rounds after one warm-up round; the
    functions take turns within a round, so a noisy stretch of the machine hits them alike.
    `before[name]` runs untimed before each call of `fns[name]`."""
    best = dict.fromkeys(fns, math.inf)
    for i in range(repeats + 1):
        for name, fn in fns.items():
            if name in before:
                before[name]()
            t = time.perf_counter()
            fn()
            if i:
                best[name] = min(best[name], time.perf_counter() - t)
    return best


class _Layer:
    """Our attention layer and its cache at position `context - 2`, filled with random state."""

    def __init__(self, kind: str, context: int, dtype: torch.dtype, seed: int = 0):
        from ..config import DS4Config
        from ..model import DS4ForCausalLM

        self.config = DS4Config.from_dict({**FLASH, "layer_types": [KINDS[kind]]})
        model = DS4ForCausalLM(self.config).init_weights(seed=seed).eval()
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():  # non-zero position biases and sinks, so they count in the agreement check
            for name, p in model.named_parameters():
                if name.endswith(("position_bias", "sinks")):
                    p.copy_(torch.randn(p.shape, generator=g))
        self.model = model.to_dtype(dtype)
        self.attn = model.model.layers[0].self_attn
        self.cache = model.new_cache(1, context)
        self.position = context - 2
        layer = self.cache.layers[0]
        for t in layer.tensors():
            t.copy_(torch.randn(t.shape, generator=g))
        self.cache.positions.fill_(self.position)
        self.x = torch.randn(1, 1, self.config.hidden_size, generator=g).to(dtype)

    def step(self):
        from ..model import ForwardPlan

        plan = ForwardPlan(self.model.model, self.cache, 1, self.x.dtype)  # what the model's forward builds
        return self.attn(self.x, self.cache.layers[0], plan, self.model.ops)


class _TransformersLayer:
    """transformers' DeepseekV4Attention with our layer's weights and the same cache state."""

    def __init__(self, ours: _Layer):
        import transformers
        from transformers import DynamicCache
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

        cfg = transformers.DeepseekV4Config(**ours.config.to_hf_dict())
        cfg._attn_implementation = "eager"
        self.attn = hf.DeepseekV4Attention(cfg, 0).eval()
        missing, unexpected = self.attn.load_state_dict(ours.attn.state_dict(), strict=False)
        assert not unexpected and all("rotary_emb" in k for k in missing), (missing, unexpected)
        self.rotary = hf.DeepseekV4RotaryEmbedding(cfg)
        self.cache = DynamicCache(config=cfg)
        self.t = t = ours.position
        self.x = ours.x.float()

        layer, state = self.cache.layers[0], ours.cache.layers[0]
        W, m = cfg.sliding_window, state.rate
        window = state.window[:, [p % W for p in range(t - W + 1, t)]][:, None]  # positions t-W+1 .. t-1
        layer.lazy_initialization(window, window)
        layer.keys = layer.values = window
        layer.cumulative_length = t
        n, opened = t // m, t % m  # closed windows, tokens of the open one
        compressor = ours.attn.compressor
        parts = [("compressor", state.compressor, compressor)]
        if state.indexer is not None:
            parts.append(("indexer", state.indexer, compressor.indexer))
        for name, s, module in parts:
            layer.compressed_kv[name] = s.visible(n)
            layer.entry_count[name] = n
            layer.buffer_kv[name] = s.open_kv[:, :opened]
            layer.buffer_gate[name] = s.open_gate[:, :opened] - module.position_bias[:opened]  # HF adds it later
            if s.prev_kv is not None:
                layer.overlap_kv[name], layer.overlap_gate[name] = s.prev_kv, s.prev_gate
        self.saved = {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(layer).items()}
        self.mask = torch.zeros(1, 1, 1, W)  # every window key is visible to the new token

    def restore(self):
        """Undo the previous step (transformers' cache replaces its tensors, it never writes into them)."""
        layer = self.cache.layers[0]
        for k, v in self.saved.items():
            setattr(layer, k, dict(v) if isinstance(v, dict) else v)

    def step(self):
        ids = torch.tensor([[self.t]])
        embeddings = {kind: self.rotary(self.x, ids, layer_type=kind) for kind in ("main", "compress")}
        return self.attn(self.x, embeddings, ids, self.mask, past_key_values=self.cache)[0]


@torch.no_grad()
def run(contexts=(4096, 65536, 262144), kinds=("CSA", "HCA"), dtypes=(torch.float32, torch.bfloat16),
        repeats: int = 5, transformers: bool = True, csv_path=None) -> list[dict]:
    rows = []
    bar = progress(len(contexts) * len(kinds), "bench layer", unit="layer")
    for context in contexts:
        for kind in kinds:
            bar.set_postfix_str(f"{kind} at {context}")
            fns, before = {}, {}
            for dtype in dtypes:
                ours = _Layer(kind, context, dtype)
                out = ours.step()
                fns[f"ours_{_short(dtype)}_ms"] = ours.step
                if dtype == torch.float32 and transformers:
                    peer = _TransformersLayer(ours)
                    peer.restore()
                    theirs = peer.step()
                    diff = ((theirs - out).abs().max() / out.abs().max()).item()
                    if diff > 1e-3:
                        raise AssertionError(f"transformers disagrees with ours at {kind} {context}: {diff:.2e}")
                    fns["transformers_fp32_ms"], before["transformers_fp32_ms"] = peer.step, peer.restore
            best = _best_times(fns, repeats, before)
            rows.append({"context": context, "layer": kind, **{k: 1e3 * v for k, v in best.items()}})
            del fns, before
            bar.update()
    bar.close()
    print_table(rows)
    if csv_path:
        write_csv(rows, csv_path)
    return rows


def _short(dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def print_table(rows) -> None:
    print(f"one V4-Flash attention layer, one decode step (no window closes), batch 1; {machine()}, "
          f"{torch.get_num_threads()} thread(s); ms, best of interleaved runs")
    keys = [k for k in rows[0] if k.endswith("_ms")]
    head = f"{'context':>8} {'layer':>5} " + " ".join(f"{k[:-3]:>17}" for k in keys)
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['context']:>8} {r['layer']:>5} " + " ".join(f"{r.get(k, float('nan')):>17.2f}" for k in keys))
    by = {(r["context"], r["layer"]): r for r in rows}
    targets = {"CSA": "target <= 1.3x", "HCA": "no target"}
    for kind in KINDS:
        if (65536, kind) in by and (262144, kind) in by and "ours_fp32_ms" in by[(65536, kind)]:
            a, b = by[(65536, kind)], by[(262144, kind)]
            print(f"{kind} fp32: 256K / 64K = {b['ours_fp32_ms'] / a['ours_fp32_ms']:.2f}x ({targets[kind]})")
    bf16_targets = {("CSA", 65536): "target <= 1.0x", ("HCA", 262144): "target <= 1.3x"}
    for r in rows:
        if "ours_bf16_ms" in r and "ours_fp32_ms" in r and r["context"] in (65536, 262144):
            note = bf16_targets.get((r["layer"], r["context"]), "no target")
            print(f"{r['layer']} at {r['context']}: bf16 / fp32 = {r['ours_bf16_ms'] / r['ours_fp32_ms']:.2f}x ({note})")
    if (4096, "HCA") in by and "transformers_fp32_ms" in by[(4096, "HCA")]:
        r = by[(4096, "HCA")]
        print(f"HCA at 4096 fp32: ours / transformers = {r['ours_fp32_ms'] / r['transformers_fp32_ms']:.2f}x "
              f"(target <= 1.0x)")
