"""Give the embedded model an MTP layer (DeepSeek-V4's multi-token prediction) for speculative
decoding, training it with the main model frozen.

    python examples/train_mtp.py                      # train, then measure acceptance
    python examples/train_mtp.py --measure-only       # measure the shipped layer again

The MTP layer at position p sees the main model's last hidden streams at p and the embedding of
token p+1 and predicts token p+2. A draft is accepted when it is what the main model would emit,
so the layer is trained by distillation: its distribution at p is pulled towards the frozen main
model's at p+1 (cross-entropy against those soft targets), on the training split (the first 90%)
of Tiny Shakespeare. Its decoder layer starts as a copy of the main model's sliding layer 0
(attention, experts, mHC) with a learned router (from layer 1: layer 0 routes by hash), its mHC
head and final norm as copies of the model's, and both projections as identities.

Acceptance (tokens emitted per verify step, the bonus token included) is measured with
`generate(..., speculative_tokens=N)` on prompts from the held-out last 10%, at temperature 0 and
0.7, and written to training.json beside the weights (key `mtp`), with the run's settings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ds4_torch import DS4ForCausalLM
from ds4_torch.config import SLIDING
from ds4_torch.kernels import AttentionOps, reference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import DEFAULT_DATA, REPO, batches, optimizer  # noqa: E402

ASSET = REPO / "ds4_torch" / "assets" / "tiny-shakespeare"


def shakespeare_splits(tok, data: Path):
    text = data.read_text(encoding="utf-8")
    split = int(len(text) * 0.9)  # train_tiny.py's split
    return text[:split], text[split:], torch.tensor(tok.encode(text[:split]).ids), torch.tensor(tok.encode(text[split:]).ids)


def with_mtp(base: DS4ForCausalLM) -> DS4ForCausalLM:
    """`base` plus one sliding MTP layer initialised from its own layers (see the docstring)."""
    config = base.config.replace(num_nextn_predict_layers=1, mtp_layer_types=(SLIDING,))
    model = DS4ForCausalLM(config).init_weights(seed=2468)
    model.load_state_dict(base.state_dict(), strict=False)
    model._init_buffers()
    src, mtp = base.model.layers[0], model.mtp[0]
    with torch.no_grad():
        for name in ("self_attn", "mlp.experts", "mlp.shared_experts", "input_layernorm", "post_attention_layernorm",
                     "attn_hc", "ffn_hc"):
            mtp.get_submodule(name).load_state_dict(src.get_submodule(name).state_dict())
        mtp.mlp.gate.load_state_dict(base.model.layers[1].mlp.gate.state_dict())
        mtp.hc_head.load_state_dict(base.model.hc_head.state_dict())
        mtp.norm.load_state_dict(base.model.norm.state_dict())
        for proj in (mtp.e_proj, mtp.h_proj):
            proj.weight.copy_(torch.eye(proj.weight.shape[0]))
    return model


def distill_loss(model, x: torch.Tensor, hard_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of the MTP's drafts against the main model's next-position
    distribution (plus `hard_weight` times the cross-entropy against its argmax: greedy drafts
    are accepted only when they equal it), and the top-1 agreement (what greedy acceptance counts)."""
    B, T = x.shape
    cache = model.new_cache(B, T)
    with torch.no_grad():
        logits, streams = model._forward(x, cache, return_streams=True)
        teacher = torch.softmax(logits[:, 1:].float(), dim=-1)
    draft, _ = model.mtp_forward(streams[:, :-1], x[:, 1:], cache)
    log_q = torch.log_softmax(draft.float(), dim=-1)
    loss = -(teacher * log_q).sum(-1).mean()
    if hard_weight:
        loss = loss - hard_weight * log_q.gather(-1, teacher.argmax(-1, keepdim=True)).mean()
    agree = (draft.argmax(-1) == teacher.argmax(-1)).float().mean()
    return loss, agree


