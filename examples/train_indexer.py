"""Stage 5 of the embedded model: train the lightning indexer, then the model around it.

The CSA layers attend to the 8 compressed rows their indexer picks (top-k). The top-k passes no
gradient, so stages 1-4 never trained the indexer: it kept its initial weights and picked rows
that had nothing to do with what attention wanted. That is why nothing far back reached the
model (stage 4 could not copy a tool name 500 tokens back; Claude Code's request, behind a
3,500-token system message, was invisible). DeepSeek-V3.2 trains its indexer on its own loss:
the KL divergence from the main attention's distribution (heads summed) to the indexer's
softmax, with the indexer's inputs detached (`Indexer.distillation_loss`). Two phases:

1. ``--indexer-minutes``: only the indexers learn (everything else frozen), on the mix below;
2. ``--minutes``: the whole model learns its usual losses (assistant tokens, Shakespeare) with
   the indexers picking, plus the indexer loss, on rows of:

   * ``single``: one tool with a made-up name, 0 to `--max-filler` tokens of Shakespeare
     between the tools section and the request (``train_names.py``);
   * ``agent``: coding-agent chats with long system prompts and mostly made-up tool names;
   * ``trailing``: an agent chat whose request is followed by a system message of up to
     `--max-filler` tokens, as Claude Code sends its environment notes after the prompt;
   * ``four``: stage 2's four-tool chats, so the 60-request table keeps its calls;
   * Shakespeare rows, so the held-out loss stays.

Measured before, between and after: the indexer loss on held-out Shakespeare; held-out names'
tokens (teacher-forced) with 500 tokens of filler; greedy calls of the fitting tool behind a
3,000-token trailing system message (``train_long.agent_eval``); the held-out loss.

    python examples/train_indexer.py --base ds4_torch/assets/tiny-shakespeare --out /tmp/idx1 \\
        --indexer-minutes 10 --minutes 30
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_long import agent_eval, run_arguments, start_training  # noqa: E402
from train_names import chat, load_run, name_accuracy, name_probes, row_losses  # noqa: E402
from train_tiny import evaluate, optimizer  # noqa: E402

KINDS = ("single", "agent", "trailing", "four")


def indexers(model) -> list:
    return [layer.self_attn.compressor.indexer for layer in model.model.layers
            if layer.self_attn.compressor is not None and layer.self_attn.compressor.indexer is not None]


def collect_distillation(model, on: bool) -> list:
    """Start (or stop) collecting every CSA layer's indexer loss; returns the shared list."""
    losses: list = []
    for indexer in indexers(model):
        indexer.distillation_losses = losses if on else None
    return losses


@torch.no_grad()
def held_out_distillation(model, held_out: torch.Tensor, length: int = 2048, rows: int = 4) -> float:
    """The indexer loss on `rows` held-out Shakespeare windows of `length` tokens (lower: the
    indexer's picks follow attention more closely)."""
    was_training = model.training
    collecting = [indexer.distillation_losses for indexer in indexers(model)]  # a training loop's list
    model.eval()
    with torch.enable_grad():  # (the loss is collected only where gradients are on)
        losses = collect_distillation(model, True)
        total = 0.0
        for r in range(rows):
            start = r * (len(held_out) - length - 1) // max(rows - 1, 1)
            losses.clear()
            model(held_out[start:start + length][None])
            total += sum(loss.item() for loss in losses) / max(len(losses), 1)
    for indexer, previous in zip(indexers(model), collecting):
        indexer.distillation_losses = previous
    model.train(was_training)
    return total / rows


def chat_batch(tok, rng: random.Random, rows: int, length: int, mix, text: str, max_filler: int):
    """`rows` rows of `length` tokens packed with whole chats (a chat longer than a row is drawn
    again, up to 50 times: cut, its assistant turns would be lost, and at 2,048 tokens half the
    rows would teach nothing)."""
    xs, ys = [], []
    for _ in range(rows):
        ids, labels = [], []
        misses = 0
        while len(ids) < length + 1:
            i, lab = chat(tok, rng, rng.choices(KINDS, mix)[0], text, max_filler)
            if len(i) <= length or misses == 50:
                ids, labels, misses = ids + i, labels + lab, 0
            else:
                misses += 1
        xs.append(ids[:length])
        ys.append(labels[1:length + 1])
    return torch.tensor(xs), torch.tensor(ys)


