"""Teach the embedded tiny model DeepSeek-V4's agent protocol, keeping its Shakespeare.

Stage 2 after `train_tiny.py`. The shipped asset is stage 1 followed by five runs of this
script, reproducibly (same torch build):

    python examples/train_tiny.py --out /tmp/tiny-stage1
    python examples/train_tools.py --base /tmp/tiny-stage1 --out /tmp/tiny-run1 --steps 600 --tool-batch 2 \
        --rounds 1 3 --novel 0 --drill-rows 0 --text-batch 4 --lr 1.5e-3 --weight-decay 0.1
    python examples/train_tools.py --base /tmp/tiny-run1 --out /tmp/tiny-run2
    python examples/train_tools.py --base /tmp/tiny-run2 --out /tmp/tiny-run3 --repeat 0.4 --text-batch 8
    python examples/train_tools.py --base /tmp/tiny-run3 --out /tmp/tiny-run4 --steps 3000 --tool-every 4 \
        --drill-rows 16 --drill-length 128 --text-batch 2 --novel 0.7 --repeat 0.3 --lr 1.5e-3 \
        --weight-decay 0.1 --seed 99
    python examples/train_tools.py --base /tmp/tiny-run4 --out ds4_torch/assets/tiny-shakespeare --steps 2000 \
        --tool-every 4 --drill-rows 16 --drill-length 128 --text-batch 2 --novel 0.7 --repeat 0.3 \
        --drill-thinking 0.3 --names mixed --lr 1e-3 --weight-decay 0.1 --seed 100

The first run (tool chats only) taught the format, which tool to call and answering in text, but
no copying: every call named the same city. The next two add packed drills with made-up names;
the model then copies the first letter of a city it never saw, but not the rest. Runs 4 and 5
make drills the bulk of every step (16 short rows; a tool chat only every 4th step), which is
when copying appeared: the teacher-forced argument accuracy (`copy_accuracy`) rose from 0.29 to
0.78 and exact held-out arguments from 0 to 26 of 60. Run 5's made-up names mix random letters
and shuffled city names with the syllables, because after run 4 the model continued a name in
the syllables' style instead of copying it ("Detroit" -> "Denro"). See training.json for the
measurements and README "The default model".

What it does:

1. The tokenizer gets the protocol's markup as tokens of their own (non-special added tokens, so
   decoding keeps them, as DeepSeek's tokenizer keeps ``<think>``): the think tags, the DSML tags,
   the tool-result tags and the four attribute fragments every DSML call repeats. A call then
   costs ~20 tokens instead of ~50, which keeps the argument the model copies from the request
   inside its 32-token attention window. None of these strings occur in Shakespeare, whose token
   ids stay the same (checked). The Jinja chat template is dropped, so the tokenizer renders with
   the official encoding (``ds4_torch.chat_encoding``).
2. The embedding, the LM head and the hash-routing table grow by those rows: an embedding and an
   LM-head row start as the mean of the rows of the pieces the string used to split into.
3. Training continues from the base weights (a base that already has the tokens is continued
   as is) on batches of up to three kinds per step: tool chats from ``tool_corpus.py`` with
   several rounds each (loss on the assistant turns only); rows packed with drills
   (``tool_corpus.drill``: short chats without the tools section, which is ~550 tokens of every
   tool chat, so they are far cheaper; a request and its call, a whole round, or a repeat drill;
   half the names made up, so they cannot be memorised); and Shakespeare windows (as in stage 1).
   The drills also teach the model to call tools nobody offered it; the server returns such a
   call as text.
4. Evaluation: held-out Shakespeare loss (stage 1's split), and on held-out cities, symbols and
   phrasings: does greedy decoding call the right tool with exactly the requested argument, and,
   given the tool result, answer in text that carries the result. Written to training.json.

    python examples/train_tools.py --eval-only --out ds4_torch/assets/tiny-shakespeare
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
from ds4_torch.chat_encoding import (
    INVOKE_CLOSE, INVOKE_OPEN, PARAMETER_CLOSE, PARAMETER_OPEN, THINK_END, THINK_START, TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN, TOOL_RESULT_CLOSE, TOOL_RESULT_OPEN, render_prompt,
)
from ds4_torch.kernels import AttentionOps, reference

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tool_corpus  # noqa: E402
from train_tiny import DEFAULT_DATA, REPO, ExpertBalancer, batches, evaluate, optimizer  # noqa: E402

PROTOCOL_TOKENS = [
    THINK_START, THINK_END, TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE, INVOKE_OPEN, INVOKE_CLOSE, PARAMETER_OPEN,
    PARAMETER_CLOSE, TOOL_RESULT_OPEN, TOOL_RESULT_CLOSE,
    # attribute fragments of every call: ` name="get_weather">`, ` name="city" string="true">`
    ' name="', '" string="true">', '" string="false">', '">',
]
IGNORE = -100


# --------------------------------------------------------------------------- tokenizer and model
def extend_tokenizer(base: Path, out: Path):
    from tokenizers import AddedToken, Tokenizer

    old = Tokenizer.from_file(str(base / "tokenizer.json"))
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PROTOCOL_TOKENS])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((base / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template", None)  # render with the official DeepSeek-V4 encoding
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    return old, tok


@torch.no_grad()
def extend_model(model: DS4ForCausalLM, old_tok, tok, seed: int) -> DS4ForCausalLM:
    """The same model with rows for the new tokens (embedding, LM head, hash routing)."""
    old_n, new_n = model.config.vocab_size, tok.get_vocab_size()
    grown = DS4ForCausalLM(model.config.replace(vocab_size=new_n))
    state = model.state_dict()
    g = torch.Generator().manual_seed(seed)
    for name, value in list(state.items()):
        if value.shape[:1] != (old_n,):
            continue
        extra = []
        for token in PROTOCOL_TOKENS:
            pieces = old_tok.encode(token).ids
            if name.endswith("tid2eid"):
                extra.append(torch.randperm(model.config.n_routed_experts, generator=g)[:value.shape[1]])
            else:
                extra.append(value[pieces].float().mean(0).to(value.dtype))
        state[name] = torch.cat([value, torch.stack(extra)])
    grown.load_state_dict(state)
    grown._init_buffers()
    return grown


# --------------------------------------------------------------------------- tool chats
def encode_chat(tok, conv: dict) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and labels that train only its assistant turns."""
    msgs, tools, thinking = conv["messages"], conv["tools"], conv["thinking"]
    text = render_prompt(msgs, tools=tools, thinking=thinking, add_generation_prompt=False)
    spans = []
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start = len(render_prompt(msgs[:k], tools=tools, thinking=thinking))
        end = len(render_prompt(msgs[:k + 1], tools=tools, thinking=thinking, add_generation_prompt=False))
        # With tools nothing is dropped, so every earlier prompt is a prefix of the whole chat.
        assert text[:end].startswith(render_prompt(msgs[:k], tools=tools, thinking=thinking))
        spans.append((start, end))
    enc = tok.encode(text, add_special_tokens=False)
    labels = [tid if any(s <= a < e for s, e in spans) else IGNORE for tid, (a, _) in zip(enc.ids, enc.offsets)]
    return enc.ids, labels


