"""Stage 4 of the embedded model: answer plain chat with text, keep the agent protocol.

After stage 3 (``train_long.py``) the model answered most plain chat turns (no tools offered) by
opening a ``get_weather`` call with an invented city: stage 2's drills had no tools section, so it
learned to call tools nobody offered, and nothing ever showed it a plain chat answered in text.
The server drops a call to a tool that was not offered, which left most replies empty.

This run continues the shipped weights on a mix, every step:

* plain chats (``plain_chat``): no tools section, ever; an optional system message; the user says
  something plain (a greeting, a question, a request, a line of verse from the training split);
  the assistant answers with a Shakespeare passage from the training split and ends its turn. A
  share in thinking mode (reasoning "No tool is needed here.", as stage 2's small talk);
* the four-tool chats of stage 2 and its drills, now always with the called tools offered
  (``train_long._drill_with_tools``), so a tools section still means "call the fitting tool";
* a coding-agent chat (``agent_corpus``) with a system prompt of up to a few thousand tokens;
* Shakespeare windows (loss on every token);
* every ``--long-every`` steps, one long packed sequence (``train_long.agent_sequence`` or
  plain text) through the model's cache, so the 131,072-token context is kept.

Evaluation (``--eval-only``, also before and after training), written to training.json:

* 40 plain prompts, none of them a training prompt (``EVAL_PROMPTS``), through the real server
  in-process (OpenAI chat completions, no tools), greedy and at temperature 0.8: replies with
  visible text, replies with tool calls; the same with the call opener banned (``logit_bias``
  -100, what a server-side mask does); and the model's raw output (``generate``, no server):
  how many replies open a call;
* "What is the weather in CITY?" for 10 cities with get_weather offered: calls to it;
* held-out Shakespeare (the last 10%): the mean loss of its first three 2,048-token segments,
  each read from position 0, and of the same 6,144 tokens after 36,864 tokens of other text
  (the training split) in one sequence.

The shipped model (training.json, ``stage4``, ``stage4_decision`` and ``mtp``) is stage 3 followed
by two runs of this script, then ``train_mtp.py`` on the final weights:

    python examples/train_chat.py --out /tmp/chat1 --steps 320 --minutes 48 --lr 5e-4 --seed 41
    python examples/train_chat.py --base /tmp/chat1 --out /tmp/chat2 --steps 12 --minutes 14 --lr 3e-4 \
        --seed 42 --chat-rows 2 --tool-every 3 --agent-every 1000 --text-rows 1 --long-every 1 \
        --long-length 24576 45056
    python examples/train_chat.py --eval-only --out /tmp/chat2

The first run taught plain chat (39 of 40 held-out prompts answered with text) but lost long
context (held-out text after 36K tokens of other text: 3.154 -> 3.311); the second, every step
one 24K-44K-token sequence, won back little of it (3.284), and exact arguments of held-out calls
fell (31 -> 15 of 60). It ships anyway: a plain chat answered in prose outweighed both.

``--resume FILE`` keeps a run resumable across sessions: every ``--save-every`` steps and at the
end the weights, the optimiser and schedule, the data's random states and the losses so far go to
FILE (outside the package), and the same command run again continues from there, with the same
losses as a run that never stopped; ``--minutes`` is then each session's budget.
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
from ds4_torch.chat_encoding import TOOL_CALLS_OPEN

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent_corpus  # noqa: E402
import tool_corpus  # noqa: E402
from train_long import (  # noqa: E402
    _drill_with_tools, agent_sequence, run_arguments, sequence_losses, start_training, text_sequence, train_sequence,
)
from train_tiny import batches  # noqa: E402
from train_tools import IGNORE, encode_chat, shakespeare_splits, tool_batches  # noqa: E402

# --------------------------------------------------------------------------- evaluation prompts
# Held out: none is ever a training prompt (`plain_prompt` refuses them). The verse lines are
# from the held-out last 10% of Tiny Shakespeare.
EVAL_PROMPTS = [
    "Hello", "Hello!", "What news?", "Good morrow, sir.", "Tell me of the king.", "How are you?",
    "Who are you?", "What is your name?", "Speak to me of love.", "Good night, sweet friend.",
    "Where have you been all this while?", "I am weary of this world.", "What say you to a cup of wine?",
    "Is the queen well?", "Why dost thou weep?", "Sing me a song.", "Tell me a story.", "Can you help me?",
    "Thanks!", "What do you think of Rome?", "My lord, the army is at the gate.", "Wherefore art thou sad?",
    "Write a poem about the sea.", "Say something.", "Do you love me?", "Farewell.",
    "What is the meaning of honour?", "hi", "Who was the greatest king of England?", "Give me your counsel.",
    "Ay, but not frighted me; therefore I'll sleep again.", "Hark, hark! I hear the minstrels play.",
    "I'll find about the making of the bed;", "Now in the waist, the deck, in every cabin,",
    "Good, yet remember whom thou hast aboard.", "And do my spiriting gently.",
    "He receives comfort like cold porridge.", "And the moon changes even as your mind.",
    "Explain yourself.", "What is the weather like today?",
]
assert len(EVAL_PROMPTS) == 40 and len(set(EVAL_PROMPTS)) == 40
EVAL_CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Cairo", "Sydney", "Toronto", "Mumbai", "Lima"]
WEATHER_TOOL = {"type": "function", "function": tool_corpus.WEATHER}

# --------------------------------------------------------------------------- plain chats
GREETINGS = ["Hi", "Hey", "Hello there", "Good day", "Good morrow", "Good even", "Good evening", "Hail", "Well met",
             "Greetings", "Good morning", "Good afternoon", "God save you", "Welcome"]
TITLES = ["", "", ", sir", ", my lord", ", madam", ", friend", ", good sir", ", my liege", ", cousin", ", gentle lady"]
SUBJECTS = ["love", "war", "the queen", "the duke", "honour", "death", "the crown", "the night", "the morning",
            "fortune", "England", "France", "Verona", "Padua", "the sword", "mercy", "justice", "the court",
            "my father", "your mother", "the prince", "the people", "the senate", "the battle", "sleep", "music",
            "the spring", "the winter", "the stars", "gold", "a kingdom", "this city", "your master", "the moon"]
QUESTION_FORMS = ["Tell me about {s}.", "What say you of {s}?", "Speak of {s}.", "What think you of {s}?",
                  "What news of {s}?", "Say something about {s}.", "Write a verse about {s}.", "What is {s}?",
                  "Have you heard of {s}?", "Talk to me about {s}.", "I would hear of {s}.", "What of {s}?",
                  "Describe {s}.", "Do you know {s}?", "Give me a poem about {s}."]
NAME_FORMS = ["Who is {n}?", "Where is {n}?", "How fares {n}?", "What of {n}?", "Have you seen {n}?",
              "Tell me about {n}.", "Is {n} here?", "What does {n} say?"]
REQUESTS = ["Please help me.", "Can you answer a question?", "What can you do?", "Talk to me.",
            "I need your advice.", "Say a few words.", "Entertain me.", "Recite something.", "Answer me.",
            "Are you there?", "What time of day is it?", "How is the weather?", "What should I do?",
            "Tell me a joke.", "Make me laugh.", "Comfort me.", "Why?", "Go on.", "Continue.", "And then?",
            "Thank you.", "Thanks.", "Goodbye.", "Adieu.", "I am sad.", "I am happy today.", "Who made you?",
            "Are you a person?", "What are you?", "What is your purpose?"]
SYSTEMS = ["You are a helpful assistant.", "You are a player in Shakespeare's company.", "Answer briefly.",
           "You are a chatbot.", "Speak as the Bard would.", "You are an assistant. Be kind.",
           "You are DS4, a small model trained on Shakespeare."]
REASONING_TALK = tool_corpus.REASONING_TALK


class ShakespeareLines:
    """Lines and speaker names of the training split, for prompts and replies."""

    def __init__(self, train_text: str):
        lines = train_text.split("\n")
        self.speech_lines = [i for i, line in enumerate(lines) if line and not line.endswith(":")]
        self.lines = lines
        self.names = sorted({line[:-1].title() for line in lines if line.endswith(":") and 2 < len(line) < 24})

    def verse(self, rng: random.Random, n: int) -> str:
        i = rng.choice(self.speech_lines)
        out = []
        for line in self.lines[i:i + n]:
            if not line or line.endswith(":"):  # a speech ends at the blank line before the next speaker
                break
            out.append(line)
        return "\n".join(out)


def plain_prompt(rng: random.Random, lines: ShakespeareLines) -> str:
    while True:
        r = rng.random()
        if r < 0.2:
            text = rng.choice(GREETINGS) + rng.choice(TITLES) + rng.choice(["!", ".", ""])
        elif r < 0.45:
            text = rng.choice(QUESTION_FORMS).format(s=rng.choice(SUBJECTS))
        elif r < 0.55:
            text = rng.choice(NAME_FORMS).format(n=rng.choice(lines.names))
        elif r < 0.75:
            text = rng.choice(REQUESTS)
        else:
            text = lines.verse(rng, rng.randint(1, 2))
        if rng.random() < 0.1:
            text = text.lower()
        if text.strip() and text not in EVAL_PROMPTS:
            return text


def plain_chat(rng: random.Random, lines: ShakespeareLines, thinking: float = 0.2) -> dict:
    """A chat with no tools section: one to three plain turns answered with Shakespeare."""
    think = rng.random() < thinking
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    for _ in range(1 if think else rng.choice([1, 1, 1, 2, 3])):  # (thinking drops earlier reasoning: one turn)
        messages.append({"role": "user", "content": plain_prompt(rng, lines)})
        reply = {"role": "assistant", "content": lines.verse(rng, rng.randint(1, 4))}
        if think:
            reply["reasoning_content"] = REASONING_TALK
        messages.append(reply)
    return {"messages": messages, "tools": [], "thinking": think}


def packed_rows(tok, make, rows: int, length: int):
    """`rows` rows of `length` tokens packed with the chats `make()` returns: (x, y)."""
    xs, ys = [], []
    for _ in range(rows):
        ids, labels = [], []
        while len(ids) < length + 1:
            i, lab = encode_chat(tok, make())
            ids, labels = ids + i, labels + lab
        xs.append(ids[:length])
        ys.append(labels[1:length + 1])
    return torch.tensor(xs), torch.tensor(ys)


# --------------------------------------------------------------------------- evaluation
def _ask(client, messages, n: int, **kw) -> list:
    return [client.chat.completions.create(model="ds4-default", messages=messages, max_tokens=64, **kw)
            .choices[0].message for _ in range(n)]


def chat_eval(model_dir: Path, quick: bool = False) -> dict:
    """The plain-prompt and weather tables through the real server, and the model's raw output."""
    import openai
    from serve.http.app import ServerConfig, create_app
    from serve.background import BackgroundServer

    from ds4_torch.generation import generate
    from ds4_torch.tokenizer import load_tokenizer

    model = DS4ForCausalLM.from_pretrained(model_dir, progress=False)
    tok = load_tokenizer(model_dir)
    opener, = tok.encode(TOOL_CALLS_OPEN, add_special_tokens=False)  # one token of its own (train_tools.py)
    prompts = EVAL_PROMPTS[::4] if quick else EVAL_PROMPTS
    result: dict = {"prompts": len(prompts)}
    samples: dict = {}
    for temperature in (0.0, 0.8):  # the model alone, no server: does the reply open a call
        opened = empty_before = 0
        for i, p in enumerate(prompts):
            ids = tok.encode_chat([{"role": "user", "content": p}])
            out = list(generate(model, ids, 64, temperature=temperature, seed=i, eos_token_id=tok.eos_token_id))
            if opener in out:
                opened += 1
                empty_before += not tok.decode(out[:out.index(opener)]).strip()
        result[f"raw_T{temperature}"] = {"opens_call": opened, "opens_call_with_no_text_before": empty_before}
    app = create_app(model, tok, ServerConfig(ctx=2048, prefill_chunk=256))
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for name, extra in (("server", {}), ("server_opener_banned", {"logit_bias": {str(opener): -100}}),
                            ("server_opener_pushed", {"logit_bias": {str(opener): 100}})):
            for temperature in (0.0, 0.8):
                texted = called = 0
                for i, p in enumerate(prompts):
                    m = _ask(client, [{"role": "user", "content": p}], 1, temperature=temperature, seed=i, **extra)[0]
                    texted += bool((m.content or "").strip())
                    called += bool(m.tool_calls)
                    if name == "server" and i < 12:
                        samples.setdefault(f"T{temperature}", []).append([p, m.content])
                result[f"{name}_T{temperature}"] = {"visible_text": texted, "tool_calls": called}
                print(name, temperature, result[f"{name}_T{temperature}"], flush=True)
        weather = 0
        for city in EVAL_CITIES:
            m = _ask(client, [{"role": "user", "content": f"What is the weather in {city}?"}], 1, temperature=0,
                     tools=[WEATHER_TOOL])[0]
            weather += any(c.function.name == "get_weather" for c in (m.tool_calls or []))
        result["weather_calls"] = {"cities": len(EVAL_CITIES), "get_weather_calls": weather}
    result["samples"] = samples
    return result


