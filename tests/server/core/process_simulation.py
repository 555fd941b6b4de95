"""The seeded simulation at the process level (issue #43): a real engine core and two API
processes (`serve --api-servers 2`, each on a port of its own so the workload chooses which
serves each request), random HTTP traffic across the three APIs, an API process killed or
stopped mid-stream, faults injected in the core. Not a test module: `test_process_simulation.py`
runs it; `python tests/server/core/process_simulation.py SEED...` too.

- **Workload** (from the seed): conversations, each a chain of turns on OpenAI chat or
  completions, Anthropic messages or OpenAI Responses, streamed or not; every turn goes to the
  API process the seed picks (a chat's next turn often to the other one); some chats offer a
  tool (the model calls it; the next turn sends its result); a few conversations at once.
  Greedy, so every answer is the single-process server's.
- **Faults** (from the seed): in the core (`DS4_TORCH_FAULT`): a submit that raises, a slow
  submit (`DS4_TORCH_FAULT_SLOW_S`), a decode step or prefill chunk that raises; API process 2
  killed (SIGKILL) or stopped for a while (SIGSTOP, SIGCONT) mid-stream.
- **Checks**: every answer that completes equals what a single-process server answers for the
  same request alone (text, finish, prompt and completion tokens: a follow-up turn is the same
  prompt whichever process serves it); a request fails only through a fault (its API process
  killed, a submit the core was made to fail: a 500 naming it); none waits past its own work (no
  gap between two of its events, or before its first, longer than `WAIT_S`, but for one wait of
  the one request the slow submit slowed, up to that time more, and the stop for requests of
  the stopped process; a request given nothing for `TIMEOUT` is given up); and the core finished
  no request that no client was answered for (its prompt tokens counted in
  `ds4_prompt_tokens_total`, read once a slow submit has ended and nothing is queued or running,
  equal the answered requests', unless requests were lost with a killed process).

Timing depends on the machine: a seed replays the same workload, routing and faults, not the
same interleaving.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

MODEL = "ds4-default"
FLAGS = ("--ctx", "1024", "--prefill-chunk", "32", "--max-batch", "4", "--api-servers", "2")
WAIT_S = 6.0          # the longest a request may wait between two of its events (loaded 2-core CPUs)
SLOW_S = float(os.environ.get("DS4_SIM_SLOW_S", 8.0))  # a slow submit's time in the core
STOP_S = 3.0          # how long API process 2 stays stopped
TIMEOUT = 60.0        # a request given nothing for this long (no byte, or no event between keep-alives) is given up
REPLAY = ("DS4_SIM_SEED={seed} PYTHONPATH=. python -m pytest -q -p no:cacheprovider "
          "tests/server/core/test_process_simulation.py")
OPENERS = ["Who art thou?", "Good morrow, sir.", "What news from Rome?", "Is the king dead?", "Where is Romeo?",
           "Speak, what trade art thou?", "ROMEO:\n", "First Citizen:\n", "KING HENRY:\n", "Say a word of love."]
FOLLOW = ["Speak again.", "Why so?", "And then?", "How now?", "Go on.", "What say you?"]
# Tool conversations (chat completions): the model calls get_weather, the next turn sends the call's
# result. A call is rendered back from its parsed arguments unless exact replay finds its sampled ids
# (by call id), and the two differ for some calls: what makes a follow-up on the other API process
# show whether both processes share one replay store.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city today",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
WEATHER = ["What is the weather in Paris?", "Weather for Mantua, please.", "Is it raining in Rome?",
           "How warm is it in Verona today?", "Tell me the weather in London.", "Will it snow in Oslo?"]


@dataclass
class Turn:
    api: str          # completions, chat, messages, responses
    process: int      # 0 or 1
    stream: bool
    max_tokens: int
    text: str         # the user's text of this turn (a tool conversation's next turn: the call's result instead)
    tools: bool = False  # a tool conversation's turn: TOOLS offered


@dataclass
class ProcessPlan:
    seed: int
    conversations: list[list[Turn]]
    workers: int
    core_faults: str
    api_fault: str | None     # None, "kill" or "stop": of API process 2
    fault_after: int          # ... once this many requests have been sent

    @classmethod
    def of(cls, seed: int) -> "ProcessPlan":
        rng = random.Random(seed)
        conversations = []
        for _ in range(rng.randint(6, 10)):
            api = rng.choice(["completions", "chat", "chat", "messages", "responses"])
            turns = rng.randint(2, 3) if api in ("chat", "messages") else 1
            first, process, chain = rng.choice(OPENERS), rng.randint(0, 1), []
            for t in range(turns):
                chain.append(Turn(api, process, rng.random() < 0.6, rng.randint(3, 16),
                                  first if t == 0 else rng.choice(FOLLOW)))
                process = 1 - process if rng.random() < 0.7 else process  # a next turn mostly on the other
            conversations.append(chain)
        tools = random.Random(seed * 7 + 3)  # (a draw of its own: the rest of the plan is as it was)
        for chain in conversations:
            if chain[0].api == "chat" and tools.random() < 0.6:
                first = tools.choice(WEATHER)
                for t, turn in enumerate(chain):
                    turn.tools, turn.max_tokens = True, tools.randint(40, 56)  # (room for a call)
                    turn.text = first if t == 0 else turn.text
        kinds = ["submit:{}:device", "submit:{}:slow", "decode:{}:device", "prefill:{}:oom"]
        core = ",".join(k.format(rng.randint(2, 8)) for k in rng.sample(kinds, rng.choice([0, 1, 2, 2])))
        return cls(seed, conversations, rng.choice([2, 3]), core, rng.choice([None, None, "kill", "stop"]),
                   rng.randint(2, 8))


@dataclass
class Sent:
    conversation: int
    turn: int
    process: int
    path: str
    body: dict
    status: int | None = None
    answer: dict | None = None
    error: str | None = None
    waits: list = field(default_factory=list)   # seconds before each event (the first: before the first)
    broken: bool = False                        # its connection broke (its API process was killed)
    at: float = 0.0                             # when it was sent (time.monotonic())


@dataclass
class ProcessReport:
    seed: int
    plan: ProcessPlan
    problems: list[str] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)

    def line(self) -> str:
        ok = sum(1 for s in self.sent if s.status == 200)
        calls = sum(1 for s in self.sent if s.answer and s.answer.get("calls"))
        return (f"process seed {self.seed}: {len(self.sent)} requests ({ok} answered, {calls} with tool calls), core faults "
                f"{self.plan.core_faults or 'none'}, API process 2 {self.plan.api_fault or 'untouched'}")


# --------------------------------------------------------------------------- requests and answers
def request(turn: Turn, history: list[dict]) -> tuple[str, dict]:
    """(path, body) of `turn` after the conversation's earlier messages (chat completions' form);
    a tool conversation's turn after a call sends the call's result, not the turn's text."""
    body = {"model": MODEL, "temperature": 0, "stream": turn.stream}
    messages = list(history)
    calls = history[-1].get("tool_calls") if history else None
    if calls:
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": weather(c)} for c in calls]
    else:
        messages.append({"role": "user", "content": turn.text})
    if turn.tools:
        body["tools"] = TOOLS
    if turn.api == "completions":
        body.update(prompt=turn.text, max_tokens=turn.max_tokens, ignore_eos=True)
    elif turn.api == "responses":
        body.update(input=turn.text, max_output_tokens=turn.max_tokens)
    else:
        body.update(messages=messages, max_tokens=turn.max_tokens)
    if turn.stream and turn.api in ("completions", "chat"):
        body["stream_options"] = {"include_usage": True}
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "messages": "/v1/messages",
            "responses": "/v1/responses"}[turn.api]
    return path, body