def drill_batches(tok, rows: int, length: int, seed: int, novel: float, repeat: float, thinking: float = 0.0,
                  names: str = "syllables"):
    """Rows of `length` tokens packed with drills (``tool_corpus.drill``) back to back: several
    per row, so a row also holds other names to not copy from."""
    rng = random.Random(seed)
    while True:
        xs, ys = [], []
        for _ in range(rows):
            ids, labels = [], []
            while len(ids) < length + 1:
                i, lab = encode_chat(tok, tool_corpus.drill(rng, novel, repeat, thinking, names))
                ids, labels = ids + i, labels + lab
            xs.append(ids[:length])
            ys.append(labels[1:length + 1])
        yield torch.tensor(xs), torch.tensor(ys)


def tool_batches(tok, batch: int, seed: int | random.Random, pad_id: int, rounds: tuple[int, int] = (1, 3),
                 novel: float = 0.0, names: str = "syllables"):
    """Batches of whole tool chats (tools section, several rounds), padded. `seed` may be the
    random.Random to draw from (a resumable run keeps its state)."""
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    while True:
        rows = [encode_chat(tok, tool_corpus.conversation(rng, "train", rounds=rounds, novel=novel, names=names))
                for _ in range(batch)]
        width = max(len(ids) for ids, _ in rows)
        x = torch.full((batch, width), pad_id)
        y = torch.full((batch, width), IGNORE)
        for i, (ids, labels) in enumerate(rows):
            x[i, :len(ids)] = torch.tensor(ids)
            y[i, :len(ids) - 1] = torch.tensor(labels[1:])  # predict token t+1 at t
        yield x, y


