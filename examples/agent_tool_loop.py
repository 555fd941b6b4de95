"""A tool loop through all three APIs of `ds4-torch serve`, with the official SDKs, offline.

    python examples/agent_tool_loop.py                             # starts `python -m serve` itself
    python examples/agent_tool_loop.py --url http://127.0.0.1:8000 # or uses a running server

The embedded default model learned the agent protocol (`examples/train_tools.py`): offered a
``get_weather(city)`` tool and asked about a city's weather, it calls the tool in DSML, which the
server returns as a tool call; given the result, it answers in text. This script runs that loop
with ``openai`` (chat completions, then the Responses API) and ``anthropic`` (Messages), executing
the calls with a fake weather service, and prints each turn with the prompt tokens the server
found in its cache: from the second turn on, the whole previous prompt and reply.
Coding agents drive the same endpoints: Claude Code with ``ANTHROPIC_BASE_URL=http://HOST:PORT``
and ``ANTHROPIC_MODEL=ds4-default``, Codex with a provider whose ``base_url`` is
``http://HOST:PORT/v1`` and ``wire_api = "responses"``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

MODEL = "ds4-default"
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name."}},
                          "required": ["city"]}}


def get_weather(city: str) -> dict:
    """A fake weather service: the same answer for the same city."""
    h = sum(map(ord, city))
    return {"city": city, "temperature": h % 30, "condition": ["sunny", "cloudy", "rainy", "windy"][h % 4]}


def run_tool(name: str, arguments: dict) -> str:
    if name != "get_weather":
        return json.dumps({"error": f"unknown tool {name}"})
    return json.dumps(get_weather(**arguments))


def chat_completions_loop(url: str, question: str, rounds: int = 3, thinking: bool = False) -> list[dict]:
    """Chat completions with `tools`; returns one record per turn. `thinking`: DeepSeek's
    thinking mode; the reasoning goes back in `reasoning_content` with the rest of the message."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": question}]
    turns = []
    for _ in range(rounds):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[{"type": "function",
                                                                                  "function": WEATHER}],
                                           temperature=0, max_tokens=128,
                                           extra_body={"thinking": {"type": "enabled" if thinking else "disabled"}})
        m = r.choices[0].message
        turns.append({"prompt": r.usage.prompt_tokens, "completion": r.usage.completion_tokens,
                      "cached": r.usage.prompt_tokens_details.cached_tokens, "finish": r.choices[0].finish_reason,
                      "calls": [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []],
                      "text": m.content})
        messages.append(m.model_dump(exclude_none=True))  # sent back verbatim, ids included
        if not m.tool_calls:
            break
        for c in m.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": run_tool(c.function.name, json.loads(c.function.arguments))})
    return turns


def responses_loop(url: str, question: str, rounds: int = 3, thinking: bool = False) -> list[dict]:
    """The Responses API, stateless: the whole item list goes back each turn (reasoning items too)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    items: list = [{"role": "user", "content": question}]
    turns = []
    for _ in range(rounds):
        r = client.responses.create(model=MODEL, input=items, tools=[{"type": "function", **WEATHER}],
                                    temperature=0, max_output_tokens=128, store=False,
                                    **({"reasoning": {"effort": "high"}} if thinking else {}))
        calls = [o for o in r.output if o.type == "function_call"]
        turns.append({"prompt": r.usage.input_tokens, "completion": r.usage.output_tokens,
                      "cached": r.usage.input_tokens_details.cached_tokens, "finish": r.status,
                      "calls": [(c.name, json.loads(c.arguments)) for c in calls], "text": r.output_text})
        items += [o.model_dump(exclude_none=True) for o in r.output]
        if not calls:
            break
        for c in calls:
            items.append({"type": "function_call_output", "call_id": c.call_id,
                          "output": run_tool(c.name, json.loads(c.arguments))})
    return turns


def anthropic_loop(url: str, question: str, rounds: int = 3, thinking: bool = False) -> list[dict]:
    """Anthropic Messages with tools: tool_use blocks out, tool_result blocks back (and thinking
    blocks, which go back with the rest of the assistant message)."""
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    tools = [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
    messages: list = [{"role": "user", "content": question}]
    turns = []
    for _ in range(rounds):
        r = client.messages.create(model=MODEL, max_tokens=1200 if thinking else 128, messages=messages, tools=tools,
                                   extra_body={"temperature": 0},  # the SDK no longer has a parameter for it
                                   **({"thinking": {"type": "enabled", "budget_tokens": 1024}} if thinking else {}))
        uses = [b for b in r.content if b.type == "tool_use"]
        turns.append({"prompt": r.usage.input_tokens + r.usage.cache_read_input_tokens,
                      "completion": r.usage.output_tokens, "cached": r.usage.cache_read_input_tokens,
                      "finish": r.stop_reason, "calls": [(u.name, u.input) for u in uses],
                      "text": "".join(b.text for b in r.content if b.type == "text")})
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        if not uses:
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id, "content": run_tool(u.name, u.input)} for u in uses]})
    return turns


@contextlib.contextmanager
def local_server():
    """`python -m serve` on a free loopback port, for as long as the block runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "serve", "--port", str(port), "--log-level", "warning"],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError("the server exited") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def report(name: str, turns: list[dict]) -> None:
    print(f"--- {name}")
    for k, t in enumerate(turns):
        what = ", ".join(f"{n}({json.dumps(a)})" for n, a in t["calls"]) or repr(t["text"])
        print(f"turn {k + 1}: prompt {t['prompt']} tokens, {t['cached']} from the cache; "
              f"reply {t['completion']} tokens ({t['finish']}): {what}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--question", default="What is the weather in Paris?")
    p.add_argument("--thinking", action="store_true", help="thinking mode (the model reasons before it replies)")
    args = p.parse_args(argv)
    with (contextlib.nullcontext(args.url) if args.url else local_server()) as url:
        report("chat completions (openai)", chat_completions_loop(url, args.question, thinking=args.thinking))
        report("responses (openai)", responses_loop(url, args.question, thinking=args.thinking))
        report("messages (anthropic)", anthropic_loop(url, args.question, thinking=args.thinking))


if __name__ == "__main__":
    main()
