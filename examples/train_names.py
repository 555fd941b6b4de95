"""Stage 4 of the embedded model: copy a tool's name from the tools section it is given.

After stage 3 the model called one of the four tools it was drilled on whatever the tools
section offered, even with no filler between the section and the request (0 of 8 made-up names
right): stages 2 and 3 taught copying only inside the 32-token sliding window (an argument from
the request), and the tools section is always further back. Here the name must come through the
compressed layers (CSA and HCA), so this stage trains exactly that, on short rows that are cheap
on a CPU (a 1,024-token row costs what a 128-token row cost stage 1 per token), batched:

* ``single``: one tool with a made-up name (``agent_corpus.single_tool_chat``), 0-3,000 tokens
  of Shakespeare between the tools section and the request, the call, its result and the answer;
* ``agent``: coding-agent chats (``agent_corpus.agent_conversation``) with mostly made-up names,
  several tools to choose from and system prompts of up to 2,000 tokens;
* ``four``: stage 2's four-tool chats, so the 60-request table keeps its calls;
* Shakespeare rows (loss on every token), so the held-out loss stays.

Chats are packed back to back in rows, so a row also holds earlier tools sections whose names
must not be copied. Loss: the mean over assistant tokens plus the mean over Shakespeare tokens.
Progress is measured on held-out names (``split="held_out"``, words training never shows):
teacher-forced accuracy on the name tokens, and greedy calls with 500 tokens of filler.

    python examples/train_names.py --base ds4_torch/assets/tiny-shakespeare --out /tmp/names1 --minutes 40
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ds4_torch import DS4ForCausalLM
from ds4_torch.chat_encoding import INVOKE_OPEN, render_prompt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent_corpus  # noqa: E402
import tool_corpus  # noqa: E402
from train_long import called_names, greedy_reply, run_arguments, start_training  # noqa: E402
from train_tiny import evaluate  # noqa: E402
from train_tools import IGNORE, encode_chat, shakespeare_splits  # noqa: E402

KINDS = ("single", "agent", "four")


def filler_text(rng: random.Random, text: str, tokens: int) -> str:
    """About `tokens` tokens of `text` (Shakespeare runs ~1.6 characters a token here)."""
    if tokens <= 0:
        return ""
    n = int(tokens * 1.6)
    start = rng.randrange(0, len(text) - n - 1)
    return text[start:start + n]


def chat(tok, rng: random.Random, kind: str, text: str, max_filler: int) -> tuple[list[int], list[int]]:
    if kind == "single":
        conv, _ = agent_corpus.single_tool_chat(rng, filler_text(rng, text, rng.choice([0, rng.randint(0, max_filler)])))
    elif kind == "trailing":  # Claude Code's shape: a long system message after the request
        conv = agent_corpus.agent_conversation(rng, "train", system_tokens=rng.randint(100, 2000), tok=tok, rounds=1,
                                               novel=0.5, thinking=0.2, trailing=1.0,
                                               trailing_tokens=(100, max(100, max_filler)))
    elif kind == "agent":
        system = rng.choice([0, rng.randint(100, max(100, max_filler))])
        conv = agent_corpus.agent_conversation(rng, "train", system_tokens=system, tok=tok, rounds=(1, 2),
                                               novel=0.8, thinking=0.2)
    else:
        conv = tool_corpus.conversation(rng, "train", rounds=(1, 3), novel=0.7, names="mixed")
    return encode_chat(tok, conv)


def chat_rows(tok, rng: random.Random, rows: int, length: int, mix: list[float], text: str, max_filler: int):
    """`rows` rows of `length` tokens packed with chats: inputs [rows, length], labels."""
    xs, ys = [], []
    for _ in range(rows):
        ids, labels = [], []
        while len(ids) < length + 1:
            i, lab = chat(tok, rng, rng.choices(KINDS, mix)[0], text, max_filler)
            ids, labels = ids + i, labels + lab
        xs.append(ids[:length])
        ys.append(labels[1:length + 1])
    return torch.tensor(xs), torch.tensor(ys)


def name_probes(tok, text: str, cases: int, filler: int, seed: int) -> list[tuple[str, str, list[int], list[bool]]]:
    """Held-out single-tool chats: (prompt, tool name, whole call ids, which ids are the name)."""
    rng = random.Random(seed)
    out = []
    for _ in range(cases):
        conv, name = agent_corpus.single_tool_chat(rng, filler_text(rng, text, filler), "held_out")
        prompt = render_prompt(conv["messages"][:1], tools=conv["tools"], thinking=False)
        head = tok.encode(prompt + INVOKE_OPEN + ' name="', add_special_tokens=False).ids
        whole = tok.encode(prompt + INVOKE_OPEN + f' name="{name}">', add_special_tokens=False).ids
        mask = [False] * (len(head) - 1) + [True] * (len(whole) - len(head))
        out.append((prompt, name, whole, mask))
    return out


@torch.no_grad()
def name_accuracy(model, probes) -> float:
    """Teacher-forced: the share of name tokens (and the closing quote) the model predicts."""
    model.eval()
    right = total = 0
    for _, _, ids, mask in probes:
        logits = model(torch.tensor([ids[:-1]]))[0]
        m = torch.tensor(mask[:len(ids) - 1])
        pred = logits.argmax(-1)
        tgt = torch.tensor(ids[1:])
        right += int((pred[m] == tgt[m]).sum())
        total += int(m.sum())
    model.train()
    return right / max(total, 1)


def greedy_calls(model, tok, probes) -> int:
    ok = sum(called_names(greedy_reply(model, tok, prompt, max_new=32))[:1] == [name] for prompt, name, _, _ in probes)
    model.train()
    return ok


def load_run(args):
    """What a run continuing the embedded model starts from (`run_arguments`' --base, --out,
    --data, --threads, --seed): its training record, the model, the tokenizer (copied to --out),
    Tiny Shakespeare's characters and tokens, each as (train, held-out)."""
    from tokenizers import Tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if args.base.resolve() != args.out.resolve():
            (args.out / name).write_bytes((args.base / name).read_bytes())
    record = json.loads((args.base / "training.json").read_text())
    model = DS4ForCausalLM.from_pretrained(args.base)
    tok = Tokenizer.from_file(str(args.base / "tokenizer.json"))
    full = args.data.read_text(encoding="utf-8")
    chars = full[:int(len(full) * 0.9)], full[int(len(full) * 0.9):]
    return record, model, tok, chars, shakespeare_splits(tok, args.data)