# --------------------------------------------------------------------------- evaluation
def argument_probe(tok, cases: int = 48, seed: int = 12345) -> list[tuple[list[int], list[bool]]]:
    """Fixed single-call chats (tools section included) and, per token, whether it is part of a
    call's argument value: half with made-up names in training phrasings, half held-out."""
    value_starts = {tok.token_to_id('" string="true">'), tok.token_to_id('" string="false">')}
    value_end = tok.token_to_id(PARAMETER_CLOSE)
    rng = random.Random(seed)
    probes = []
    for i in range(cases):
        tool = list(tool_corpus.TOOLS)[i % len(tool_corpus.TOOLS)]
        split = "held_out" if i % 2 else "train"
        text, args, _, _ = tool_corpus.request(rng, tool, split, novel=1.0)
        call = {"id": "call_0", "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}
        conv = {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "", "tool_calls": [call]}],
                "tools": [tool_corpus.tool_schema(tool)], "thinking": False}
        ids, _ = encode_chat(tok, conv)
        inside, mask = False, []
        for t in ids:
            inside = inside and t != value_end
            mask.append(inside)
            inside = inside or t in value_starts
        probes.append((ids, mask))
    return probes


@torch.no_grad()
def copy_accuracy(model, probes) -> tuple[float, float]:
    """Teacher-forced: the share of argument tokens predicted exactly, and of calls whose
    argument tokens all are. A cheap running signal; `evaluate_tools` is the real measure."""
    was_training = model.training
    model.eval()
    right = total = whole = 0
    for ids, mask in probes:
        predicted = model(torch.tensor([ids[:-1]]))[0].argmax(-1).tolist()
        hits = [predicted[i] == ids[i + 1] for i in range(len(ids) - 1) if mask[i + 1]]
        right, total, whole = right + sum(hits), total + len(hits), whole + all(hits)
    model.train(was_training)
    return right / total, whole / len(probes)


def _greedy(model, tokenizer, prompt: str, max_new: int) -> str:
    from ds4_torch.generation import generate

    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = list(generate(model, ids, max_new, eos_token_id=tokenizer.eos_token_id))
    return tokenizer.decode(out, skip_special_tokens=False)


METRICS = ("cases", "valid_call", "right_tool", "first_letter_ok", "call_ok", "text_answer", "answer_ok")