def weather(call: dict) -> str:
    """A tool call's result (the same for the same call)."""
    try:
        city = json.loads(call["function"]["arguments"]).get("city")
    except (ValueError, AttributeError):
        city = None
    return json.dumps({"city": city, "temp_c": 18, "sky": "clear"})


def answer_of(api: str, data: dict) -> dict:
    """What a whole (not streamed) response says: text, finish, prompt and completion tokens (and
    a chat's tool calls: `calls` as sent, the call ids aside in `answer["ids"]`)."""
    if api in ("completions", "chat"):
        c, u = data["choices"][0], data["usage"]
        text = c["text"] if api == "completions" else c["message"]["content"]
        out = dict(text=text, finish=c["finish_reason"], prompt=u["prompt_tokens"], completion=u["completion_tokens"])
        calls = c.get("message", {}).get("tool_calls")
        if calls:
            out["calls"] = [(k["function"]["name"], k["function"]["arguments"]) for k in calls]
            out["ids"] = [k["id"] for k in calls]
        return out
    if api == "messages":
        u = data["usage"]
        return dict(text="".join(b.get("text", "") for b in data["content"]), finish=data["stop_reason"],
                    prompt=u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"],
                    completion=u["output_tokens"])
    u = data["usage"]
    text = "".join(p["text"] for item in data["output"] if item["type"] == "message" for p in item["content"]
                   if p["type"] == "output_text")
    return dict(text=text, finish=data["status"], prompt=u["input_tokens"], completion=u["output_tokens"])