@torch.no_grad()
def generated_sequences(model, train: torch.Tensor, count: int, prompt_len: int, new_tokens: int,
                        temperatures: tuple[float, ...], seed: int, batch: int = 32) -> torch.Tensor:
    """[count, prompt_len + new_tokens] token rows: training-split windows continued by the main
    model itself (batched decode, seeded, the temperatures in turn). Speculation drafts after
    the model's own tokens, not after Shakespeare's: training the MTP layer on them too targets
    what it is measured on (self-distillation, as EAGLE and Medusa do)."""
    from ds4_torch.sampling import BatchSampler, SamplingParams

    g = torch.Generator().manual_seed(seed)
    rows = []
    for first in range(0, count, batch):
        B = min(batch, count - first)
        starts = torch.randint(0, len(train) - prompt_len, (B,), generator=g)
        ids = torch.stack([train[s:s + prompt_len] for s in starts])
        sampler = BatchSampler(B, model.config.vocab_size)
        for b in range(B):
            t = temperatures[(first + b) % len(temperatures)]
            sampler.admit(b, SamplingParams(temperature=t, seed=seed + first + b))
        cache = model.new_cache(B, prompt_len + new_tokens)
        with torch.inference_mode():
            logits = model._forward(ids, cache, logits_to_keep=1)[:, -1]
            out = []
            for _ in range(new_tokens):
                token = sampler.sample(logits.float()).tokens
                sampler.append(token)
                out.append(token)
                logits = model._forward(token.view(B, 1), cache)[:, -1]
        rows.append(torch.cat([ids, torch.stack(out, 1)], 1))
    return torch.cat(rows)


def row_batches(rows: torch.Tensor, batch: int, g: torch.Generator):
    while True:
        yield rows[torch.randint(0, rows.shape[0], (batch,), generator=g)], None


@torch.no_grad()
def held_out_agreement(model, data: torch.Tensor, length: int = 256) -> tuple[float, float]:
    model.eval()
    losses, agrees, n = 0.0, 0.0, 0
    for s in range(0, len(data) - length, length):
        loss, agree = distill_loss(model, data[None, s:s + length])
        losses, agrees, n = losses + float(loss), agrees + float(agree), n + 1
    return losses / n, agrees / n


