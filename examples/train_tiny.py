"""Train the tiny DS4 model shipped as ds4_torch's default model, on CPU, reproducibly.

    python examples/train_tiny.py --out ds4_torch/assets/tiny-shakespeare

Data: the public-domain Tiny Shakespeare text, read from ../shared/data (never copied into
the repo). The last 10% of the text is held out. Tokenizer: byte-level BPE trained with the
`tokenizers` package on the training split. Model: every DS4 layer kind (sliding, CSA with its
lightning indexer, HCA), MoE with a hash-routed layer, mHC with 4 streams; a window and rates
small enough that a few hundred generated tokens cross every cache boundary. Everything is
seeded: the same torch build gives the same model.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ds4_torch import DS4Config, DS4ForCausalLM
from ds4_torch.kernels import AttentionOps, reference
from ds4_torch.model import Router
from ds4_torch.tokenizer import ASSISTANT, BOS, EOS, USER

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

MODEL_CONFIG = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 32,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 8,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "num_hash_layers": 1,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 4096,
}

# DeepSeek's chat format as a Jinja template, for tokenizer_config.json (transformers renders it).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% if not loop.last %}\n\n{% endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}" + EOS + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def train_tokenizer(text: str, vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text[i:i + 4096] for i in range(0, len(text), 4096)], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"], "chat_template": CHAT_TEMPLATE,
    }, indent=2, ensure_ascii=False))
    return tok


def batches(data: torch.Tensor, batch: int, length: int, g: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - length - 1, (batch,), generator=g)
        chunk = torch.stack([data[s:s + length + 1] for s in starts])
        yield chunk[:, :-1], chunk[:, 1:]


class ExpertBalancer:
    """Aux-loss-free balancing (DeepSeek-V3/V4): count each learned router's expert loads during
    the step's forwards; `step()` then nudges its correction bias towards under-used experts."""

    def __init__(self, model, rate: float = 1e-3):
        self.rate, self.loads = rate, {}
        self.routers = [m for m in model.modules() if isinstance(m, Router) and not m.hashed]
        experts = model.config.n_routed_experts
        for r in self.routers:
            r.register_forward_hook(lambda router, _inputs, output: self.loads.__setitem__(
                router, self.loads.get(router, 0) + torch.bincount(output[1].reshape(-1), minlength=experts)))

    @torch.no_grad()
    def step(self) -> None:
        for r in self.routers:
            if r not in self.loads:  # a router the step did not run (the MTP layer's)
                continue
            load = self.loads.pop(r).float()
            r.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)


def optimizer(model, lr: float, weight_decay: float, steps: int):
    """AdamW (no decay on vectors) and a schedule: linear warm-up over 5% of the steps, then
    cosine down to a tenth of `lr`."""
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    return opt, sched


@torch.no_grad()
def evaluate(model, data: torch.Tensor, length: int) -> float:
    """Mean next-token loss over the whole held-out split, in windows of `length` tokens."""
    model.eval()
    total, count = 0.0, 0
    for s in range(0, len(data) - 1, length):
        chunk = data[s:s + length + 1]
        if len(chunk) < 2:
            break
        logits = model(chunk[None, :-1])
        total += F.cross_entropy(logits[0], chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    model.train()
    return total / count


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--out", type=Path, default=REPO / "ds4_torch" / "assets" / "tiny-shakespeare")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)  # 2 threads thrash on small ops
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    text = args.data.read_text(encoding="utf-8")
    split = int(len(text) * 0.9)
    args.out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(text[:split], MODEL_CONFIG["vocab_size"], args.out)
    train = torch.tensor(tok.encode(text[:split]).ids)
    held_out = torch.tensor(tok.encode(text[split:]).ids)
    cfg = DS4Config.from_dict({**MODEL_CONFIG, "vocab_size": tok.get_vocab_size(),
                               "bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)})
    model = DS4ForCausalLM(cfg).init_weights(seed=args.seed)
    # Training needs gradients: use the plain reference functions (the ds4::* custom ops that
    # serve inference are forward-only).
    model.ops = AttentionOps("reference", reference.attention, reference.compress_rows, reference.indexer_topk)
    n_params = model.num_parameters()
    print(f"{len(train):,} train / {len(held_out):,} held-out tokens; {n_params:,} parameters")

    balance = ExpertBalancer(model)
    opt, sched = optimizer(model, args.lr, 0.1, args.steps)
    data = batches(train, args.batch, args.length, torch.Generator().manual_seed(args.seed))
    model.train()
    t0 = time.time()
    for step in range(1, args.steps + 1):
        x, y = next(data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        balance.step()
        if step % 50 == 0 or step == 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:7.1f} s", flush=True)
    train_time = time.time() - t0
    held_out_loss = evaluate(model, held_out, 256)
    print(f"held-out loss {held_out_loss:.3f} nats/token (perplexity {math.exp(held_out_loss):.1f}); "
          f"trained {args.steps} steps in {train_time / 60:.1f} min")
    model.eval().save_pretrained(args.out)
    (args.out / "training.json").write_text(json.dumps({
        "parameters": n_params, "steps": args.steps, "batch": args.batch, "length": args.length,
        "seed": args.seed, "train_tokens": len(train), "held_out_tokens": len(held_out),
        "held_out_loss": round(held_out_loss, 4), "train_minutes": round(train_time / 60, 1),
        "torch": torch.__version__, "threads": args.threads,
    }, indent=2))


if __name__ == "__main__":
    main()