def answer_of_stream(api: str, events: list[dict]) -> dict:
    """What a streamed response says (its events, in order)."""
    if api in ("completions", "chat"):
        text, finish, usage, calls = "", None, None, []
        for e in events:
            for c in e.get("choices", []):
                text += c.get("text", "") if api == "completions" else (c["delta"].get("content") or "")
                calls += c.get("delta", {}).get("tool_calls") or []  # (each call arrives whole)
                finish = c.get("finish_reason") or finish
            usage = e.get("usage") or usage
        choice = {"text": text} if api == "completions" else \
            {"message": {"content": text or None, "tool_calls": calls} if calls else {"content": text}}
        return answer_of(api, {"choices": [dict(choice, finish_reason=finish)], "usage": usage})
    if api == "messages":
        text = "".join(e["delta"].get("text", "") for e in events if e.get("type") == "content_block_delta")
        end = next(e for e in events if e.get("type") == "message_delta")
        return answer_of(api, {"content": [{"text": text}], "stop_reason": end["delta"]["stop_reason"],
                               "usage": end["usage"]})
    final = next(e for e in events if e.get("type") in ("response.completed", "response.incomplete"))
    return answer_of(api, final["response"])


def send(url: str, sent: Sent, api: str) -> None:
    """Send `sent`, timing the wait before each event; its status and answer, or its error."""
    t = sent.at = time.monotonic()
    try:
        if not sent.body["stream"]:
            r = httpx.post(url + sent.path, json=sent.body, timeout=TIMEOUT)
            sent.waits.append(time.monotonic() - t)
            sent.status = r.status_code
            data = r.json()
            if r.status_code == 200:
                sent.answer = answer_of(api, data)
            else:
                sent.error = data.get("error", {}).get("message", r.text) if isinstance(data, dict) else r.text
            return
        events = []
        with httpx.stream("POST", url + sent.path, json=sent.body, timeout=TIMEOUT) as r:
            sent.status = r.status_code
            if r.status_code != 200:
                sent.waits.append(time.monotonic() - t)
                sent.error = r.read().decode()
                return
            for line in r.iter_lines():
                if time.monotonic() - t > TIMEOUT:  # (keep-alives only: the stream never ends by itself)
                    sent.waits.append(time.monotonic() - t)
                    sent.status, sent.error = None, f"no event for {TIMEOUT:.0f} s: given up"
                    return
                if line.startswith("data: {"):
                    now = time.monotonic()
                    sent.waits.append(now - t)
                    t = now
                    event = json.loads(line[6:])
                    events.append(event)
                    if "error" in event or event.get("type") == "error":
                        sent.status, sent.error = 500, json.dumps(event)[:300]
        if sent.status == 200:
            sent.answer = answer_of_stream(api, events)
    except httpx.ReadTimeout:  # nothing at all for TIMEOUT
        sent.waits.append(time.monotonic() - t)
        sent.status, sent.error = None, f"no answer for {TIMEOUT:.0f} s: given up"
    except (httpx.HTTPError, StopIteration, KeyError, TypeError, ValueError) as e:
        sent.status, sent.broken, sent.error = None, True, f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------- the run