def measure_acceptance(model_dir: Path, held_text: str, prompts: int, new_tokens: int, draft_tokens: int,
                       temperature: float, seed: int = 99) -> dict:
    """Mean tokens emitted per verify step over `prompts` held-out prompts (200 characters each,
    evenly spaced through the held-out text)."""
    from ds4_torch import generate
    from ds4_torch.generation import SpeculationStats
    from ds4_torch.tokenizer import load_tokenizer

    model = DS4ForCausalLM.from_pretrained(model_dir)
    tok = load_tokenizer(model_dir)
    stats = SpeculationStats()
    step = len(held_text) // prompts
    for i in range(prompts):
        ids = tok.encode(held_text[i * step:i * step + 200])
        for _ in generate(model, ids, new_tokens, temperature=temperature, seed=seed + i,
                          speculative_tokens=draft_tokens, stats=stats):
            pass
    return {"temperature": temperature, "draft_tokens": draft_tokens, "prompts": prompts, "new_tokens": new_tokens,
            "verify_steps": stats.steps, "drafted": stats.drafted, "accepted": stats.accepted,
            "acceptance_length": round(stats.acceptance_length, 3)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ASSET, help="the model directory (read and written)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--minutes", type=float, default=15.0, help="stop training after this long")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=2468)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--measure-only", action="store_true")
    p.add_argument("--continue-mtp", action="store_true",
                   help="continue the model's own MTP layer (after the main model changed) instead of a new one")
    p.add_argument("--hard-weight", type=float, default=0.0,
                   help="add this times the cross-entropy against the main model's argmax (greedy acceptance)")
    p.add_argument("--self-distill", type=int, default=0, metavar="N",
                   help="also train on N training-split windows continued by the main model itself (greedy and "
                        "at 0.7 in turn), every other step (default 0: Shakespeare only)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=96)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))  # as train_tools.py reads the splits
    _, held_text, train, held_out = shakespeare_splits(tok, args.data)
    record = json.loads((args.model / "training.json").read_text())
    if not args.measure_only:
        base = DS4ForCausalLM.from_pretrained(args.model)
        continued = bool(args.continue_mtp and base.config.num_nextn_predict_layers)
        model = base if continued else with_mtp(base)
        del base
        model.ops = AttentionOps("reference", reference.attention, reference.compress_rows, reference.indexer_topk)
        for name, q in model.named_parameters():
            q.requires_grad_(name.startswith("mtp."))
        trained = [q for q in model.parameters() if q.requires_grad]
        before = held_out_agreement(model, held_out)
        print(f"held-out distillation loss {before[0]:.4f}, top-1 agreement {before[1]:.3f}", flush=True)
        opt, sched = optimizer(model.mtp, args.lr, args.weight_decay, args.steps)
        data = batches(train, args.batch, args.length, torch.Generator().manual_seed(args.seed))
        own = None
        if args.self_distill:
            t_gen = time.time()
            model.eval()
            rows = generated_sequences(model, train, args.self_distill, args.length // 4,
                                       args.length - args.length // 4, (0.0, 0.7), args.seed)
            own = row_batches(rows, args.batch, torch.Generator().manual_seed(args.seed + 1))
            print(f"{rows.shape[0]} sequences of {rows.shape[1]} tokens generated in {time.time() - t_gen:.0f} s",
                  flush=True)
        model.train()
        t0, steps = time.time(), 0
        for steps in range(1, args.steps + 1):
            x, _ = next(own if own is not None and steps % 2 == 0 else data)
            loss, agree = distill_loss(model, x, args.hard_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            opt.step()
            sched.step()
            if steps % 25 == 0 or steps == 1:
                print(f"step {steps:4d}  loss {loss.item():.4f}  agreement {agree.item():.3f}  "
                      f"{time.time() - t0:6.1f} s", flush=True)
            if time.time() - t0 > args.minutes * 60:
                break
        train_time = time.time() - t0
        after = held_out_agreement(model, held_out)
        print(f"held-out distillation loss {after[0]:.4f}, top-1 agreement {after[1]:.3f}; "
              f"{train_time / 60:.1f} min", flush=True)
        model.eval().save_pretrained(args.model)
        record["parameters_mtp"] = sum(q.numel() for q in model.mtp.parameters())
        record["mtp"] = {
            "script": "examples/train_mtp.py", "steps": steps, "planned_steps": args.steps, "batch": args.batch,
            "length": args.length, "lr": args.lr, "weight_decay": args.weight_decay, "seed": args.seed,
            "objective": "distillation: MTP at p vs the frozen main model at p+1 (soft cross-entropy"
                         + (f", plus {args.hard_weight} x cross-entropy against its argmax)" if args.hard_weight else ")"),
            "hard_weight": args.hard_weight,
            "self_distill_sequences": args.self_distill,
            "continued": continued, "previous": record.get("mtp") if continued else None,
            "train_tokens": steps * args.batch * args.length,  # every other step the model's own text with --self-distill
            "held_out_distillation_loss_before": round(before[0], 4),
            "held_out_distillation_loss_after": round(after[0], 4),
            "held_out_top1_agreement_before": round(before[1], 4),
            "held_out_top1_agreement_after": round(after[1], 4),
            "train_minutes": round(train_time / 60, 1), "torch": torch.__version__, "threads": args.threads,
        }
        (args.model / "training.json").write_text(json.dumps(record, indent=2, ensure_ascii=False))
    acceptance = [measure_acceptance(args.model, held_text, args.prompts, args.new_tokens, n, t)
                  for n in (1, 2, 3) for t in (0.0, 0.7)]
    for row in acceptance:
        print(row, flush=True)
    record = json.loads((args.model / "training.json").read_text())
    record.setdefault("mtp", {})["acceptance_held_out"] = acceptance
    (args.model / "training.json").write_text(json.dumps(record, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
