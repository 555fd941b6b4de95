"""Branch and rewind through HTTP: a request diverging from a resident conversation resumes at
the best checkpoint at or below the divergence (branching into another slot, or rewinding an
idle session in place), and its greedy output is exactly `ds4_torch.generate`'s on a cold cache.

The embedded model: a sliding window of 32, CSA blocks of 4, HCA blocks of 16. Checkpoints every
K = 20 tokens (off the block grid, so a divergence can sit right before or after a block closing
without sitting on a checkpoint)."""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from ds4_torch.default_model import default_tokenizer
from ds4_torch.generation import generate
from serve.http.app import ServerConfig, create_app
from helpers import MODEL, greedy_completion, metric, prompt_ids, server, wait_for

CTX = 256
CHUNK = 64
K = 20
N = 6  # tokens generated per request


def rewind_server(model, **config):
    return server(model, **{"ctx": CTX, "prefill_chunk": CHUNK, "checkpoint_interval": K, **config})


def complete(srv, prompt, n=N, key=None):
    return greedy_completion(srv, prompt, n, key)


_cold = {}


def cold(model, prompt, n=N):
    key = (tuple(prompt), n)
    if key not in _cold:
        _cold[key] = list(generate(model, prompt, n))
    return _cold[key]


BASE = prompt_ids(120, 1)
# Divergences: right before / after an HCA block closes (48) and a CSA block (52), inside the
# first window (10), at a checkpoint exactly (60), K-1 tokens after one (79), and one at the end
# of the first block of 16 the prefix index hashes (16).
DIVERGENCES = [10, 16, 47, 49, 51, 53, 60, 79]


def diverged(d, salt):
    return BASE[:d] + prompt_ids(17, salt)