def run_workload(plan: ProcessPlan, urls: list[str], api_procs=None) -> list[Sent]:
    """Every conversation of `plan`, a few at once, against the processes at `urls` (one url:
    the single-process server, which gets every turn); with `api_procs`, the API fault is
    applied to process 2 once `plan.fault_after` requests were sent."""
    sent: list[Sent] = []
    lock = threading.Lock()
    dead = threading.Event()

    def fault() -> None:
        proc = api_procs[1]
        if plan.api_fault == "kill":
            proc.kill()
            dead.set()
        else:
            proc.send_signal(signal.SIGSTOP)
            time.sleep(STOP_S)
            proc.send_signal(signal.SIGCONT)

    def conversation(k: int) -> None:
        history = []
        for t, turn in enumerate(plan.conversations[k]):
            process = 0 if len(urls) == 1 or dead.is_set() else turn.process
            path, body = request(turn, history)
            s = Sent(k, t, process, path, body)
            with lock:
                sent.append(s)
                start_fault = api_procs is not None and plan.api_fault and len(sent) == plan.fault_after
            if start_fault:
                threading.Thread(target=fault, daemon=True).start()
            send(urls[process], s, turn.api)
            if s.status != 200:
                return  # (the conversation stops at a failed turn)
            history = s.body["messages"] if "messages" in s.body else []
            reply = {"role": "assistant", "content": s.answer["text"]}
            if s.answer.get("calls"):
                reply["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                       for i, (n, a) in zip(s.answer["ids"], s.answer["calls"])]
            history = history + [reply]

    with concurrent.futures.ThreadPoolExecutor(plan.workers) as pool:
        for f in [pool.submit(conversation, k) for k in range(len(plan.conversations))]:
            f.result()
    return sent


def check(plan: ProcessPlan, sent: list[Sent], alone: dict, core_prompt_tokens: float) -> list[str]:
    """The checks of the module docstring; `alone`: (conversation, turn) -> the single-process answer."""
    problems, stopped = [], plan.api_fault == "stop"
    slow_used = False
    for s in sent:
        what = f"conversation {s.conversation} turn {s.turn} ({s.path}, API process {s.process + 1})"
        if s.status == 200:
            want = alone.get((s.conversation, s.turn))
            if s.answer != want and {k: v for k, v in s.answer.items() if k != "ids"} != \
                    {k: v for k, v in (want or {}).items() if k != "ids"}:  # (call ids are new each time)
                problems.append(f"{what}: {s.answer}, alone {want}")
        else:
            killed = plan.api_fault == "kill" and s.process == 1 and (s.broken or s.status == 503)
            behind = stopped and s.process == 1 and "api_process_behind" in (s.error or "")
            injected = "injected device fault at submit" in (s.error or "") and s.status == 500
            if not (killed or behind or injected):
                problems.append(f"{what} failed: {s.status} {s.error}")
        allowed = WAIT_S + (STOP_S if stopped and s.process == 1 else 0)
        longest = max(s.waits, default=0.0)
        waits = sorted(s.waits)
        if allowed < longest <= SLOW_S + allowed and "slow" in plan.core_faults and not slow_used and \
                (len(waits) < 2 or waits[-2] <= allowed):
            slow_used = True  # the request the slow submit slowed: one of its waits is that
            continue
        if longest > allowed:
            problems.append(f"{what} waited {longest:.1f} s for an event (at most {allowed:.1f} s allowed)")
    answered = sum(s.answer["prompt"] for s in sent if s.status == 200)
    lost = plan.api_fault == "kill" and any(s.broken for s in sent)
    if core_prompt_tokens != answered and not (lost and core_prompt_tokens > answered):
        problems.append(f"the core finished requests of {core_prompt_tokens:.0f} prompt tokens, the clients got "
                        f"answers for {answered}")
    return problems


def alone_answers(model, plan: ProcessPlan, sent: list[Sent]) -> dict:
    """Each sent request's answer from a single-process server, alone (one at a time, in the
    order of its conversation)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from helpers import server

    out = {}
    with server(model, ctx=1024, prefill_chunk=32, max_batch=4) as srv:
        for s in sorted(sent, key=lambda s: (s.conversation, s.turn)):
            one = Sent(s.conversation, s.turn, 0, s.path, dict(s.body))
            send(srv.url, one, plan.conversations[s.conversation][s.turn].api)
            out[(s.conversation, s.turn)] = one.answer
    return out


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def simulate_processes(seed: int, model) -> ProcessReport:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from helpers import api_processes, wait_for

    plan = ProcessPlan.of(seed)
    report = ProcessReport(seed, plan)
    env = {"DS4_TORCH_FAULT": plan.core_faults, "DS4_TORCH_FAULT_SLOW_S": str(SLOW_S)}
    with api_processes(*FLAGS, env=env) as (core, api):
        urls = [url for _, url in api]
        report.sent = run_workload(plan, urls, [proc for proc, _ in api])
        # A submit the core is still taking is neither queued nor running yet: wait out the slow one.
        # An answered request's submit has ended, so only an unanswered one (given up on, failed,
        # its process killed) can still be in the core's submit: wait from the latest one's sending.
        unanswered = [s.at for s in report.sent if s.status != 200]
        if "slow" in plan.core_faults and unanswered:
            time.sleep(max(0.0, max(unanswered) + SLOW_S + 1 - time.monotonic()))
        wait_for(lambda: metric(urls[0], "ds4_requests_running") == 0 and metric(urls[0], "ds4_queue_depth") == 0,
                 60, "the core to go idle")
        core_prompt_tokens = metric(urls[0], "ds4_prompt_tokens_total")
    report.problems = check(plan, report.sent, alone_answers(model, plan, report.sent), core_prompt_tokens)
    return report


if __name__ == "__main__":
    from ds4_torch.default_model import build_default_model

    m = build_default_model()
    for arg in sys.argv[1:]:
        r = simulate_processes(int(arg), m)
        print(r.line())
        for p in r.problems:
            print("  ", p)