def row_batch(tok, rng, args, train_chars: str, train_text: torch.Tensor, g: torch.Generator):
    x, y = chat_batch(tok, rng, args.chat_rows, args.length, args.mix, train_chars, args.max_filler)
    starts = torch.randint(0, len(train_text) - args.length - 1, (args.text_rows,), generator=g)
    piece = train_text[starts[:, None] + torch.arange(args.length + 1)]  # [text_rows, length + 1]
    return x, y, piece


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run_arguments(p, minutes=30.0, steps=1500, lr=5e-4, seed=23)
    p.add_argument("--indexer-minutes", type=float, default=10.0, help="phase 1: only the indexers learn")
    p.add_argument("--indexer-lr", type=float, default=2e-3)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--chat-rows", type=int, default=2)
    p.add_argument("--text-rows", type=int, default=1)
    p.add_argument("--mix", type=float, nargs=4, default=(0.3, 0.2, 0.3, 0.2), metavar=tuple(k.upper() for k in KINDS))
    p.add_argument("--max-filler", type=int, default=1800, help="most tokens between the tools (or request) and the reply")
    p.add_argument("--distill-weight", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=200)
    args = p.parse_args(argv)
    record, model, tok, (train_chars, held_chars), (train_text, held_out) = load_run(args)
    far = name_probes(tok, held_chars, 12, 500, seed=707)
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)

    def measure(phase: str, step: int, calls: bool = False) -> dict:
        out = {"phase": phase, "step": step, "held_out_distillation": round(held_out_distillation(model, held_out), 4),
               "name_accuracy_500": round(name_accuracy(model, far), 4)}
        if calls:
            ev = agent_eval(model, tok, cases=20, system_tokens=4000, split="train", trailing_tokens=3000)
            out["trailing_3000_right_tool"] = f"{ev['right_tool']}/{ev['call_cases']}"
            out["held_out_loss"] = round(evaluate(model.train(), held_out, 256), 4)
        model.train()
        print(json.dumps(out), flush=True)
        return out

    balance, _, _ = start_training(model, args)
    history = [measure("base", 0, calls=True)]

    # Phase 1: the indexers alone (skipped with --indexer-minutes 0, e.g. to continue its output).
    for name, param in model.named_parameters():
        param.requires_grad_(".indexer." in name)
    trainable = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.indexer_lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses = collect_distillation(model, True)
    t0 = time.time()
    step = 0
    while time.time() - t0 < args.indexer_minutes * 60:
        step += 1
        x, _, piece = row_batch(tok, rng, args, train_chars, train_text, g)
        losses.clear()
        model(x)
        if len(piece):
            model(piece[:, :-1])
        loss = sum(losses) / len(losses)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(f"indexer step {step:5d}  kl {loss.item():.4f}  {time.time() - t0:7.1f} s", flush=True)
    indexer_steps, indexer_time = step, time.time() - t0
    for param in model.parameters():
        param.requires_grad_(True)
    if step:
        history.append(measure("indexer", step, calls=True))
        save(args, model, record, history, indexer_steps, indexer_time, 0, 0.0)

    # Phase 2: everything, with the indexer loss beside the model's own.
    opt, sched = optimizer(model, args.lr, args.weight_decay, args.steps)
    balance.loads.clear()  # (phase 1's forwards counted loads the frozen routers do not act on)
    losses = collect_distillation(model, True)
    t0 = time.time()
    step = 0
    while time.time() - t0 < args.minutes * 60:
        step += 1
        x, y, piece = row_batch(tok, rng, args, train_chars, train_text, g)
        losses.clear()
        opt.zero_grad(set_to_none=True)
        chat_loss, text_loss = row_losses(model, x, y, piece)
        kl = sum(losses) / len(losses)
        (chat_loss + text_loss + args.distill_weight * kl).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        balance.step()
        if step % 10 == 0:
            print(f"step {step:5d}  chat {chat_loss.item():.4f}  text {text_loss.item():.4f}  kl {kl.item():.4f}  "
                  f"{time.time() - t0:7.1f} s", flush=True)
        if step % args.eval_every == 0:  # a run stopped early leaves a model and its record
            history.append({**measure("joint", step), "chat_loss": round(chat_loss.item(), 4),
                            "text_loss": round(text_loss.item(), 4), "seconds": round(time.time() - t0)})
            save(args, model, record, history, indexer_steps, indexer_time, step, time.time() - t0)
    minutes = (time.time() - t0) / 60
    collect_distillation(model, False)
    history.append(measure("joint", step, calls=True))
    run = save(args, model, record, history, indexer_steps, indexer_time, step, time.time() - t0)
    print(json.dumps({k: v for k, v in run.items() if k != "progress"}), flush=True)
    print(f"trained {indexer_steps} + {step} steps in {indexer_time / 60 + minutes:.1f} min", flush=True)


def save(args, model, record: dict, history: list, indexer_steps: int, indexer_time: float, step: int,
         train_time: float) -> dict:
    """The model and training.json (the base's record, this run appended to stage 5) in --out."""
    model.eval().save_pretrained(args.out)
    model.train()
    run = {"script": "examples/train_indexer.py", "base": str(args.base), "indexer_steps": indexer_steps,
           "indexer_minutes": round(indexer_time / 60, 1), "indexer_lr": args.indexer_lr, "steps": step,
           "schedule_steps": args.steps, "length": args.length, "chat_rows": args.chat_rows,
           "text_rows": args.text_rows, "mix": list(args.mix), "max_filler": args.max_filler, "lr": args.lr,
           "distill_weight": args.distill_weight, "weight_decay": args.weight_decay, "seed": args.seed,
           "train_minutes": round(train_time / 60, 1), "torch": torch.__version__, "threads": args.threads,
           "progress": history}
    out = {**record, "stage5": list(record.get("stage5", [])) + [run]}
    if "held_out_loss" in history[-1]:
        out["held_out_loss"] = history[-1]["held_out_loss"]
    (args.out / "training.json").write_text(json.dumps(out, indent=2, ensure_ascii=False))
    return run


if __name__ == "__main__":
    main()
