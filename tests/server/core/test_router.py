"""Two replicas of the server behind the real vllm-router (PyPI's 0.1.17, the dev extra: a prebuilt
wheel for Linux x86-64), on loopback, as docs/scaling-out.md runs them: each replica a `python -m
serve` process publishing its KV events (`--kv-events`), the router finding them by itself
(GET /get_server_info and /kv_event_sources) and placing requests with its `kv_aware` policy.

What a user of the router sees is checked: every API streams through it and answers what a
replica answers directly; a conversation's later turns reach the replica holding it (the usage
says the whole previous prompt was reused, which only that replica can do); a replica killed
mid-run takes only the requests running on it with it, and every later request, its
conversations' included, is answered by the other."""
from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import pytest

from ds4_torch.bench.replicas import replicas_behind_router, router_executable
from helpers import MODEL, wait_for

ROUTER = router_executable()
pytestmark = pytest.mark.skipif(
    ROUTER is None, reason="vllm-router is not installed: the dev extra installs it on Linux x86-64 "
                           "(pip install 'vllm-router==0.1.17'); elsewhere put a vllm-router on PATH")

BT = 16
REPLICA = ["--ctx", "2048", "--kv-block-tokens", str(BT), "--prefill-chunk", "64", "--checkpoint-interval", str(BT),
           "--max-batch", "4", "--engine-core", "thread", "--access-log", "off"]
SYSTEM = "You are the stage manager of a small theatre company. Answer in one short sentence. " * 3


def user(c: int, turn: int) -> str:
    return f"Conversation {c}, turn {turn}: what does the prompter do during scene {c * 7 + turn}? " * 3


@pytest.fixture(scope="module")
def routed():
    with replicas_behind_router(2, REPLICA, "kv_aware", ROUTER) as (router, replicas):
        yield router, replicas


def chat(url: str, msgs: list[dict], max_tokens: int = 8, key: str | None = None) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {key}"} if key else {},
                   json={"model": MODEL, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def prompt_tokens_served(replica) -> float:
    """The prompt tokens `replica` has been asked to process so far (its /metrics)."""
    text = httpx.get(replica.url + "/metrics").text
    return sum(float(v) for v in re.findall(r"^ds4_prompt_tokens_total (\S+)$", text, re.M))


# --------------------------------------------------------------------------- every API streams
def streamed(url: str, path: str, body: dict) -> tuple[str, str]:
    """(the text a streamed request produced, the last event's kind) in each API's own shape."""
    text, last = [], None
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                last = "[DONE]"
                continue
            event = json.loads(line[6:])
            kind = event.get("type") or event.get("object")
            last = kind
            if kind == "chat.completion.chunk":
                text += [c["delta"].get("content") or "" for c in event["choices"]]
            elif kind == "text_completion":
                text += [c["text"] for c in event["choices"]]
            elif kind == "response.output_text.delta":
                text.append(event["delta"])
            elif kind == "content_block_delta" and event["delta"]["type"] == "text_delta":
                text.append(event["delta"]["text"])
    return "".join(text), last


APIS = [  # (each API's last event: the stream ended as it should, not cut)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a play."}], "max_tokens": 12}, "[DONE]"),
    ("/v1/completions", {"prompt": "The curtain rises on", "max_tokens": 12}, "[DONE]"),
    ("/v1/responses", {"input": "Name a play.", "max_output_tokens": 12}, "response.incomplete"),  # (the 12 tokens)
    ("/v1/messages", {"messages": [{"role": "user", "content": "Name a play."}], "max_tokens": 12}, "message_stop"),
]


@pytest.mark.parametrize("path, body, end", APIS, ids=[a[0] for a in APIS])
def test_every_api_streams_through_the_router(routed, path, body, end):
    router, replicas = routed
    body = {"model": MODEL, "temperature": 0, "ignore_eos": True, **body}
    via, last = streamed(router.url, path, body)
    assert last == end
    assert via == streamed(replicas[0].url, path, body)[0] == streamed(replicas[1].url, path, body)[0]


# --------------------------------------------------------------------------- conversations stay put
def test_a_conversations_later_turns_reach_the_replica_holding_it(routed):
    """Three conversations on one system prompt, their first turns two at a time (the router
    spreads them over both replicas), then three more turns each, interleaved (an odd number: no
    fixed rotation keeps each on one replica): every later turn reuses at least the whole previous
    prompt, which only the replica that served it holds."""
    converse_where_held(*routed, keys=[None] * 3)


def converse_where_held(router, replicas, keys: list[str | None]) -> None:
    served = [prompt_tokens_served(r) for r in replicas]
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user(c, 0)}] for c in range(len(keys))]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        firsts = list(pool.map(lambda c: chat(router.url, convs[c], key=keys[c]), range(len(keys))))
    previous = [r["usage"]["prompt_tokens"] for r in firsts]
    for c, r in enumerate(firsts):
        convs[c] += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]}]
    assert all(prompt_tokens_served(r) > s for r, s in zip(replicas, served)), "both replicas take conversations"
    for turn in range(1, 4):
        for c in range(len(keys)):
            convs[c].append({"role": "user", "content": user(c, turn)})
            r = chat(router.url, convs[c], key=keys[c])
            usage = r["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= previous[c], (c, turn, usage, previous[c])
            previous[c] = usage["prompt_tokens"]
            convs[c].append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})