def evaluate_tools(model_dir: Path, cases: int, split: str = "held_out", seed: int = 777, thinking: bool = False) -> dict:
    """Per tool, how often greedy decoding
    - valid_call: emits exactly one DSML call that parses, names an offered tool and fits its
      schema, and ends the turn;  right_tool: ... to the tool the request is for;
    - first_letter_ok: ... whose arguments start like the requested ones (string arguments: the
      first character; numbers: equal);  call_ok: ... with exactly the requested arguments;
    - text_answer: given the right call's result, answers in text, without a call;
      answer_ok: ... and the text contains the result's values (the city and symbol aside).
    """
    from ds4_torch.output_parser import parse_output
    from ds4_torch.tokenizer import load_tokenizer

    torch.manual_seed(0)
    model = DS4ForCausalLM.from_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    rng = random.Random(seed)
    names = list(tool_corpus.TOOLS)
    report: dict = {}
    for i in range(cases):
        tool = "get_weather" if i % 2 == 0 else names[1 + (i // 2) % 3]  # half the cases: the weather
        offered = rng.sample(names, rng.randint(1, len(names)))
        if tool not in offered:
            offered[rng.randrange(len(offered))] = tool
        tools = [tool_corpus.tool_schema(n) for n in offered]
        text, args, result, _ = tool_corpus.request(rng, tool, split)
        msgs = [{"role": "user", "content": text}]
        out = parse_output(_greedy(model, tokenizer, render_prompt(msgs, tools=tools, thinking=thinking), 80),
                           thinking=thinking, tools=tools)
        valid = len(out.tool_calls) == 1 and out.ended and not out.tool_calls[0].problems
        got = json.loads(out.tool_calls[0].arguments) if valid else None
        right = valid and out.tool_calls[0].name == tool
        prefix = right and got.keys() == args.keys() and all(
            str(got[k])[:1] == str(v)[:1] if isinstance(v, str) else got[k] == v for k, v in args.items())
        call = {"id": "call_0", "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}
        msgs += [{"role": "assistant", "content": "", "tool_calls": [call],
                  **({"reasoning_content": tool_corpus.REASONING_CALL.format(subject="it", tool=tool)} if thinking else {})},
                 {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(result)}]
        reply = parse_output(_greedy(model, tokenizer, render_prompt(msgs, tools=tools, thinking=thinking), 80),
                             thinking=thinking, tools=tools)
        values = [str(v) for k, v in result.items() if k not in ("city", "symbol")]
        texted = not reply.tool_calls and reply.ended and bool(reply.content.strip())
        outcome = {"cases": 1, "valid_call": valid, "right_tool": right, "first_letter_ok": prefix,
                   "call_ok": right and got == args, "text_answer": texted,
                   "answer_ok": texted and all(v in reply.content for v in values)}
        r = report.setdefault(tool, dict.fromkeys(METRICS, 0))
        for k in METRICS:
            r[k] += int(outcome[k])
        print(f"{split} {tool:15s} {text!r:55s} call={out.tool_calls[0].name if out.tool_calls else None}"
              f"({json.dumps(got)}) {'ok' if outcome['call_ok'] else 'BAD'}  answer={reply.content!r} "
              f"{'ok' if outcome['answer_ok'] else 'BAD'}", flush=True)
    total = {k: sum(r[k] for r in report.values()) for k in METRICS}
    return {"split": split, "thinking": thinking, "per_tool": report, "total": total}


def evaluate_all(model_dir: Path, cases: int) -> list[dict]:
    """Held-out cities, symbols and phrasings in chat and thinking mode; the training split for comparison."""
    return [evaluate_tools(model_dir, cases, "held_out"),
            evaluate_tools(model_dir, cases // 3, "held_out", seed=778, thinking=True),
            evaluate_tools(model_dir, cases // 3, "train", seed=779)]


def shakespeare_splits(tok, data: Path):
    text = data.read_text(encoding="utf-8")
    split = int(len(text) * 0.9)  # train_tiny.py's split
    return torch.tensor(tok.encode(text[:split]).ids), torch.tensor(tok.encode(text[split:]).ids)


# --------------------------------------------------------------------------- main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, default=REPO / "ds4_torch" / "assets" / "tiny-shakespeare",
                   help="the stage-1 model directory (train_tiny.py's output)")
    p.add_argument("--out", type=Path, default=REPO / "ds4_torch" / "assets" / "tiny-shakespeare")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--tool-batch", type=int, default=1)
    p.add_argument("--tool-every", type=int, default=1, help="a batch of tool chats every this many steps")
    p.add_argument("--rounds", type=int, nargs=2, default=(2, 4), metavar=("MIN", "MAX"),
                   help="rounds (request, call, result, answer) per tool chat")
    p.add_argument("--novel", type=float, default=0.5, help="chance of a made-up city or symbol in a request")
    p.add_argument("--names", choices=tool_corpus.NAME_STYLES, default="syllables",
                   help="made-up names: tool_corpus.novel_name's style")
    p.add_argument("--drill-thinking", type=float, default=0.0, help="share of drills in thinking mode")
    p.add_argument("--drill-rows", type=int, default=6, help="rows of packed drills per step")
    p.add_argument("--drill-length", type=int, default=512)
    p.add_argument("--repeat", type=float, default=0.25, help="share of repeat drills among the drills")
    p.add_argument("--text-batch", type=int, default=4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-cases", type=int, default=60)
    p.add_argument("--probe-every", type=int, default=100, help="print copy_accuracy every this many steps")
    p.add_argument("--eval-only", action="store_true", help="only measure the model in --out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    if args.eval_only:  # measure again; the record of the run that made the model gets the result
        evals = evaluate_all(args.out, args.eval_cases)
        print(json.dumps([e["total"] for e in evals]))
        record = json.loads((args.out / "training.json").read_text())
        record["stage2"][-1]["tool_eval"] = evals
        (args.out / "training.json").write_text(json.dumps(record, indent=2, ensure_ascii=False))
        return

    base_record = json.loads((args.base / "training.json").read_text())
    runs = base_record.get("stage2", [])
    runs = runs if isinstance(runs, list) else [runs]
    base_record = base_record.get("stage1", base_record)
    from tokenizers import Tokenizer

    base_model = DS4ForCausalLM.from_pretrained(args.base)
    base_tok = Tokenizer.from_file(str(args.base / "tokenizer.json"))
    train_old, held_old = shakespeare_splits(base_tok, args.data)
    held_loss_before = evaluate(base_model.train(), held_old, 256)
    print(f"base held-out Shakespeare loss {held_loss_before:.4f}", flush=True)

    if all(base_tok.token_to_id(t) is not None for t in PROTOCOL_TOKENS):  # a stage-2 base: continue it
        args.out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if args.base.resolve() != args.out.resolve():
                (args.out / name).write_bytes((args.base / name).read_bytes())
        old_tok = tok = base_tok
        model = base_model
    else:
        old_tok, tok = extend_tokenizer(args.base, args.out)
        model = extend_model(base_model, old_tok, tok, args.seed)
    del base_model
    train, held_out = shakespeare_splits(tok, args.data)
    assert torch.equal(train, train_old) and torch.equal(held_out, held_old), "Shakespeare must tokenize as before"
    model.ops = AttentionOps("reference", reference.attention, reference.compress_rows, reference.indexer_topk)
    cfg = model.config
    print(f"vocabulary {old_tok.get_vocab_size()} -> {tok.get_vocab_size()}; {model.num_parameters():,} parameters")

    balance = ExpertBalancer(model)
    opt, sched = optimizer(model, args.lr, args.weight_decay, args.steps)
    text_data = batches(train, args.text_batch, args.length, torch.Generator().manual_seed(args.seed))
    tool_data = tool_batches(tok, args.tool_batch, args.seed, cfg.eos_token_ids[0], tuple(args.rounds), args.novel,
                             args.names)
    drill_data = drill_batches(tok, args.drill_rows, args.drill_length, args.seed + 1, args.novel, args.repeat,
                                args.drill_thinking, args.names) \
        if args.drill_rows else None
    probes = argument_probe(tok)
    copy_before = copy_accuracy(model, probes)
    print(f"copy accuracy (tokens, calls) {copy_before[0]:.3f} {copy_before[1]:.3f}", flush=True)
    model.train()
    t0 = time.time()
    tool_tokens = drill_tokens = 0
    tool_loss = torch.zeros(())
    for step in range(1, args.steps + 1):
        loss = 0.0
        if step % args.tool_every == 0:
            tx, ty = next(tool_data)
            loss = tool_loss = F.cross_entropy(model(tx).flatten(0, 1), ty.flatten(), ignore_index=IGNORE)
            tool_tokens += tx.numel()
        sx, sy = next(text_data)
        text_loss = F.cross_entropy(model(sx).flatten(0, 1), sy.flatten())
        loss = loss + text_loss
        if drill_data is not None:
            dx, dy = next(drill_data)
            drill_loss = F.cross_entropy(model(dx).flatten(0, 1), dy.flatten(), ignore_index=IGNORE)
            drill_tokens += dx.numel()
            loss = loss + drill_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        balance.step()
        if step % 25 == 0 or step == 1:
            print(f"step {step:5d}  tool loss {tool_loss.item():.3f}  "
                  f"drill loss {drill_loss.item() if drill_data is not None else 0:.3f}  text loss {text_loss.item():.3f}  "
                  f"{time.time() - t0:7.1f} s", flush=True)
        if args.probe_every and step % args.probe_every == 0:
            print("copy accuracy (tokens, calls) {:.3f} {:.3f}".format(*copy_accuracy(model, probes)), flush=True)
    train_time = time.time() - t0
    held_loss = evaluate(model, held_out, 256)
    copy_after = copy_accuracy(model, probes)
    print(f"held-out Shakespeare loss {held_loss_before:.4f} -> {held_loss:.4f}; {train_time / 60:.1f} min", flush=True)
    model.eval().save_pretrained(args.out)

    t1 = time.time()
    evals = evaluate_all(args.out, args.eval_cases)
    print(json.dumps(evals, indent=1), f"(evaluated in {(time.time() - t1) / 60:.1f} min)")
    (args.out / "training.json").write_text(json.dumps({
        "parameters": model.num_parameters(), "held_out_loss": round(held_loss, 4),
        "stage1": base_record,
        "stage2": runs + [{
            "script": "examples/train_tools.py", "steps": args.steps, "tool_batch": args.tool_batch,
            "tool_every": args.tool_every,
            "rounds": list(args.rounds), "novel": args.novel, "names": args.names,
            "drill_thinking": args.drill_thinking, "drill_rows": args.drill_rows,
            "drill_length": args.drill_length, "repeat": args.repeat, "weight_decay": args.weight_decay,
            "text_batch": args.text_batch, "length": args.length, "lr": args.lr, "seed": args.seed,
            "tool_chat_tokens": tool_tokens, "drill_tokens": drill_tokens,
            "text_tokens": args.steps * args.text_batch * args.length,
            "vocab_size": cfg.vocab_size, "added_tokens": PROTOCOL_TOKENS,
            "held_out_loss_before": round(held_loss_before, 4), "held_out_loss_after": round(held_loss, 4),
            "copy_accuracy_before": [round(v, 4) for v in copy_before],
            "copy_accuracy_after": [round(v, 4) for v in copy_after],
            "train_minutes": round(train_time / 60, 1), "torch": torch.__version__, "threads": args.threads,
            "tool_eval": evals,
        }],
    }, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
