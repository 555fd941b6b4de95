"""Server lifecycle: client disconnects (queued, prefill, decode), keep-alives, injected device
faults and recovery, queue overflow. The engine is held where a test needs it (`held_prefill`:
each prefill chunk waits for the test), so what is asserted is ordered by the engine's own
state (its queue, the chunk it is in, a request's cancel), not by the clock; slow decode steps
come from the engine's `token_delay` hook, faults from `DS4_TORCH_FAULT`, set in-process."""
from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest

from ds4_torch import faults
from helpers import MODEL, expected, held_prefill, metric, server
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
    e.token_delay = 0.0
    e.max_queue = srv.app.state.config.max_queue
    wait_idle(e)


def wait_idle(engine, timeout=10.0):
    wait_for(engine.idle, timeout, "the engine to go idle")


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
    """The client leaves while chunk 4 of 25 runs: that chunk ends, no other starts."""
    ids = prompt_ids(400, salt=3 + stream)  # 25 chunks
    aborted0 = metric(srv, "ds4_prefill_aborted_total")
    chunks0 = metric(srv, "ds4_prefill_chunks_total")
    with held_prefill(engine) as gate:
        sock = raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 4, "stream": stream})
        gate.allow(3)
        gate.wait_entered(4)  # chunks 1-3 done, chunk 4 held
        req = engine.prefilling
        sock.close()
        wait_for(req.cancel.is_set, what="the server to notice the disconnect")
    wait_idle(engine, timeout=30)
    done = metric(srv, "ds4_prefill_chunks_total") - chunks0
    assert done == 4, f"{done} prefill chunks: the disconnect came during chunk 4"
    assert metric(srv, "ds4_prefill_aborted_total") == aborted0 + 1
    assert metric(srv, "ds4_requests_aborted_total", stage="prefill") >= 1
    # The prefix computed so far stays resident and is reused by the retry.
    assert ids[:int(done) * CHUNK] in engine.resident_tokens()
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


def test_disconnect_during_decode(srv, engine, model, tok, monkeypatch):
    ids = prompt_ids(40, salt=11)
    engine.token_delay = 0.05  # 400 tokens take 20 s: the client leaves long before
    at_cancel = []
    cancel = engine.cancel

    def recording_cancel(req):  # what the request had generated when the server told the engine
        at_cancel.append(len(req.generated))
        cancel(req)

    monkeypatch.setattr(engine, "cancel", recording_cancel)
    with httpx.Client(timeout=30) as c, c.stream("POST", srv.url + "/v1/completions", json={
            "model": MODEL, "prompt": ids, "max_tokens": 400, "stream": True, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}) as r:
        got = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += json.loads(line[6:])["choices"][0].get("token_ids", [])
            if len(got) >= 5:
                break
        req = engine.running[0]
    wait_idle(engine, timeout=30)
    # The step running when the cancel came may end; none starts after it.
    assert len(at_cancel) == 1 and len(req.generated) - at_cancel[0] <= 1, (at_cancel, len(req.generated))
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
    prompt0 = metric(srv, "ds4_prompt_tokens_total")
    aborted0 = metric(srv, "ds4_requests_aborted_total", stage="queued")
    with held_prefill(engine) as gate:
        busy = raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt_ids(300, 5), "max_tokens": 2})
        gate.wait_entered(1)
        queued = raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt_ids(30, 6), "max_tokens": 2,
                                                   "stream": True})
        wait_for(lambda: engine.queue_depth() == 1, what="the request to queue")
        assert metric(srv, "ds4_queue_depth") == 1
        queued.close()
        wait_for(lambda: engine.queue_depth() == 0, what="the queued request to be dropped")
        assert metric(srv, "ds4_requests_aborted_total", stage="queued") == aborted0 + 1
        assert gate.entered == 1  # dropped while the engine was still held in the busy request's first chunk
        busy.close()
        wait_for(engine.prefilling.cancel.is_set, what="the busy request's disconnect")
    wait_idle(engine)
    assert metric(srv, "ds4_prompt_tokens_total") == prompt0  # neither finished; the queued one never ran