def held_out_segments(model_dir: Path, data: Path, context: int = 36864, segment: int = 2048) -> dict:
    """Held-out loss of the first three `segment`-token pieces of the last 10%, each read from
    position 0; and of the same 3 x `segment` tokens read after `context` tokens of the training
    split, in one sequence (and, for comparison, read alone in one sequence)."""
    from tokenizers import Tokenizer

    model = DS4ForCausalLM.from_pretrained(model_dir, progress=False)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train, held = shakespeare_splits(tok, data)
    cold = [sequence_losses(model, held[s:s + segment + 1]).mean().item() for s in range(0, 3 * segment, segment)]
    text = held[:3 * segment + 1]
    alone = sequence_losses(model, text)
    warm = sequence_losses(model, torch.cat([train[:context], text]), chunk=2048)[context:]
    return {"segments": 3, "segment_tokens": segment, "context_tokens": context,
            "from_position_0": round(sum(cold) / 3, 4), "per_segment": [round(v, 4) for v in cold],
            "one_sequence_from_position_0": round(alone.mean().item(), 4),
            "after_context": round(warm.mean().item(), 4)}


def evaluate_chat(model_dir: Path, data: Path, quick: bool = False) -> dict:
    t0 = time.time()
    result = chat_eval(model_dir, quick)
    result["held_out"] = held_out_segments(model_dir, data)
    result["eval_minutes"] = round((time.time() - t0) / 60, 1)
    return result


