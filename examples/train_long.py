"""Stage 3 of the embedded model: long context (131,072 positions) and a coding agent's tools.

Continues a stage-2 model (``train_tools.py``'s output) on long sequences, 8K-64K tokens, fed
through the model's own compressed cache in chunks (as a prefill does), so CSA and HCA see
thousands of compressed rows. Gradients stop at chunk boundaries: a chunk attends to the cache
rows earlier chunks wrote, but does not train them (Transformer-XL style); the compressor and
indexer still learn from the rows each chunk writes itself. Each step is one sequence of:

* ``text``: a window of the Shakespeare training split (loss on every token), or
* ``agent``: packed documents (loss on assistant turns, and on Shakespeare passages): coding-
  agent chats from ``agent_corpus.py`` with long made-up system prompts and agent-style tool
  sets, the four-tool chats and drills of stage 2 (now always with a tools section, so the
  model never learns to call a tool nobody offered), and Shakespeare windows between them.

The config moves to ``max_position_embeddings`` 131,072 with the compressed layers' YaRN factor
raised to match (original 1024 x 128): their slow rotary pairs then barely turn over the whole
context, as DeepSeek-V4's do over 1M.

Evaluation (also alone, ``--eval-only``), written to ``training.json``:

* held-out Shakespeare read as one sequence (~49K tokens): loss by position bucket; the same
  tokens in 4K-token pieces (what the model gets without long context); and, with
  ``--rotations``, averaged over cyclic shifts of the text so that every bucket sees every part
  of the text once (the position effect alone: the raw buckets mostly measure which plays fall
  where);
* the long-range probe (``agent_corpus.long_range_probe``): a held-out tool name at the start,
  30K+ tokens of filler, the request at the end; does greedy decoding call that tool;
* held-out agent chats (held-out tool names, files and cities; long system prompts): is the
  first reply a call of the fitting offered tool, with the right argument;
* stage 2's measures: windowed held-out loss and the 60-request tool table.

    python examples/train_long.py --base ds4_torch/assets/tiny-shakespeare --out /tmp/long1 --minutes 60
    python examples/train_long.py --eval-only --out /tmp/long1
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ds4_torch import DS4ForCausalLM
from ds4_torch.chat_encoding import INVOKE_OPEN, render_prompt
from ds4_torch.decode import prefill
from ds4_torch.kernels import AttentionOps, reference

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent_corpus  # noqa: E402
import tool_corpus  # noqa: E402
from train_tiny import DEFAULT_DATA, ExpertBalancer, evaluate, optimizer  # noqa: E402
from train_tools import IGNORE, encode_chat, evaluate_all, shakespeare_splits  # noqa: E402

LONG_CONTEXT = 131072
BUCKETS = [(0, 4096), (4096, 16384), (16384, 49152)]


def long_config(config: dict, max_positions: int = LONG_CONTEXT) -> dict:
    """`config` with `max_positions` positions: the compressed layers' YaRN factor covers them."""
    config = json.loads(json.dumps(config))
    config["max_position_embeddings"] = max_positions
    compress = config["rope_parameters"]["compress"]
    compress["factor"] = max_positions / compress["original_max_position_embeddings"]
    return config


# --------------------------------------------------------------------------- sequences
def _drill_with_tools(rng: random.Random) -> dict:
    """A stage-2 drill, with the called tool offered (stage 2's drills offered none)."""
    conv = tool_corpus.drill(rng, novel=0.7, repeat=0.2, thinking=0.3, names="mixed")
    called = [c["function"]["name"] for m in conv["messages"] for c in m.get("tool_calls", [])]
    if not called:
        return conv
    return {**conv, "tools": [tool_corpus.tool_schema(n, with_description=False) for n in dict.fromkeys(called)]}


MIX = (0.55, 0.15, 0.15, 0.15)  # agent chats, four-tool chats, drills, Shakespeare passages