# --------------------------------------------------------------------------- keep-alive
def test_keepalive_while_queued_and_during_prefill(srv, engine):
    """No token to send for a while, queued and then prefilling: the stream gets keep-alive
    comments meanwhile. Each phase lasts until two keep-alives came in it (the engine is held)."""
    ours = prompt_ids(40, 8)  # 3 chunks
    with held_prefill(engine) as gate:
        busy = raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt_ids(10, 7), "max_tokens": 1})
        gate.wait_entered(1)  # the busy request's one chunk, held: ours waits in the queue
        phases = {"queued": [], "prefill": []}
        lines = []
        # (A stream silent for 10 s, 33 keep-alive intervals, fails as a read timeout.)
        with httpx.Client(timeout=10) as c, c.stream("POST", srv.url + "/v1/completions", json={
                "model": MODEL, "prompt": ours, "max_tokens": 2, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if line != ": keep-alive":
                    continue
                if gate.entered == 1:
                    assert engine.queue_depth() == 1
                    phases["queued"].append(line)
                    if len(phases["queued"]) == 2:
                        gate.allow(1)  # the busy request's chunk runs; ours is admitted, its chunk 1 held
                        gate.wait_entered(2)
                        assert engine.prefilling.prompt_ids == ours
                elif len(phases["prefill"]) < 2:  # (once opened, its other chunks may take a keep-alive too)
                    assert engine.prefilling.prompt_ids == ours
                    phases["prefill"].append(line)
                    if len(phases["prefill"]) == 2:
                        gate.open()
    busy.close()
    assert len(phases["queued"]) == 2 and len(phases["prefill"]) == 2
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert set(lines[:first_data]) == {": keep-alive"} and lines[-1] == "data: [DONE]"


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
    r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
        "stream": False, "ignore_eos": True})
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


def test_persistent_fault_gives_503_then_recovers(srv, fault, model, tok):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
    body = {"model": MODEL, "prompt": prompt_ids(20, 12), "max_tokens": 4, "ignore_eos": True}
    cbody = {**{k: v for k, v in body.items() if k != "ignore_eos"}, "extra_body": {"ignore_eos": True}}
    errors0 = metric(srv, "ds4_device_errors_total")
    fault("prefill:1:device:always")
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
    assert metric(srv, "ds4_device_errors_total") == errors0 + 4  # again one try and one retry

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

    fault("")  # the device is fine again: the next request gets the model's own answer and health recovers
    r = httpx.post(srv.url + "/v1/completions", timeout=30,
                   json={**body, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == expected(model, tok, body["prompt"], 4)[0]
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    assert srv.app.state.engine.alive


# --------------------------------------------------------------------------- queue
def test_queue_overflow_gives_429(srv, engine):
    engine.max_queue = 2
    with held_prefill(engine) as gate:
        socks = [raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt_ids(200, 20), "max_tokens": 1})]
        gate.wait_entered(1)
        socks += [raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt_ids(20, 21 + i),
                                                    "max_tokens": 1}) for i in range(2)]
        wait_for(lambda: engine.queue_depth() == 2, what="two queued requests")
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "overflow", "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full" and "Retry-After" in r.headers
        assert metric(srv, "ds4_requests_total", endpoint="/v1/completions", code="429") >= 1
        for s in socks:
            s.close()
    wait_idle(engine)


def test_many_streams_with_small_queue(srv, engine):
    """Twelve clients at once while the engine is held in another request's prefill, queue 3:
    three wait and nine get 429 at once; then the three are served to the end, none hangs."""
    engine.max_queue = 3
    results = []

    def one(i):
        try:
            with httpx.Client(timeout=60) as c:
                with c.stream("POST", srv.url + "/v1/completions", json={
                        "model": MODEL, "prompt": f"c{i}", "max_tokens": 3, "stream": True}) as r:
                    lines = list(r.iter_lines())
                    results.append(r.status_code if r.status_code != 200 or "data: [DONE]" in lines else -1)
        except Exception as e:  # noqa: BLE001
            results.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    with held_prefill(engine) as gate:
        busy = raw_post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt_ids(20, 23), "max_tokens": 1})
        gate.wait_entered(1)
        for t in threads:
            t.start()
        wait_for(lambda: len(results) == 9, what="nine 429s")
        assert sorted(results) == [429] * 9 and engine.queue_depth() == 3, (results, engine.queue_depth())
        gate.open()
        for t in threads:
            t.join(60)
    busy.close()
    assert sorted(results, key=str) == [200] * 3 + [429] * 9, results


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