# --------------------------------------------------------------------------- main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run_arguments(p, minutes=45.0, steps=500, lr=5e-4, seed=41)
    p.add_argument("--chat-rows", type=int, default=4, help="rows of packed plain chats per step")
    p.add_argument("--drill-rows", type=int, default=1, help="rows of packed drills (tools offered) per step")
    p.add_argument("--drill-length", type=int, default=1024, help="(a drill's tools section alone is ~500 tokens)")
    p.add_argument("--text-rows", type=int, default=2, help="rows of Shakespeare per step")
    p.add_argument("--length", type=int, default=256, help="length of those rows")
    p.add_argument("--tool-every", type=int, default=2, help="a four-tool chat every this many steps")
    p.add_argument("--agent-every", type=int, default=4, help="an agent chat every this many steps")
    p.add_argument("--long-every", type=int, default=20, help="a long sequence every this many steps")
    p.add_argument("--long-length", type=int, nargs=2, default=(8192, 16384), metavar=("MIN", "MAX"))
    p.add_argument("--thinking", type=float, default=0.2, help="share of plain chats in thinking mode")
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--quick-eval", action="store_true")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--resume", type=Path, metavar="FILE",
                   help="the run's resumable state (weights, optimiser, schedule, data position, losses), written "
                        "with --out every --save-every steps and at the end; when FILE exists the run continues from "
                        "it (run the same command again). Keep it outside the package: it is not shipped")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    if args.eval_only:
        print(json.dumps(evaluate_chat(args.out, args.data, args.quick_eval), indent=1))
        return

    from tokenizers import Tokenizer

    package = Path(__file__).resolve().parents[1] / "ds4_torch"
    if args.resume is not None and args.resume.resolve().is_relative_to(package):
        p.error(f"--resume {args.resume}: keep the resumable state outside the package ({package})")
    state = torch.load(args.resume, weights_only=False) if args.resume is not None and args.resume.exists() else None
    if state is not None and state["settings"] != run_settings(args):
        changed = sorted(k for k, v in run_settings(args).items() if state["settings"].get(k) != v)
        p.error(f"--resume {args.resume} was written by a run with other settings ({', '.join(changed)}): "
                "resume with the same ones, or start afresh with another --resume file")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if args.base.resolve() != args.out.resolve():
            (args.out / name).write_bytes((args.base / name).read_bytes())
    record = json.loads((args.base / "training.json").read_text()) if state is None else state["record"]
    model = DS4ForCausalLM.from_pretrained(args.base, progress=False)
    tok = Tokenizer.from_file(str(args.base / "tokenizer.json"))
    train_ids, _ = shakespeare_splits(tok, args.data)
    text = args.data.read_text(encoding="utf-8")
    lines = ShakespeareLines(text[:int(len(text) * 0.9)])
    balance, opt, sched = start_training(model, args)
    # Every draw of the data comes from these three, so their states are the data's position.
    rng, tool_rng = random.Random(args.seed), random.Random(args.seed + 1)
    text_generator = torch.Generator().manual_seed(args.seed)
    text_data = batches(train_ids, args.text_rows, args.length, text_generator)
    tool_data = tool_batches(tok, 1, tool_rng, model.config.eos_token_ids[0], (1, 3), 0.7, "mixed")
    tokens = dict.fromkeys(("plain_chat", "drill", "tool_chat", "agent_chat", "text", "long"), 0)
    history = []
    step, earlier = 0, 0.0  # steps and training seconds of the sessions before this one
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["schedule"])
        rng.setstate(state["rng"])
        tool_rng.setstate(state["tool_rng"])
        text_generator.set_state(state["text_generator"])
        torch.set_rng_state(state["torch_rng"])
        step, earlier, tokens, history = state["step"], state["train_seconds"], state["tokens"], state["history"]
        print(f"resumed from {args.resume} at step {step} ({earlier / 60:.1f} min trained)", flush=True)

    def save() -> None:
        model.eval().save_pretrained(args.out)
        save_record(args, record, step, earlier + time.time() - t0, tokens, history)
        if args.resume is not None:
            args.resume.parent.mkdir(parents=True, exist_ok=True)
            partial = args.resume.with_name(args.resume.name + ".partial")
            torch.save({"settings": run_settings(args), "record": record, "step": step,
                        "train_seconds": earlier + time.time() - t0, "tokens": tokens, "history": history,
                        "model": model.state_dict(), "optimizer": opt.state_dict(), "schedule": sched.state_dict(),
                        "rng": rng.getstate(), "tool_rng": tool_rng.getstate(),
                        "text_generator": text_generator.get_state(), "torch_rng": torch.get_rng_state()}, partial)
            partial.replace(args.resume)  # a run killed while saving keeps the previous state
        model.train()

    t0 = time.time()
    while time.time() - t0 < args.minutes * 60 and step < args.steps:
        step += 1
        opt.zero_grad(set_to_none=True)
        losses = {}
        parts = [("plain_chat", packed_rows(tok, lambda: plain_chat(rng, lines, args.thinking), args.chat_rows,
                                            args.length))]
        if args.drill_rows:
            parts.append(("drill", packed_rows(tok, lambda: _drill_with_tools(rng), args.drill_rows,
                                                   args.drill_length)))
        if step % args.tool_every == 0:
            parts.append(("tool_chat", next(tool_data)))
        parts.append(("text", next(text_data)))
        total = 0.0
        for kind, (x, y) in parts:
            if not (y != IGNORE).any():  # a row cut off before its first answer: nothing to learn
                continue
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
            total = total + loss
            losses[kind] = round(loss.item(), 4)
            tokens[kind] += x.numel()
        total.backward()
        if step % args.agent_every == 0:  # through the cache in chunks, as stage 3: far cheaper than whole
            conv = agent_corpus.agent_conversation(rng, "train", system_tokens=rng.randint(200, 1000), tok=tok,
                                                   rounds=(1, 3), novel=0.3)
            ids, labels = encode_chat(tok, conv)
            losses["agent_chat"] = round(train_sequence(model, ids, labels, [True] * len(ids), 1024)["chat_loss"], 4)
            tokens["agent_chat"] += len(ids)
        if args.long_every and step % args.long_every == 0:  # one long sequence through the cache
            length = rng.randint(*args.long_length)
            ids, labels, chat = (text_sequence(rng, length, train_ids) if rng.random() < 0.4 else
                                 agent_sequence(tok, rng, length, train_ids, rounds=(1, 4), novel_tools=0.0))
            out = train_sequence(model, ids, labels, chat, 2048)
            losses["long"] = {k: None if out[k] is None else round(out[k], 4) for k in ("chat_loss", "text_loss")}
            tokens["long"] += length
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        balance.step()
        history.append({"step": step, **losses})
        print(f"step {step:4d} {json.dumps(losses)} {time.time() - t0:7.1f} s", flush=True)
        if step % args.save_every == 0:
            save()
    save()
    print(f"trained {step} steps in {(earlier + time.time() - t0) / 60:.1f} min", flush=True)