def agent_sequence(tok, rng: random.Random, length: int, train_text: torch.Tensor, mix=MIX,
                   rounds: tuple[int, int] = (1, 6), novel_tools: float = 0.3
                   ) -> tuple[list[int], list[int], list[bool]]:
    """One packed `length`-token agent sequence: token ids, labels (IGNORE where no loss) and
    whether each label is chat (True) or Shakespeare (False). `mix`: the shares of each kind of
    document; `rounds`: requests per agent chat; `novel_tools`: the chance that an agent chat's
    tool gets a made-up name."""
    ids: list[int] = []
    labels: list[int] = []
    chat: list[bool] = []
    edges = [sum(mix[:k + 1]) / sum(mix) for k in range(3)]
    while len(ids) < length + 1:
        room = length + 1 - len(ids)
        r = rng.random()
        if r < edges[0] and room > 2000:
            system = rng.randint(1000, max(1000, min(40000, room - 1500)))
            conv = agent_corpus.agent_conversation(rng, "train", system_tokens=system, tok=tok, rounds=rounds,
                                                   novel=novel_tools)
        elif r < edges[1]:
            conv = tool_corpus.conversation(rng, "train", rounds=(1, 3), novel=0.7, names="mixed")
        elif r < edges[2]:
            conv = _drill_with_tools(rng)
        else:
            n = rng.randint(256, 4096)
            start = rng.randrange(0, len(train_text) - n)
            piece = train_text[start:start + n].tolist()
            ids, labels, chat = ids + piece, labels + piece, chat + [False] * n
            continue
        i, lab = encode_chat(tok, conv)
        ids, labels, chat = ids + i, labels + lab, chat + [True] * len(i)
    return ids[:length + 1], labels[:length + 1], chat[:length + 1]


def text_sequence(rng: random.Random, length: int, train_text: torch.Tensor
                  ) -> tuple[list[int], list[int], list[bool]]:
    start = rng.randrange(0, len(train_text) - length - 1)
    piece = train_text[start:start + length + 1].tolist()
    return piece, list(piece), [False] * len(piece)


def train_sequence(model, ids: list[int], labels: list[int], chat: list[bool], chunk: int) -> dict:
    """Forward and backward one long sequence through the cache, `chunk` tokens at a time. The
    loss is the mean over chat (assistant) tokens plus the mean over Shakespeare tokens, so a
    few calls in a long sequence are not drowned by the text around them."""
    x = torch.tensor(ids[:-1])[None]
    y = torch.tensor(labels[1:])
    is_chat = torch.tensor(chat[1:]) & (y != IGNORE)
    is_text = ~torch.tensor(chat[1:]) & (y != IGNORE)
    n_chat, n_text = int(is_chat.sum()), int(is_text.sum())
    weights = is_chat.float() / max(n_chat, 1) + is_text.float() / max(n_text, 1)
    cache = model.new_cache(1, x.shape[1] + 8)
    sums = {"chat": 0.0, "text": 0.0}
    for a in range(0, x.shape[1], chunk):
        logits = model(x[:, a:a + chunk], cache=cache)
        ce = F.cross_entropy(logits[0], y[a:a + chunk].clamp(min=0), reduction="none")
        loss = (ce * weights[a:a + chunk]).sum()
        loss.backward()
        with torch.no_grad():
            sums["chat"] += (ce * is_chat[a:a + chunk]).sum().item()
            sums["text"] += (ce * is_text[a:a + chunk]).sum().item()
        for t in cache.tensors():  # the next chunk reads these rows but does not train them
            t.detach_()
    return {"chat_loss": sums["chat"] / max(n_chat, 1) if n_chat else None,
            "text_loss": sums["text"] / max(n_text, 1) if n_text else None, "chat_tokens": n_chat,
            "text_tokens": n_text}


# --------------------------------------------------------------------------- evaluation
@torch.no_grad()
def sequence_losses(model, ids: torch.Tensor, chunk: int = 1024, restart: int = 0) -> torch.Tensor:
    """Per-token next-token losses of `ids` [T] read as one sequence (or in pieces of `restart`)."""
    model.eval()
    out = []
    pieces = [ids] if not restart else [ids[s:s + restart + 1] for s in range(0, len(ids) - 1, restart)]
    for piece in pieces:
        cache = model.new_cache(1, len(piece) + 8)
        losses = []

        def on_chunk(done, logits):
            tgt = piece[done - logits.shape[1] + 1:done + 1]
            losses.append(F.cross_entropy(logits[0, :len(tgt)].float(), tgt, reduction="none"))
        prefill(model, cache, piece[None, :-1], chunk=chunk, on_chunk=on_chunk, full_logits=True)
        out.append(torch.cat(losses))
    return torch.cat(out)