@pytest.mark.parametrize("max_sessions", [16, 1], ids=["branch", "rewind"])
def test_divergence_points_exact(model, max_sessions):
    """With free slots the request branches (the source stays whole); with one slot the idle
    session is rewound in place. Either way: the cold output, and cached >= the checkpoint."""
    with rewind_server(model, max_sessions=max_sessions, max_batch=1) as srv:
        for salt, d in enumerate(DIVERGENCES, start=100):
            out, cached = complete(srv, BASE)
            assert out == cold(model, BASE)
            prompt = diverged(d, salt)
            out, cached = complete(srv, prompt)
            assert out == cold(model, prompt), d
            assert d - K < (d // K) * K <= cached <= d, (d, cached)
        kind = "ds4_branches_total" if max_sessions > 1 else "ds4_rewinds_total"
        assert metric(srv, kind) >= len([d for d in DIVERGENCES if d >= K])
        assert metric(srv, "ds4_checkpoint_bytes") > 0


def test_regenerate_and_retry(model):
    """The same prompt again (a regenerate) resumes at its end; a prompt ending where a reply
    began resumes there too: no token is prefilled twice."""
    with rewind_server(model) as srv:
        prompt = prompt_ids(90, 7)
        first, _ = complete(srv, prompt, 12)
        again, cached = complete(srv, prompt, 12)
        assert again == first == cold(model, prompt, 12)
        assert cached >= len(prompt) - 1
        # A prompt that continues into the reply and past a decode-time checkpoint.
        longer = prompt + first[:10] + prompt_ids(5, 8)
        out, cached = complete(srv, longer)
        assert out == cold(model, longer)
        assert cached >= len(prompt) + 10 - K


@pytest.mark.parametrize("decode_mode", ["eager", "graph"])
def test_branch_from_a_busy_session_under_batching(model, decode_mode):
    """Requests diverging from a conversation that is still decoding branch from it (it is not
    disturbed), and several branches decode in one batch, each exactly as alone; also with
    captured decode graphs (the capture emulator off CUDA), checkpoints taken between replays."""
    with rewind_server(model, max_batch=4, decode_mode=decode_mode) as srv:
        assert srv.app.state.engine.decoder.mode == decode_mode
        complete(srv, BASE, 2)
        engine = srv.app.state.engine
        engine.token_delay = 0.02
        prompts = [diverged(d, 200 + d) for d in (33, 61, 95)]
        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                long = pool.submit(complete, srv, BASE + prompt_ids(3, 9), 40)
                wait_for(lambda: engine.running, what="the source decoding")
                outs = list(pool.map(lambda p: complete(srv, p), prompts))
                long_out, _ = long.result()
        finally:
            engine.token_delay = 0.0
        assert long_out == cold(model, BASE + prompt_ids(3, 9), 40)
        for p, (out, cached) in zip(prompts, outs):
            assert out == cold(model, p)
            assert cached >= ((len(p) - 17) // K) * K


def test_checkpoints_off_reuse_only_exact_extensions(model):
    with rewind_server(model, checkpoint_interval=0) as srv:
        complete(srv, BASE)
        prompt = diverged(60, 300)
        out, cached = complete(srv, prompt)
        assert out == cold(model, prompt) and cached == 0
        assert metric(srv, "ds4_checkpoint_bytes") == 0


def test_memory_budget_keeps_boundaries(model):
    """A budget of a few checkpoints: interval ones go first, the prompt end stays."""
    engine_bytes = create_app(model, default_tokenizer(), ServerConfig(ctx=CTX)).state.engine.sessions.checkpoint_nbytes
    with rewind_server(model, checkpoint_memory_mb=2.5 * engine_bytes / 2**20) as srv:
        complete(srv, BASE)
        assert metric(srv, "ds4_checkpoint_bytes") == 2 * engine_bytes
        out, cached = complete(srv, BASE)  # regenerate: its prompt end was kept
        assert cached >= len(BASE) - 1 and out == cold(model, BASE)


def test_tenants_never_share(model):
    """With several API keys, a prefix cached for one key is not reused for another."""
    with rewind_server(model, api_key=("key-a", "key-b")) as srv:
        prompt = prompt_ids(80, 11)
        out_a, _ = complete(srv, prompt, key="key-a")
        out_b, cached_b = complete(srv, prompt, key="key-b")
        assert out_a == out_b == cold(model, prompt)
        assert cached_b == 0
        _, cached_a = complete(srv, prompt, key="key-a")
        assert cached_a >= len(prompt) - 1
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                       headers={"Authorization": "Bearer key-c"})
        assert r.status_code == 401


# --------------------------------------------------------------------------- conversations, three APIs
SYSTEM = ("You are the stage manager of a company of players. " * 12).strip()
USERS = ["Who plays the ghost tonight?", "And who holds the book?", "Is the trap in the stage repaired?",
         "What of the drum for the second act?"]


def send(srv, api, system, turns, n=8):
    """One request of a conversation (turns alternate user, assistant) through `api`: its reply text."""
    if api == "chat":
        msgs = [{"role": "system", "content": system}] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        body = {"model": MODEL, "messages": msgs, "max_tokens": n, "temperature": 0}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"] or ""
    if api == "responses":
        items = [{"type": "message", "role": "user" if i % 2 == 0 else "assistant", "content": t}
                 for i, t in enumerate(turns)]
        body = {"model": MODEL, "instructions": system, "input": items, "max_output_tokens": n, "temperature": 0}
        r = httpx.post(srv.url + "/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return "".join(c["text"] for item in r.json()["output"] if item["type"] == "message"
                       for c in item["content"])
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    # A cache_control breakpoint is a hint the server may use; reuse never depends on it.
    body = {"model": MODEL, "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            "messages": msgs, "max_tokens": n, "temperature": 0}
    r = httpx.post(srv.url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return "".join(b.get("text", "") for b in r.json()["content"])


def agent_session(srv, api):
    """A new conversation, a second one sharing the system prompt, a follow-up, a regenerate, an
    edited last user message, a retry without the last assistant turn: every reply, and for each
    request (its prompt ids, the tokens it reused, the longest common prefix with what came before,
    whether the divergence is a message start)."""
    engine = srv.app.state.engine
    submitted = []
    submit_all = engine.submit_all
    engine.submit_all = lambda reqs, **kw: (submitted.extend(reqs), submit_all(reqs, **kw))[1]
    seen: list[list[int]] = []
    log = []
    replies = []

    def step(turns, edit=False):
        reply = send(srv, api, SYSTEM, turns)
        req = submitted[-1]
        common = max((_common(s, req.prompt_ids) for s in seen), default=0)
        log.append((req.prompt_ids, req.cached_tokens, common, turns, edit))
        seen.append(req.prompt_ids + req.generated)
        replies.append(reply)
        return reply

    a1 = step([USERS[0]])
    step([USERS[1]])                            # a new conversation, the same system prompt
    step([USERS[0], a1, USERS[2]])              # a follow-up
    step([USERS[0], a1, USERS[2]])              # a regenerate
    step([USERS[0], a1, USERS[3]], edit=True)   # the last user message edited
    step([USERS[0], a1, USERS[2]])              # retry without the last assistant turn
    return replies, log


def _common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
def test_agent_conversations_reuse_at_message_boundaries(model, api):
    """Through each API: every request reuses at least its common prefix with earlier ones less
    16 tokens (divergences here are message starts), a regenerate its whole prompt less one;
    the replies are those of a server without checkpoints."""
    with rewind_server(model, ctx=1024, prefill_chunk=128, checkpoint_interval=256) as srv:
        replies, log = agent_session(srv, api)
    with rewind_server(model, ctx=1024, prefill_chunk=128, checkpoint_interval=0) as cold_srv:
        cold_replies, cold_log = agent_session(cold_srv, api)
    assert replies == cold_replies
    assert [p for p, *_ in log] == [p for p, *_ in cold_log]
    for i, (prompt, cached, common, turns, edit) in enumerate(log):
        if i and prompt == log[i - 1][0] or i == 5:  # a regenerate / a retry
            assert cached >= len(prompt) - 1, (i, cached, len(prompt))
        else:
            assert cached >= common - 16, (i, cached, common)
    assert sum(c for _, c, *_ in log) > sum(c for _, c, *_ in cold_log)


# --------------------------------------------------------------------------- disk
def test_branch_after_a_disk_round_trip(model, tmp_path):
    """Snapshots carry their checkpoints: after a restart, a prompt diverging inside a stored
    conversation resumes at its checkpoint below the divergence, exactly."""

    def disk_server():
        return rewind_server(model, kv_disk=dict(dir=tmp_path / "kv", space_mb=16.0, min_tokens=8))

    with disk_server() as srv:
        out, _ = complete(srv, BASE)
        assert out == cold(model, BASE)
    for d in (53, 79):
        with disk_server() as srv:   # a fresh process's memory: only the disk holds BASE
            prompt = diverged(d, 400 + d)
            out, cached = complete(srv, prompt)
            assert out == cold(model, prompt)
            assert cached == (d // K) * K, (d, cached)
            assert metric(srv, "ds4_kv_disk_hits_total") == 1
    with disk_server() as srv:  # a regenerate after a restart: from the last checkpoint below the prompt's end
        out, cached = complete(srv, BASE)
        assert out == cold(model, BASE)
        assert cached >= len(BASE) - K


def test_anthropic_cache_control_is_a_hint(model, tok):
    """Two system blocks, the first marked with cache_control: a request that changes only the
    second resumes at the breakpoint (no message starts there, and K is past it); without the
    mark nothing is reused, and the replies are the same either way."""
    from serve.http.chat import encode_conversation

    first = "You are the prompter of a company of players, and you know every line. " * 3
    user = [{"role": "user", "content": "Who enters next?"}]

    def ask(srv, second, mark):
        block = {"type": "text", "text": first, **({"cache_control": {"type": "ephemeral"}} if mark else {})}
        r = httpx.post(srv.url + "/v1/messages", timeout=120, json={
            "model": MODEL, "max_tokens": 4, "temperature": 0, "messages": user,
            "system": [block, {"type": "text", "text": second}]})
        assert r.status_code == 200, r.text
        return r.json()["content"], r.json()["usage"]["cache_read_input_tokens"]

    a = encode_conversation(tok, None, [{"role": "system", "content": first + "\n\nTonight: Hamlet."}, *user])
    b = encode_conversation(tok, None, [{"role": "system", "content": first + "\n\nTonight: Lear."}, *user])
    common = _common(a, b)
    assert 16 < common < K * 10
    replies = {}
    for mark in (True, False):
        with rewind_server(model, ctx=512, checkpoint_interval=256) as srv:
            ask(srv, "Tonight: Hamlet.", mark)
            replies[mark], cached = ask(srv, "Tonight: Lear.", mark)
            assert cached >= common - 16 if mark else cached == 0, (mark, cached, common)
    assert replies[True] == replies[False]


def test_a_failed_decode_step_drops_its_pending_checkpoints(model, monkeypatch):
    """Checkpoints taken on a batch slot join the conversation only when it leaves the batch: a
    step failing after one was taken resets the batch, the retry takes it again, and what the
    conversation holds afterwards branches exactly."""
    from ds4_torch import faults

    with rewind_server(model) as srv:
        engine = srv.app.state.engine
        faults.reset_fault_counts()
        monkeypatch.setenv(faults.ENV, "decode:25")  # after the decode-time checkpoint at 140
        try:
            out, _ = complete(srv, BASE, 30)
        finally:
            monkeypatch.delenv(faults.ENV)
            faults.reset_fault_counts()
        assert out == cold(model, BASE, 30)
        assert metric(srv, "ds4_device_errors_total") == 1
        held = engine.replica.checkpoints
        assert metric(srv, "ds4_checkpoint_bytes") == len(held) * engine.sessions.checkpoint_nbytes
        assert sum(len(s.checkpoints) for s in engine.sessions) == len(held)  # none left over from the failure
        prompt = BASE + out[:25] + prompt_ids(9, 500)
        got, cached = complete(srv, prompt)
        assert got == cold(model, prompt) and cached == 140


def test_agents_benchmark_scenario(model):
    """`bench serve --scenario agents`, small: the same prompts with checkpoints on and off, and
    on reuses most of them where off reuses only follow-up turns."""
    from ds4_torch.bench.agents import run_scenario

    runs = [run_scenario(model, default_tokenizer(), system_tokens=300, user_tokens=20, new_tokens=4,
                         interval=interval, prefill_chunk=128, memory_mb=64) for interval in (64, 0)]
    on, off = runs
    assert on["requests"] == off["requests"] == 58 and on["prompt_tokens"] == off["prompt_tokens"]
    assert on["reuse"] >= 0.9 and on["reuse"] > off["reuse"] + 0.2
    assert on["branches"] + on["rewinds"] > 0 and off["branches"] == off["rewinds"] == 0
    # the pool held live tokens: at most 8 conversations' blocks and a copied block per batch row, under
    # half of what static slots (16 resident + 2 batch) at the context reserve
    import math

    from ds4_torch.footprint import cache_bytes
    from ds4_torch.paged import block_nbytes

    ctx = 300 + 2 * 5 * (20 + 4) + 256
    block = block_nbytes(model.config, model.dtype)
    assert 0 < on["peak_pool_bytes"] <= (8 * math.ceil(ctx / 256) + 2) * block
    assert on["peak_pool_bytes"] < cache_bytes(model.config, ctx, 18, model.dtype) / 2
    assert on["sessions_held"] >= 8  # every conversation stayed resident


@pytest.mark.parametrize("mark", ["yes", 5, None, [], {}, {"type": "nonsense", "ttl": -1}])
def test_odd_cache_control_values_are_harmless(model, mark):
    """Whatever a client puts in cache_control, on any block, the request is answered as without it."""
    with rewind_server(model, ctx=512) as srv:
        body = {"model": MODEL, "max_tokens": 3, "temperature": 0,
                "system": [{"type": "text", "text": "Be brief.", "cache_control": mark}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": mark}]},
                             {"role": "assistant", "content": [{"type": "text", "text": "Yes?",
                                                                "cache_control": mark}]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                           "content": "x", "cache_control": mark},
                                                          {"type": "text", "text": "Go on."}]}]}
        r = httpx.post(srv.url + "/v1/messages", json=body, timeout=60)
        plain = httpx.post(srv.url + "/v1/messages", timeout=60, json=json.loads(
            json.dumps(body).replace(f'"cache_control": {json.dumps(mark)}', '"cache_control": null')))
        assert r.status_code == plain.status_code == 200, r.text
        assert r.json()["content"] == plain.json()["content"]


def test_a_long_conversation_checkpoints_its_first_and_latest_message_starts(model):
    """Sixty turns in one request: the system prompt's end and the 8 latest message starts are
    checkpointed (besides the interval and the prompt's end), not every message."""
    from serve.http.chat import MAX_MESSAGE_CHECKPOINTS

    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"line {i}"} for i in range(59)]
    with rewind_server(model, ctx=2048, checkpoint_interval=4096) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": "Count."}, *turns]})
        assert r.status_code == 200, r.text
        held = sum(len(s.checkpoints) for s in srv.app.state.engine.sessions)
        assert held == 1 + MAX_MESSAGE_CHECKPOINTS + 1