def run_settings(args) -> dict:
    """What a resumed run must share with the run that wrote its state: the base, the schedule, the
    optimiser, the seed and the data mix (not --minutes, --out or --save-every)."""
    keys = ("steps", "lr", "weight_decay", "seed", "chat_rows", "drill_rows", "drill_length", "text_rows", "length",
            "tool_every", "agent_every", "long_every", "long_length", "thinking")
    return {"base": str(args.base.resolve()), **{k: list(v) if isinstance(v, tuple) else v
                                                 for k, v in vars(args).items() if k in keys}}


def save_record(args, record: dict, step: int, train_time: float, tokens: dict, history: list) -> None:
    """training.json: the base's record with this run appended to stage 4."""
    runs = list(record.get("stage4", []))
    runs.append({"script": "examples/train_chat.py", "base": str(args.base), "steps": step,
                 "schedule_steps": args.steps, "chat_rows": args.chat_rows, "drill_rows": args.drill_rows,
                 "drill_length": args.drill_length,
                 "text_rows": args.text_rows, "length": args.length, "tool_every": args.tool_every,
                 "agent_every": args.agent_every, "long_every": args.long_every,
                 "long_length": list(args.long_length), "thinking": args.thinking, "lr": args.lr,
                 "weight_decay": args.weight_decay, "seed": args.seed, "tokens": tokens,
                 "train_minutes": round(train_time / 60, 1), "torch": torch.__version__, "threads": args.threads,
                 "losses": history})
    (args.out / "training.json").write_text(json.dumps({**record, "stage4": runs}, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
