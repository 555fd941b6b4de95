"""Server lifecycle: client disconnects (queued, prefill, decode), keep-alives, injected device
faults and recovery, queue overflow. Slow chunks/tokens come from the engine's test hooks
(`chunk_delay`, `token_delay`); faults from `DS4_TORCH_FAULT`, set in-process."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

from ds4_torch import faults
from helpers import MODEL, expected, metric, server
from helpers import wait_for

CHUNK = 16
KEEPALIVE = 0.3


@pytest.fixture(scope="module")
def srv():
    with server(ctx=1024, prefill_chunk=CHUNK, keepalive_interval=KEEPALIVE,
                        disconnect_poll_interval=0.02) as s:
        yield s


@pytest.fixture
def engine(srv):
    e = srv.app.state.engine
    yield e
    e.chunk_delay = e.token_delay = 0.0
    e.max_queue = srv.app.state.config.max_queue
    wait_idle(e)


def wait_idle(engine, timeout=10.0):
    wait_for(engine.idle, timeout, "the engine to go idle")


def started(engine) -> bool:
    return engine.prefilling is not None or bool(engine.running)


def raw_post(srv, path, body) -> socket.socket:
    """An HTTP request on a raw socket, so a test can drop the connection at any moment."""
    data = json.dumps(body).encode()
    s = socket.create_connection((srv.host, srv.port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {srv.host}:{srv.port}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def prompt_ids(n, salt=0):
    return [(i * 7 + salt) % 251 + 1 for i in range(n)]


# --------------------------------------------------------------------------- disconnects
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_during_prefill_stops_within_one_chunk(srv, engine, stream):
    ids = prompt_ids(400, salt=3 + stream)  # 25 chunks
    engine.chunk_delay = 0.15
    aborted0 = metric(srv, "ds4_prefill_aborted_total")
    chunks0 = metric(srv, "ds4_prefill_chunks_total")
    sock = raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 4, "stream": stream})
    wait_for(lambda: metric(srv, "ds4_prefill_chunks_total") - chunks0 >= 3, what="3 prefill chunks")
    sock.close()
    at_close = metric(srv, "ds4_prefill_chunks_total")
    wait_idle(engine, timeout=5)
    done = metric(srv, "ds4_prefill_chunks_total") - chunks0
    assert done - (at_close - chunks0) <= 1, "prefill went on for more than one chunk after the disconnect"
    assert done < 25
    assert metric(srv, "ds4_prefill_aborted_total") == aborted0 + 1
    assert metric(srv, "ds4_requests_aborted_total", stage="prefill") >= 1
    # The prefix computed so far stays resident and is reused by the retry.
    assert ids[:int(done) * CHUNK] in engine.resident_tokens()
    engine.chunk_delay = 0.0
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == int(done) * CHUNK


def test_engine_is_not_idle_while_an_iteration_ends_a_request(srv, engine, monkeypatch):
    """Ending a request takes it off the running batch before its abort is counted and its end
    handed to the output part: `idle()` (what the disconnect tests wait for) must not be true
    in between, or a test reading the metrics then sees nothing counted."""
    seen = []
    abort = engine._abort

    def recording_abort(req, stage):
        engine.output.flush(5)  # the tokens before it are out: only the iteration is left
        seen.append((stage, engine.idle()))
        abort(req, stage)

    monkeypatch.setattr(engine, "_abort", recording_abort)
    engine.token_delay = 0.05
    with httpx.Client(timeout=30) as c, c.stream("POST", srv.url + "/v1/completions", json={
            "model": MODEL, "prompt": prompt_ids(20, salt=17), "max_tokens": 200, "stream": True,
            "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    wait_idle(engine, timeout=5)
    assert seen == [("decode", False)]


def test_disconnect_during_decode(srv, engine, model, tok):
    ids = prompt_ids(40, salt=11)
    engine.token_delay = 0.05
    gen0 = metric(srv, "ds4_generated_tokens_total")
    with httpx.Client(timeout=30) as c, c.stream("POST", srv.url + "/v1/completions", json={
            "model": MODEL, "prompt": ids, "max_tokens": 400, "stream": True, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}) as r:
        got = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += json.loads(line[6:])["choices"][0].get("token_ids", [])
            if len(got) >= 5:
                break
        at_close = metric(srv, "ds4_generated_tokens_total")
    wait_idle(engine, timeout=5)
    generated = metric(srv, "ds4_generated_tokens_total") - gen0
    assert generated - (at_close - gen0) <= 2
    assert generated < 50
    assert metric(srv, "ds4_requests_aborted_total", stage="decode") >= 1
    # The session kept prompt + the tokens fed back; a continuation of them reuses all of it.
    # (A token is fed by the step after it is sent: the last one sent may not have been fed.)
    cached = next(t for t in engine.resident_tokens() if t[:len(ids)] == ids)
    fed = min(len(cached) - len(ids), 5)
    assert fed >= 4 and cached[len(ids):len(ids) + fed] == got[:fed]
    engine.token_delay = 0.0
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": cached, "max_tokens": 3,
                                                      "temperature": 0, "return_token_ids": True,
                                                      "ignore_eos": True}, timeout=30)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(cached)
    assert r.json()["choices"][0]["token_ids"] == expected(model, tok, cached, 3)[0]


def test_disconnect_while_queued(srv, engine):
    engine.chunk_delay = 0.1
    busy = raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt_ids(300, 5), "max_tokens": 2})
    wait_for(lambda: started(engine), what="the engine to start")
    prompt0 = metric(srv, "ds4_prompt_tokens_total")
    queued = raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt_ids(30, 6), "max_tokens": 2,
                                               "stream": True})
    wait_for(lambda: engine.queue_depth() == 1, what="the request to queue")
    assert metric(srv, "ds4_queue_depth") == 1
    queued.close()
    wait_for(lambda: engine.queue_depth() == 0, timeout=3, what="the queued request to be dropped")
    assert metric(srv, "ds4_requests_aborted_total", stage="queued") >= 1
    busy.close()
    wait_idle(engine)
    assert metric(srv, "ds4_prompt_tokens_total") == prompt0  # neither finished; the queued one never ran


# --------------------------------------------------------------------------- keep-alive
def test_keepalive_while_queued_and_during_prefill(srv, engine):
    engine.chunk_delay = 0.12
    busy = raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt_ids(160, 7), "max_tokens": 1})
    wait_for(lambda: started(engine), what="the engine to start")
    stamps = []  # (time, line) of every SSE line
    start = time.monotonic()
    with httpx.Client(timeout=30) as c, c.stream("POST", srv.url + "/v1/completions", json={
            "model": MODEL, "prompt": prompt_ids(160, 8), "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                stamps.append((time.monotonic(), line))
    busy.close()
    first_data = next(i for i, (_, line) in enumerate(stamps) if line.startswith("data:"))
    keepalives = [t for t, line in stamps[:first_data] if line == ": keep-alive"]
    assert len(keepalives) >= 4  # ~1.2 s queued + ~1.2 s prefill at 0.3 s
    times = [start] + [t for t, _ in stamps[:first_data + 1]]
    assert max(b - a for a, b in zip(times, times[1:])) < KEEPALIVE + 0.25
    assert stamps[-1][1] == "data: [DONE]"


# --------------------------------------------------------------------------- faults
@pytest.fixture
def fault(monkeypatch, srv, engine):
    def set_fault(spec):
        faults.reset_fault_counts()
        monkeypatch.setenv(faults.ENV, spec)
    yield set_fault
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.reset_fault_counts()


@pytest.mark.parametrize("spec", ["prefill:2", "decode:3", "decode:3:oom", "prefill:1:oom"])
def test_fault_retried_once_from_clean_state(srv, fault, model, tok, spec):
    ids = prompt_ids(40, 9 + len(spec))  # 3 chunks; not the last case's prompt (its end is checkpointed: no prefill)
    want = expected(model, tok, ids, 8)[0]
    errors0, resets0 = metric(srv, "ds4_device_errors_total"), metric(srv, "ds4_engine_resets_total")
    fault(spec)
    t = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
        "stream": False, "ignore_eos": True})
    assert time.monotonic() - t < 10
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want  # the retry resumes seamlessly
    assert metric(srv, "ds4_device_errors_total") == errors0 + 1
    assert metric(srv, "ds4_engine_resets_total") == resets0 + 1
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}


def test_fault_in_streaming_decode_is_resumed(srv, fault, model, tok):
    ids = prompt_ids(20, 10)
    _, text = expected(model, tok, ids, 10)
    fault("decode:4")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
    s = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in s) == text


def test_persistent_fault_gives_503_then_recovers(srv, fault):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
    body = {"model": MODEL, "prompt": prompt_ids(20, 12), "max_tokens": 4, "ignore_eos": True}
    cbody = {**{k: v for k, v in body.items() if k != "ignore_eos"}, "extra_body": {"ignore_eos": True}}
    errors0 = metric(srv, "ds4_device_errors_total")
    fault("prefill:1:device:always")
    t = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert r.json()["error"]["type"] == "server_error"
    assert metric(srv, "ds4_device_errors_total") == errors0 + 2  # one try, one retry, no loop
    h = httpx.get(srv.url + "/health")
    assert h.status_code == 503 and h.json()["status"] == "degraded" and "failed" in h.json()["reason"]
    # Streaming that fails before any output: still a plain 503 (nothing was sent yet).
    with pytest.raises(openai.APIStatusError) as e:
        list(client.completions.create(stream=True, **cbody))
    assert e.value.status_code == 503
    assert time.monotonic() - t < 10

    # Failing after streaming began: an SSE `error` event.
    fault("decode:2:device:always")
    with pytest.raises(openai.APIError, match="failed"):
        list(client.completions.create(stream=True, temperature=0, **{**cbody, "max_tokens": 20}))
    with httpx.Client(timeout=30) as c, c.stream("POST", srv.url + "/v1/completions",
                                                 json={**body, "max_tokens": 20, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and "event: error" in lines and "data: [DONE]" not in lines
    assert json.loads(lines[lines.index("event: error") + 1][6:])["error"]["code"] == "engine_error"
    assert httpx.get(srv.url + "/health").status_code == 503

    fault("")  # the device is fine again: the next request succeeds and health recovers
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    assert srv.app.state.engine.alive


# --------------------------------------------------------------------------- queue
def test_queue_overflow_gives_429(srv, engine):
    engine.max_queue = 2
    engine.chunk_delay = 0.1
    socks = [raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt_ids(200, 20), "max_tokens": 1})]
    wait_for(lambda: started(engine), what="the engine to start")
    socks += [raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt_ids(20, 21 + i), "max_tokens": 1})
              for i in range(2)]
    wait_for(lambda: engine.queue_depth() == 2, what="two queued requests")
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "overflow", "max_tokens": 1})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full" and "Retry-After" in r.headers
    assert metric(srv, "ds4_requests_total", endpoint="/v1/completions", code="429") >= 1
    for s in socks:
        s.close()
    wait_idle(engine)


def test_many_streams_with_small_queue(srv, engine):
    """More concurrent clients than queue slots: every one either finishes or gets 429, none hangs."""
    engine.max_queue = 3
    results = []

    def one(i):
        try:
            with httpx.Client(timeout=30) as c:
                with c.stream("POST", srv.url + "/v1/completions", json={
                        "model": MODEL, "prompt": f"c{i}", "max_tokens": 3, "stream": True}) as r:
                    lines = list(r.iter_lines())
                    results.append(r.status_code if r.status_code != 200 or "data: [DONE]" in lines else -1)
        except Exception as e:  # noqa: BLE001
            results.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 12 and set(results) <= {200, 429}, results
    assert 200 in results


def test_graph_decode_mode_with_fault(monkeypatch, model, tok):
    """Captured-graph decoding (the emulator on CPU) through the server: a decode fault drops the
    graphs, the retry recaptures them, and the output is still exactly greedy."""
    ids = prompt_ids(24, 30)
    want = expected(model, tok, ids, 8)[0]
    with server(ctx=128, prefill_chunk=CHUNK, decode_mode="graph") as gsrv:
        assert gsrv.app.state.engine.decoder.mode == "graph"
        body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                "ignore_eos": True}
        faults.reset_fault_counts()
        monkeypatch.setenv(faults.ENV, "decode:3")
        r = httpx.post(gsrv.url + "/v1/completions", json=body, timeout=60)
        monkeypatch.delenv(faults.ENV)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
        assert metric(gsrv, "ds4_engine_resets_total") == 1
        r = httpx.post(gsrv.url + "/v1/completions", json=body, timeout=60)
        assert r.json()["choices"][0]["token_ids"] == want
    faults.reset_fault_counts()