def bucket_means(losses: torch.Tensor) -> list[float]:
    return [round(losses[a:b].mean().item(), 4) for a, b in BUCKETS if a < len(losses)]


def position_table(model, held_out: torch.Tensor, rotations: int = 0) -> dict:
    """Held-out loss by position bucket: read whole, in 4K pieces, and averaged over rotations."""
    whole = sequence_losses(model, held_out)
    pieces = sequence_losses(model, held_out, restart=4096)
    table = {"buckets": [list(b) for b in BUCKETS], "tokens": len(held_out),
             "one_sequence": bucket_means(whole), "in_4k_pieces": bucket_means(pieces),
             "one_sequence_mean": round(whole.mean().item(), 4)}
    if rotations:
        step = (len(held_out) // rotations)
        acc = torch.zeros(len(held_out) - 1)
        for k in range(rotations):
            rotated = torch.cat([held_out[k * step:], held_out[:k * step]])
            acc += sequence_losses(model, rotated)
        table["rotations"] = rotations
        table["rotated_mean"] = bucket_means(acc / rotations)
    return table


@torch.no_grad()
def greedy_reply(model, tok, prompt: str, max_new: int = 48, chunk: int = 2048) -> str:
    model.eval()
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
    cache = model.new_cache(1, ids.shape[1] + max_new + 8)
    logits = prefill(model, cache, ids, chunk=chunk)
    out = []
    eos = model.config.eos_token_ids
    for _ in range(max_new):
        t = int(logits.argmax(-1))
        if t in eos:
            break
        out.append(t)
        logits = model(torch.tensor([[t]]), cache=cache)[:, -1]
    return tok.decode(out, skip_special_tokens=False)


CALL_NAME = re.compile(re.escape(INVOKE_OPEN) + r' name="([^"]*)">')


def called_names(reply: str) -> list[str]:
    return CALL_NAME.findall(reply)


def long_range_probes(model, tok, held_out_text: str, cases: int = 20, filler_tokens: int = 30000,
                      seed: int = 2026) -> dict:
    """The issue's probe: how often greedy decoding calls the offered (held-out) tool."""
    rng = random.Random(seed)
    enc = tok.encode(held_out_text, add_special_tokens=False)
    rows = []
    for i in range(cases):
        start = rng.randrange(0, len(enc.ids) - filler_tokens - 1)
        filler = held_out_text[enc.offsets[start][0]:enc.offsets[start + filler_tokens][0]]
        conv, name = agent_corpus.long_range_probe(rng, filler)
        prompt = render_prompt(conv["messages"], tools=conv["tools"], thinking=False)
        reply = greedy_reply(model, tok, prompt)
        names = called_names(reply)
        rows.append({"tool": name, "called": names[:1], "ok": names[:1] == [name],
                     "prompt_tokens": len(tok.encode(prompt, add_special_tokens=False).ids)})
        print(f"  probe {i}: {name!r} -> {names[:1]} ({rows[-1]['prompt_tokens']} tokens)", flush=True)
    return {"cases": cases, "filler_tokens": filler_tokens, "called_offered": sum(r["ok"] for r in rows),
            "rows": rows}


def agent_eval(model, tok, cases: int = 30, system_tokens: int = 8000, seed: int = 31337,
               split: str = "held_out", trailing_tokens: int = 0) -> dict:
    """Agent chats (held-out tool names, files and cities; or, with split="train", the names
    training uses): the first reply calls the fitting offered tool, with the right arguments.
    `trailing_tokens`: a system message that long follows the request (Claude Code's shape)."""
    rng = random.Random(seed)
    right_tool = exact = no_tool_ok = no_tool_cases = 0
    trailing = {"trailing": 1.0, "trailing_tokens": (trailing_tokens, trailing_tokens)} if trailing_tokens else {}
    for _ in range(cases):
        conv = agent_corpus.agent_conversation(rng, split, system_tokens=system_tokens, tok=tok, rounds=1,
                                               thinking=0.0, filler_rounds=0.0, novel=0.0, **trailing)
        n_first = next(i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant")
        expected = conv["messages"][n_first]
        calls = expected.get("tool_calls") or []
        user_turn = conv["messages"][:n_first]
        reply = greedy_reply(model, tok, render_prompt(user_turn, tools=conv["tools"], thinking=False), max_new=64)
        names = called_names(reply)
        if not calls:
            no_tool_cases += 1
            no_tool_ok += not names
            continue
        want = calls[0]["function"]
        if names[:1] == [want["name"]]:
            right_tool += 1
            args = json.loads(want["arguments"])
            exact += all(f'name="{k}" string="true">{v}<' in reply for k, v in args.items())
    n_calls = cases - no_tool_cases
    return {"split": split, "cases": cases, "system_tokens": system_tokens, "trailing_tokens": trailing_tokens,
            "call_cases": n_calls, "right_tool": right_tool,
            "exact_arguments": exact, "no_tool_cases": no_tool_cases, "no_tool_ok": no_tool_ok}


def evaluate_long(model_dir: Path, data: Path, rotations: int, probes: int, quick: bool = False) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = DS4ForCausalLM.from_pretrained(model_dir)
    text = data.read_text(encoding="utf-8")
    held_text = text[int(len(text) * 0.9):]
    _, held_out = shakespeare_splits(tok, data)
    t0 = time.time()
    result = {"position_loss": position_table(model, held_out, rotations)}
    print(json.dumps(result["position_loss"]), f"{time.time() - t0:.0f} s", flush=True)
    result["agent_eval"] = [agent_eval(model, tok, cases=10 if quick else 20, split=split)
                            for split in ("held_out", "train")]
    print(json.dumps(result["agent_eval"]), flush=True)
    if probes:
        result["long_range_probe"] = long_range_probes(model, tok, held_text, cases=probes)
        print("long-range probe:", result["long_range_probe"]["called_offered"], "of", probes, flush=True)
    result["held_out_loss"] = round(evaluate(model.train(), held_out, 256), 4)
    if not quick:
        result["tool_eval"] = evaluate_all(model_dir, 60)
    result["eval_minutes"] = round((time.time() - t0) / 60, 1)
    return result


# --------------------------------------------------------------------------- main
def run_arguments(p: argparse.ArgumentParser, minutes: float, steps: int, lr: float, seed: int) -> None:
    """What every run continuing the embedded model takes: its base and output, the data, how
    long, the schedule, the optimiser, the seed and the threads."""
    p.add_argument("--base", type=Path, default=Path("ds4_torch/assets/tiny-shakespeare"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--minutes", type=float, default=minutes, help="train this long (then finish the step)")
    p.add_argument("--steps", type=int, default=steps, help="the learning-rate schedule's length")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--threads", type=int, default=1)


def start_training(model, args) -> tuple:
    """`model` in training mode on the differentiable reference ops: its expert balancer, and the
    optimiser and schedule `args` (run_arguments) ask for."""
    model.ops = AttentionOps("reference", reference.attention, reference.compress_rows, reference.indexer_topk)
    model.train()
    return (ExpertBalancer(model),) + optimizer(model, args.lr, args.weight_decay, args.steps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run_arguments(p, minutes=60.0, steps=400, lr=5e-4, seed=7)
    p.add_argument("--min-length", type=int, default=8192)
    p.add_argument("--max-length", type=int, default=32768)
    p.add_argument("--text-share", type=float, default=0.35, help="share of steps on plain Shakespeare")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--mix", type=float, nargs=4, default=MIX, metavar=("AGENT", "CHATS", "DRILLS", "TEXT"),
                   help="shares of the documents packed into agent sequences")
    p.add_argument("--rounds", type=int, nargs=2, default=(1, 6), metavar=("MIN", "MAX"),
                   help="requests per agent chat")
    p.add_argument("--novel-tools", type=float, default=0.3, help="chance of a made-up tool name in agent chats")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--rotations", type=int, default=0, help="evaluation: cyclic shifts of the held-out text")
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--stage", default="stage3", help="--eval-only: the training.json stage whose last run gets "
                                                     "the evaluation (stage5: train_indexer.py's)")
    p.add_argument("--quick-eval", action="store_true", help="skip the slow evaluations")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    if args.eval_only:
        result = evaluate_long(args.out, args.data, args.rotations, args.probes, args.quick_eval)
        record = json.loads((args.out / "training.json").read_text())
        record.setdefault(args.stage, [{}])[-1]["evaluation"] = result
        record["held_out_loss"] = result["held_out_loss"]  # the model's headline number (windowed, as stage 1)
        (args.out / "training.json").write_text(json.dumps(record, indent=2, ensure_ascii=False))
        print(json.dumps(result, indent=1))
        return

    from tokenizers import Tokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    record = json.loads((args.base / "training.json").read_text())
    config = json.loads((args.base / "config.json").read_text())
    if args.base.resolve() != args.out.resolve():
        (args.out / "tokenizer.json").write_bytes((args.base / "tokenizer.json").read_bytes())
    tok_config = json.loads((args.base / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = max(config["max_position_embeddings"], LONG_CONTEXT)
    (args.out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    model = DS4ForCausalLM.from_pretrained(args.base)
    if config["max_position_embeddings"] < LONG_CONTEXT:
        config = long_config(config)
        from ds4_torch.config import DS4Config
        state = model.state_dict()
        model = DS4ForCausalLM(DS4Config.from_dict(config))
        model.load_state_dict(state)
        model._init_buffers()
    tok = Tokenizer.from_file(str(args.base / "tokenizer.json"))
    train_text, held_out = shakespeare_splits(tok, args.data)
    balance, opt, sched = start_training(model, args)
    rng = random.Random(args.seed)
    t0 = time.time()
    step = 0
    tokens = {"text": 0, "agent": 0, "chat_labels": 0}
    history = []
    while time.time() - t0 < args.minutes * 60:
        step += 1
        length = int(math.exp(rng.uniform(math.log(args.min_length), math.log(args.max_length))))
        kind = "text" if rng.random() < args.text_share else "agent"
        ids, labels, chat = (text_sequence(rng, length, train_text) if kind == "text"
                             else agent_sequence(tok, rng, length, train_text, args.mix, tuple(args.rounds),
                                                            args.novel_tools))
        opt.zero_grad(set_to_none=True)
        out = train_sequence(model, ids, labels, chat, args.chunk)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        balance.step()
        tokens[kind] += length
        tokens["chat_labels"] += out["chat_tokens"]
        losses = {k: None if out[k] is None else round(out[k], 4) for k in ("chat_loss", "text_loss")}
        history.append({"step": step, "kind": kind, "length": length, **losses})
        print(f"step {step:4d} {kind:5s} {length:6d} tokens  chat loss {losses['chat_loss']}  "
              f"text loss {losses['text_loss']}  {time.time() - t0:7.1f} s", flush=True)
        if step % args.save_every == 0:  # a run stopped early leaves a model and its record
            model.eval().save_pretrained(args.out)
            save_record(args, record, step, time.time() - t0, tokens, history, config)
            model.train()
    model.eval().save_pretrained(args.out)
    save_record(args, record, step, time.time() - t0, tokens, history, config)
    print(f"trained {step} steps in {(time.time() - t0) / 60:.1f} min", flush=True)


def save_record(args, record: dict, step: int, train_time: float, tokens: dict, history: list, config: dict) -> None:
    """training.json: the base's record with this run appended to stage 3."""
    runs = list(record.get("stage3", []))
    runs.append({"script": "examples/train_long.py", "base": str(args.base), "steps": step,
                 "schedule_steps": args.steps, "min_length": args.min_length, "max_length": args.max_length,
                 "text_share": args.text_share, "chunk": args.chunk, "lr": args.lr,
                 "weight_decay": args.weight_decay, "seed": args.seed, "tokens": tokens,
                 "train_minutes": round(train_time / 60, 1), "torch": torch.__version__, "threads": args.threads,
                 "max_position_embeddings": config["max_position_embeddings"],
                 "mix": list(args.mix), "rounds": list(args.rounds), "novel_tools": args.novel_tools,
                 "losses": history})
    (args.out / "training.json").write_text(json.dumps({**record, "stage3": runs}, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