def test_tenants_keys_go_through_the_router_and_a_killed_replica_leaves_the_other_serving():
    """Replicas with keys (tenants) and --kv-events-all-tenants, the router given none: a request
    without a key is refused by the replica, through the router; each tenant's conversations reach
    the replica holding them, the router rendering each prompt with the client's own key (a
    tenant's replayed turns are its own). Then, on the same replicas (one start for both: the
    failover is the router's and the survivor's, whatever the keys), a tenant with nothing cached
    yet has conversations on both replicas, their next turns streaming on both when one replica
    is killed (SIGKILL). At most the streams running on it fail; every later request is answered
    200 by the other, the dead one's conversations prefilled there again."""
    tenants = ["--api-key", "alice-key", "--api-key", "bob-key", "--api-key", "carol-key", "--kv-events-all-tenants"]
    with replicas_behind_router(2, REPLICA + tenants, "kv_aware", ROUTER) as (router, replicas):
        r = httpx.post(router.url + "/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 401, r.text
        converse_where_held(router, replicas, keys=["alice-key", "bob-key", "alice-key"])
        kill_one_mid_run(router, replicas, key="carol-key")  # (carol: no prefix of hers held anywhere)


# --------------------------------------------------------------------------- failover
def kill_one_mid_run(router, replicas, key: str) -> None:
    """Conversations on both replicas; their next turns streaming on both when `replicas[0]` is
    killed (SIGKILL): at most the streams running on it fail; every later request is answered 200
    by the other, the dead one's conversations prefilled there again."""
    auth = {"Authorization": f"Bearer {key}"}
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user(c, 0)}] for c in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        firsts = list(pool.map(lambda m: chat(router.url, m, key=key), convs))
    for c, r in enumerate(firsts):
        convs[c] += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                     {"role": "user", "content": user(c, 1)}]
    dead, alive = replicas

    def running(replica) -> float:
        m = re.search(r"^ds4_requests_running (\S+)$", httpx.get(replica.url + "/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0

    started = []  # one entry per stream past its first token (list.append is atomic)

    def long_turn(msgs) -> str:  # "ok", or how it failed
        try:
            with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=120, headers=auth, json={
                    "model": MODEL, "messages": msgs, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as r:  # (still running at the kill: `on_dead` below; the survivor's run to their end)
                if r.status_code != 200:
                    return f"HTTP {r.status_code}"
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: "):
                        break
                started.append(1)
                done = any(line == "data: [DONE]" for line in lines)
                return "ok" if done else "cut"
        except httpx.HTTPError as e:
            return type(e).__name__

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(long_turn, m) for m in convs]
        wait_for(lambda: len(started) == 4, 120, "every stream's first token")
        on_dead = running(dead)
        assert on_dead >= 1, "the router spread the running turns over both replicas"
        dead.kill()
        outcomes = [f.result() for f in futures]
    failed = [o for o in outcomes if o != "ok"]
    assert len(failed) <= on_dead, outcomes  # only what ran on the dead replica
    for c in range(4):  # the next turn of every conversation: the survivor answers them all
        convs[c].append({"role": "assistant", "content": "Noted."})
        convs[c].append({"role": "user", "content": user(c, 2)})
        r = httpx.post(router.url + "/v1/chat/completions", timeout=120, headers=auth, json={
            "model": MODEL, "messages": convs[c], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, (c, r.status_code, r.text)
    assert httpx.get(alive.url + "/health").status_code == 200


# --------------------------------------------------------------------------- the benchmark
def test_the_agents_benchmark_through_replicas(tmp_path, capsys):
    """`bench serve --scenario agents --replicas 2`, small, kv_aware only: 58 requests through the
    router, and each conversation's later turns reuse at least 90% of their prompts (the target)."""
    import csv

    from ds4_torch.bench.serve import run
    from ds4_torch.cli import build_parser

    out = tmp_path / "agents.csv"
    args = build_parser().parse_args(["bench", "serve", "--scenario", "agents", "--replicas", "2", "--policies",
                                      "kv_aware", "--system-tokens", "300", "--user-tokens", "20", "--new-tokens", "4",
                                      "--checkpoint-interval", "64", "--prefill-chunk", "128", "--router", ROUTER,
                                      "--csv", str(out)])
    assert run(args) == 0
    (row,) = list(csv.DictReader(out.open()))
    assert row["policy"] == "kv_aware" and int(row["requests"]) == 58
    assert float(row["later_reuse"]) >= 0.9, row
    assert "kv_aware" in capsys.readouterr().out