def row_losses(model, x, y, piece) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean loss over the chat rows' labelled (assistant) tokens, and over the Shakespeare
    rows `piece` (inputs and their next tokens; zero without any)."""
    chat_ce = F.cross_entropy(model(x).flatten(0, 1), y.flatten().clamp(min=0), reduction="none")
    labelled = (y.flatten() != IGNORE).float()
    chat_loss = (chat_ce * labelled).sum() / labelled.sum().clamp(min=1)
    text_loss = F.cross_entropy(model(piece[:, :-1]).flatten(0, 1), piece[:, 1:].flatten()) if len(piece) \
        else torch.zeros(())
    return chat_loss, text_loss


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run_arguments(p, minutes=40.0, steps=2000, lr=1e-3, seed=11)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--chat-rows", type=int, default=3)
    p.add_argument("--text-rows", type=int, default=1)
    p.add_argument("--mix", type=float, nargs=3, default=(0.5, 0.3, 0.2), metavar=tuple(k.upper() for k in KINDS))
    p.add_argument("--max-filler", type=int, default=3000, help="most tokens between the tools and the request")
    p.add_argument("--eval-every", type=int, default=100)
    args = p.parse_args(argv)
    record, model, tok, (train_chars, held_chars), (train_text, held_out) = load_run(args)
    balance, opt, sched = start_training(model, args)
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    near = name_probes(tok, held_chars, 24, 0, seed=606)
    far = name_probes(tok, held_chars, 12, 500, seed=707)

    def measure(step: int) -> dict:
        return {"step": step, "name_accuracy_near": round(name_accuracy(model, near), 4),
                "name_accuracy_500": round(name_accuracy(model, far), 4),
                "greedy_500": f"{greedy_calls(model, tok, far)}/{len(far)}"}

    history = [measure(0)]
    print(json.dumps(history[-1]), flush=True)
    t0 = time.time()
    step = 0
    while time.time() - t0 < args.minutes * 60:
        step += 1
        x, y = chat_rows(tok, rng, args.chat_rows, args.length, args.mix, train_chars, args.max_filler)
        starts = torch.randint(0, len(train_text) - args.length - 1, (args.text_rows,), generator=g)
        piece = train_text[starts[:, None] + torch.arange(args.length + 1)]  # [text_rows, length + 1]
        opt.zero_grad(set_to_none=True)
        chat_loss, text_loss = row_losses(model, x, y, piece)
        (chat_loss + text_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        balance.step()
        if step % 10 == 0:
            print(f"step {step:5d}  chat {chat_loss.item():.4f}  text {text_loss.item():.4f}  {time.time() - t0:7.1f} s",
                  flush=True)
        if step % args.eval_every == 0:
            history.append({**measure(step), "chat_loss": round(chat_loss.item(), 4),
                            "text_loss": round(text_loss.item(), 4), "seconds": round(time.time() - t0)})
            print(json.dumps(history[-1]), flush=True)
            model.eval().save_pretrained(args.out)
            model.train()
    minutes = (time.time() - t0) / 60
    history.append(measure(step))
    model.eval().save_pretrained(args.out)
    run = {"script": "examples/train_names.py", "base": str(args.base), "steps": step, "schedule_steps": args.steps,
           "length": args.length, "chat_rows": args.chat_rows, "text_rows": args.text_rows, "mix": list(args.mix),
           "max_filler": args.max_filler, "lr": args.lr, "weight_decay": args.weight_decay, "seed": args.seed,
           "train_minutes": round(minutes, 1), "torch": torch.__version__, "threads": args.threads,
           "held_out_loss": round(evaluate(model.train(), held_out, 256), 4), "progress": history}
    record["stage4"] = list(record.get("stage4", [])) + [run]
    (args.out / "training.json").write_text(json.dumps(record, indent=2, ensure_ascii=False))
    print(json.dumps({k: v for k, v in run.items() if k != "progress"}), flush=True)
    print(f"trained {step} steps in {minutes:.1f} min", flush=True)


if __name__ == "__main__":
    main()
