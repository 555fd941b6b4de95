"""The engine core in a process of its own (serve.core.process, serve.core.client, serve.core.wire).

First through the wire on threads of this process (`threaded_core`: the same socket, messages
and client, the engine at hand to inspect): every kind of request answers as the in-process
engine does; a speculative step's stop string gives the rest back as in one process; the
core's errors are the same 4xx; a disconnect stops prefill within a chunk; /metrics holds both
processes' metrics. Then real processes, killed: the core dying ends every open request with a
503 and the server with status 1; the API process dying takes the core with it; no orphans.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
import types
from multiprocessing.connection import Client

import httpx
import pytest

from ds4_torch.default_model import default_tokenizer
from ds4_torch.generation import generate
from ds4_torch.sampling import SamplingParams
from helpers import ROOT, api_processes, gone, held_prefill, prompt_ids, serve_process, wait_for, wait_healthy
from serve.http.app import ServerConfig, create_app
from serve.background import BackgroundServer
from serve.core.process import threaded_core
from serve.engine.loop import Engine
from serve.engine.sequence import GenRequest
from serve.core.wire import BACKLOG_MB, dumps, loads, request_bytes

MODEL = "ds4-default"
TIMEOUT = 120


@contextlib.contextmanager
def server(model, core: bool, backlog_mb: float = BACKLOG_MB, **settings):
    """A server on `model`, its engine in this process (`core` False) or behind a core client;
    `srv.engine` is the engine either way."""
    config = ServerConfig(**{"ctx": 512, "prefill_chunk": 32, **settings})
    tok = default_tokenizer()
    if not core:
        app = create_app(model, tok, config)
        with BackgroundServer(app) as srv:
            srv.engine, srv.core_metrics = app.state.engine, app.state.metrics
            yield srv
        return
    engine = Engine.from_config(model, tok, config)
    with threaded_core(engine, tok, config, backlog_mb) as client:
        with BackgroundServer(create_app(model, tok, config, engine=client)) as srv:
            srv.engine, srv.core_metrics = engine, engine.metrics
            yield srv


def post(srv, path, body):
    return httpx.post(srv.url + path, json={"model": MODEL, **body}, timeout=TIMEOUT)


def stream_events(srv, path, body) -> list:
    with httpx.stream("POST", srv.url + path, json={"model": MODEL, "stream": True, **body}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def strip_ids(value):
    """A response without what differs between two servers by design (ids, timestamps)."""
    if isinstance(value, dict):
        return {k: strip_ids(v) for k, v in value.items() if k not in ("id", "created", "system_fingerprint")}
    if isinstance(value, list):
        return [strip_ids(v) for v in value]
    return value


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
REQUESTS = [
    ("/v1/completions", dict(prompt="ROMEO:\nWhat light", max_tokens=12, temperature=0, ignore_eos=True,
                             logprobs=3, return_token_ids=True)),
    ("/v1/completions", dict(prompt="KING HENRY:\n", max_tokens=6, temperature=0, ignore_eos=True, echo=True,
                             logprobs=2, prompt_logprobs=2)),
    ("/v1/completions", dict(prompt="First Citizen:\n", max_tokens=10, temperature=0.9, seed=7, n=2,
                             ignore_eos=True, return_token_ids=True)),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Say a word"}], max_tokens=16,
                                  temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2,
                                  response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {
                                      "type": "object", "properties": {"word": {"type": "string"}},
                                      "required": ["word"]}}})),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=24,
                                  temperature=0, tools=TOOLS, tool_choice="required")),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Weather in Rome?"}], max_tokens=24,
                                  temperature=0.7, seed=3, tools=TOOLS)),
]


def test_every_kind_of_request_answers_as_the_in_process_engine(model):
    """Logprobs, prompt logprobs, seeded choices, a JSON schema (its grammar sent as its spec and
    compiled in the core), a forced tool call and a tool-call block's trigger grammar: the same
    JSON bodies and the same streamed events through the core as from an engine in this process."""
    results = {}
    for core in (False, True):
        with server(model, core) as srv:
            results[core] = [strip_ids(post(srv, path, body).json()) for path, body in REQUESTS]
            results[core].append(strip_ids(stream_events(srv, *REQUESTS[0])))
            results[core].append(strip_ids(stream_events(srv, *REQUESTS[3])))
    assert results[True] == results[False]
    first = results[True][0]["choices"][0]
    assert first["token_ids"] == list(generate(model, default_tokenizer().encode(REQUESTS[0][1]["prompt"]), 12))
    assert json.loads(results[True][3]["choices"][0]["message"]["content"])  # the schema held: JSON


def test_a_speculative_stop_string_gives_the_rest_back_through_the_core(model):
    """The stop string is found in the API process, among the tokens of one verify step: the core
    waits for that step's ack, so it gives the later tokens back as in one process; the text,
    tokens and the follow-up's reuse are the plain ones."""
    from helpers import prompt_ids, stop_spanning_tokens

    tok = default_tokenizer()
    ids, n = prompt_ids(30, 11), 40
    tokens = list(generate(model, ids, n))
    stop, text, upto = stop_spanning_tokens(tok, tokens)
    with server(model, True, max_batch=4, speculative_tokens=3, speculative_policy="always") as srv:
        r = post(srv, "/v1/completions", dict(prompt=ids, max_tokens=n, temperature=0, ignore_eos=True,
                                              return_token_ids=True, stop=[stop])).json()["choices"][0]
        assert (r["text"], r["token_ids"], r["finish_reason"]) == (text, tokens[:upto], "stop")
        follow = ids + tokens[:upto] + prompt_ids(5, 12)
        again = post(srv, "/v1/completions", dict(prompt=follow, max_tokens=4, temperature=0, ignore_eos=True,
                                                  return_token_ids=True)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) + upto - 1
    assert again["choices"][0]["token_ids"] == list(generate(model, follow, 4))


def test_the_cores_refusals_are_the_same_errors(model):
    """A request the core refuses (its queue is full) is the same 429 body, in each API's shape."""
    got = {}
    for core in (False, True):
        with server(model, core) as srv:
            srv.engine.max_queue = 0  # the engine's own check (the API's allows the request)
            got[core] = [(r.status_code, r.headers.get("retry-after"), r.json()) for r in (
                post(srv, "/v1/completions", dict(prompt="a", max_tokens=2)),
                post(srv, "/v1/messages", dict(messages=[{"role": "user", "content": "a"}], max_tokens=2)))]
    assert got[True] == got[False]
    assert [g[0] for g in got[True]] == [429, 429]


# --------------------------------------------------------------------------- submits (issue #43)
SLOW_SUBMIT = 7  # the core takes 3 s to take a request with this max_tokens (a slow grammar build, say)


@pytest.fixture
def slow_core_submits(monkeypatch):
    import serve.core.process as core_process

    real = core_process.request_from

    def request_from(data, structured):
        req = real(data, structured)
        if req.max_tokens == SLOW_SUBMIT:
            time.sleep(3.0)
        return req

    monkeypatch.setattr(core_process, "request_from", request_from)


def test_the_core_answers_a_submit_whatever_fails(model, monkeypatch):
    """A submit that raises anything in the core is answered (a 500 naming it, at once), and the
    core keeps nothing of it (it waited 30 s unanswered, its API process frozen, the request
    left in the core's maps)."""
    with server(model, True) as srv:
        def broken(reqs, continuation=False):
            raise RuntimeError("injected: a bug in queueing")

        monkeypatch.setattr(srv.engine, "submit_all", broken)
        t0 = time.monotonic()
        r = post(srv, "/v1/completions", dict(prompt="ROMEO:", max_tokens=4))
        assert r.status_code == 500 and "injected: a bug in queueing" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 10
        core = srv.app.state.engine.core
        assert not core.origin and all(not c.requests for c in core.connections)
        assert not srv.app.state.engine.requests
        monkeypatch.undo()
        assert post(srv, "/v1/completions", dict(prompt="ROMEO:", max_tokens=4)).status_code == 200


def test_submitting_never_blocks_the_api_process(model, slow_core_submits):
    """While the core takes 3 s over one request's submit, another stream of the same API
    process keeps receiving its tokens (submit was a blocking round trip on the event loop: every
    stream of the process stalled for as long), another request of it is answered meanwhile (the
    core took one connection's submits one after the other), and the slow request is answered
    too."""
    with server(model, True) as srv:
        srv.engine.token_delay = 0.05
        arrivals, slow = [], {}

        def slow_request():
            slow["r"] = post(srv, "/v1/completions", dict(prompt="KING HENRY:", max_tokens=SLOW_SUBMIT,
                                                         ignore_eos=True))

        def quick_request():
            time.sleep(0.3)  # (after the slow one)
            t0 = time.monotonic()
            slow["quick"] = post(srv, "/v1/completions", dict(prompt="KING HENRY:", max_tokens=2, ignore_eos=True))
            slow["quick_s"] = time.monotonic() - t0

        threads = [threading.Thread(target=slow_request), threading.Thread(target=quick_request)]
        body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 80, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 5:
                        for thread in threads:
                            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        assert slow["r"].status_code == 200 and slow["r"].json()["usage"]["completion_tokens"] == SLOW_SUBMIT
        assert slow["quick"].status_code == 200 and slow["quick_s"] < 2.0, slow["quick_s"]
        gaps = [b - a for a, b in zip(arrivals[5:], arrivals[6:])]
        assert max(gaps) < 2.0, max(gaps)


@pytest.mark.parametrize("client_waits", [True, False])
def test_a_submit_the_core_answers_late_is_never_left_without_an_owner(model, slow_core_submits, monkeypatch,
                                                                       client_waits):
    """The core answers a submit later than the API process used to wait (0.5 s here, 30 s by
    default): a client that waits gets its reply (it got a 503 while the core ran the request
    to max_tokens for nobody); one that leaves first has its request cancelled in the core,
    which runs none of it."""
    from serve.core.client import CoreClient

    monkeypatch.setitem(CoreClient._call.__kwdefaults__, "timeout", 0.5)
    with server(model, True) as srv:
        engine, body = srv.engine, dict(prompt="KING HENRY:", max_tokens=SLOW_SUBMIT, ignore_eos=True)
        if client_waits:
            r = post(srv, "/v1/completions", body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == SLOW_SUBMIT
        else:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(srv.url + "/v1/completions", json={"model": MODEL, **body}, timeout=0.3)
            aborted = lambda: sum(engine.metrics.value("ds4_requests_aborted_total", stage=stage)  # noqa: E731
                                  for stage in ("queued", "prefill", "decode"))
            wait_for(lambda: aborted() >= 1, 10, "the core to take the request (3 s) and cancel it")
            wait_for(lambda: engine.idle() and not srv.app.state.engine.requests, 10, "the engine to go idle")
            assert engine.served == 0 and aborted() == 1


def test_a_disconnect_stops_prefill_within_one_chunk_through_the_core(model):
    """The client leaves while chunk 4 of 25 runs (the engine held there): the cancel crosses
    the wire, that chunk ends and no other starts."""
    ids = [(i * 7 + 5) % 251 + 1 for i in range(400)]  # 25 chunks of 16
    with server(model, True, ctx=1024, prefill_chunk=16, disconnect_poll_interval=0.02) as srv:
        engine, m = srv.engine, srv.core_metrics
        data = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 4, "stream": True}).encode()
        with held_prefill(engine) as gate:
            sock = socket.create_connection((srv.host, srv.port))
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {srv.host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            gate.allow(3)
            gate.wait_entered(4)
            req = engine.prefilling
            sock.close()
            wait_for(req.cancel.is_set, what="the cancel to reach the core's engine")
        wait_for(lambda: engine.idle() and not srv.app.state.engine.requests, 30, "the engine to go idle")
        assert m.value("ds4_prefill_chunks_total") == 4
        assert m.value("ds4_requests_aborted_total", stage="prefill") == 1


def test_metrics_hold_both_processes(model):
    with server(model, True) as srv:
        assert post(srv, "/v1/completions", dict(prompt="KING HENRY:\n", max_tokens=5, ignore_eos=True)).status_code \
            == 200
        text = httpx.get(srv.url + "/metrics").text
    # tokens are counted where they become text (this process), prefill chunks in the core
    assert re.search(r"^ds4_generated_tokens_total 5\.0$", text, re.M), text
    assert re.search(r"^ds4_prefill_chunks_total 1\.0$", text, re.M), text
    assert re.search(r'^ds4_requests_total\{code="200",endpoint="/v1/completions"\} 1\.0$', text, re.M), text
    assert re.search(r"^ds4_engine_healthy 1\.0$", text, re.M), text
    assert text.count("# TYPE ds4_generated_tokens_total counter") == 1


def test_the_cache_report_crosses_the_core(model):
    """What a request reused and why not more (serve.engine.reuse) is worked out in the core and
    sent with the request's start: the header, the explain endpoint (a call to the core) and the
    access log's reason are the same as with the engine in this process."""
    first = prompt_ids(300, 1)
    seen = {}
    for core in (False, True):
        with server(model, core, ctx=1024) as srv:
            post(srv, "/v1/completions", dict(prompt=first, max_tokens=2))
            r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": first[:100] + prompt_ids(9, 2),
                                                              "max_tokens": 2}, headers={"x-ds4-cache": "1"})
            rid, header = r.headers["x-ds4-cache"].split("; ", 1)
            report = httpx.get(f"{srv.url}/v1/cache/explain/{rid.removeprefix('request=')}").json()
            seen[core] = header, {k: v for k, v in report.items() if k != "request"}, \
                srv.core_metrics.value("ds4_prompt_reuse_total", reason="no_checkpoint")
    assert seen[True] == seen[False]
    assert seen[True][1]["reason"] == "no_checkpoint" and seen[True][1]["diverged_at"] == 100 and seen[True][2] == 1


def stream_text(url: str, body: dict, on_text=lambda: None) -> tuple[str, list]:
    """A streamed completion's text, and its error events (none when it ended normally);
    `on_text()` once its first text arrives."""
    text, errors = "", []
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, "stream": True, **body},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                else:
                    text, before = text + "".join(c["text"] for c in event["choices"]), text
                    if text and not before:
                        on_text()
    return text, errors


def test_an_ack_that_does_not_come_is_waited_for_once():
    """Speculating, the engine waits (up to a deadline) for each API process to acknowledge the
    step messages its stop strings need. A process that misses the deadline is not waited for
    again, at every later step, until it has acknowledged everything asked of it."""
    from serve.core.process import CoreOutput

    late, prompt = (types.SimpleNamespace(alive=True, lagging=False, missed_acks=0, acked=acked, sent_ack=3)
                    for acked in (0, 3))
    core = types.SimpleNamespace(engine=types.SimpleNamespace(speculative_tokens=1), connections=[late, prompt])
    output = CoreOutput(core)
    assert not output.flush(0.01)  # the deadline passed waiting for `late`
    assert output.flush(0.01) and output.flush(5)  # not waited for again: True at once
    assert (late.lagging, late.missed_acks) == (True, 1)
    output.acked(late, 2)
    assert late.lagging  # still behind the last ack asked of it
    output.acked(late, 3)
    late.sent_ack = 4  # caught up, it is waited for again
    assert not late.lagging and not output.flush(0.01) and late.missed_acks == 2


def connection_threads_ended(core, conn) -> bool:
    """`conn` is off the core's list and its reader and sender threads have ended."""
    return conn not in core.connections and not any(
        t.name.endswith((f"-send{conn.number}", f"-api{conn.number}")) for t in threading.enumerate())


def test_a_connection_that_stops_reading_never_holds_up_the_core(model):
    """Two more API connections submit long greedy requests (20 logprobs a token: big step
    messages fill a socket sooner) and never read. The HTTP client's stream beside them answers
    the plain greedy text: the core never blocked on a full socket, and once a connection had
    more than the bound queued it dropped its output and cancelled its requests (their sessions
    keep what was fed). One, closed unread (its sender blocked mid-write), leaves no
    thread; the other, read at last, finds tokens up to a point, then ("dropped", ids), then the
    cancelled ends, and closed leaves no thread either."""
    tok = default_tokenizer()
    ids = tok.encode("KING HENRY:\n")
    with server(model, True, backlog_mb=4 / 1024, ctx=1024) as srv:
        engine, core = srv.engine, srv.app.state.engine.core
        address, authkey = srv.app.state.engine.core_address

        def unread(n: int):
            raw = Client(address, "AF_UNIX", authkey=authkey)
            reqs = [GenRequest(prompt_ids=ids, max_tokens=900, sampling=SamplingParams(temperature=0), logprobs=20,
                               ignore_eos=True) for _ in range(n)]
            raw.send_bytes(dumps(("submit", 1, [request_bytes(r) for r in reqs], False)))
            wait_for(lambda: all(r.id in core.connections[-1].requests for r in reqs), 30, "the requests to arrive")
            return raw, core.connections[-1], reqs

        raw, conn, stuck = unread(4)
        closed, closed_conn, _ = unread(2)
        prompt = tok.encode("ROMEO:\n")
        text, errors = stream_text(srv.url, dict(prompt=prompt, max_tokens=160, temperature=0, ignore_eos=True))
        assert (text, errors) == (tok.decode(list(generate(model, prompt, 160))), [])
        wait_for(lambda: engine.idle(), 30, "the unread requests to be cancelled")
        assert engine.metrics.value("ds4_api_process_behind_total") == 2
        assert engine.metrics.value("ds4_requests_aborted_total", stage="decode") == 6
        closed.close()
        wait_for(lambda: connection_threads_ended(core, closed_conn), 10, "the closed connection's threads to end")

        messages = [loads(raw.recv_bytes())]
        ends = set()
        while len(ends) < 4:
            messages.append(loads(raw.recv_bytes()))
            if messages[-1][0] == "step":
                ends |= {r[1] for r in messages[-1][3] if r[0] == "e" and r[2] == "cancelled" and r[5] == "decode"}
        kinds = [m[0] for m in messages]
        assert kinds[0] == "hello" and ("reply", 1, None, None) in messages and kinds.count("dropped") == 1
        notice = kinds.index("dropped")
        assert messages[notice] == ("dropped", sorted(r.id for r in stuck)) and ends == set(messages[notice][1])
        received = [r[2] for m in messages[:notice] if m[0] == "step" for r in m[3] if r[:2] == ("t", stuck[0].id)]
        fed = max((t for t in engine.resident_tokens() if t[:len(ids)] == ids), key=len)[len(ids):]
        assert 0 < len(received) < len(fed)  # the engine went on past what was read, and kept it
        assert fed == list(generate(model, ids, len(fed))) and received == fed[:len(received)]
        raw.close()
        wait_for(lambda: connection_threads_ended(core, conn), 10, "the connection's threads to end")
        assert stream_text(srv.url, dict(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True))[0] == \
            tok.decode(list(generate(model, prompt, 8)))


# --------------------------------------------------------------------------- real processes, killed
def core_pid(proc) -> int:
    m = re.search(r"engine core: process (\d+)", "".join(proc.lines))
    assert m, "".join(proc.lines)
    return int(m.group(1))


def test_the_core_dying_ends_every_request_with_503_and_the_server():
    with serve_process("--ctx", "512", "--prefill-chunk", "32") as proc:
        pid = core_pid(proc)
        body = {"model": MODEL, "prompt": "ROMEO:\n", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            os.kill(pid, signal.SIGKILL)
            rest = list(lines)
        assert proc.wait(30) == 1, "".join(proc.lines)
    error = next(json.loads(line[6:]) for line in rest if line.startswith("data: {") and '"error"' in line)
    assert error["error"]["code"] == "engine_unavailable" and "engine core" in error["error"]["message"]
    assert "the engine core process died" in "".join(proc.lines)


def test_a_request_arriving_after_the_core_died_gets_503():
    """A real core process, hung (SIGSTOP), then dead: a request sent to it in between waits
    (this process's core client holds it, unanswered), then gets its 503."""
    from serve.cli import build_parser
    from serve.core.api_process import connect_core
    from serve.core.process import spawn_core
    from serve.core.setup import load_api_side

    args = build_parser().parse_args(["--ctx", "512", "--prefill-chunk", "32"])
    tokenizer, model_config = load_api_side(args)
    core = spawn_core(args)
    try:
        client = connect_core(core, tokenizer, owner=True)
        app = create_app(types.SimpleNamespace(config=model_config), tokenizer, client.config, engine=client)
        with BackgroundServer(app) as srv:
            os.kill(core.proc.pid, signal.SIGSTOP)
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                pending = ex.submit(httpx.post, srv.url + "/v1/completions", timeout=60,
                                   json={"model": MODEL, "prompt": "a", "max_tokens": 3})
                wait_for(lambda: client.requests, what="the request to be sent to the hung core")
                assert not pending.done()
                os.kill(core.proc.pid, signal.SIGKILL)
                r = pending.result()
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
    finally:
        core.proc.kill()
        core.wait(30)


def test_the_api_process_dying_takes_the_core_with_it():
    with serve_process("--ctx", "512", "--prefill-chunk", "32") as proc:
        pid = core_pid(proc)
        proc.kill()
        proc.wait(10)
        wait_for(lambda: gone(pid), 10, "the engine core to exit")


def test_an_api_process_dying_leaves_the_others_serving():
    """--api-servers 2: ten streams spread over both processes by the kernel; kill -9 of the second
    breaks its streams alone, the core cancels exactly those, the first process's streams end
    normally and new requests are answered; SIGTERM (a service manager stopping the server) then
    drains the first process and the core, and no process is left. (Ctrl-C: test_serve_cli.py.)"""
    with serve_process("--ctx", "512", "--prefill-chunk", "32", "--max-batch", "10", "--api-servers", "2") as proc:
        pid = int(re.search(r"API process 2: process (\d+)", "".join(proc.lines)).group(1))
        wait_for(lambda: "".join(proc.lines).count("Application startup complete") == 2, 60, "both API processes")
        started, results = concurrent.futures.ThreadPoolExecutor(10), []

        def stream(i):
            body = {"model": MODEL, "prompt": f"Stream {i}:\n", "max_tokens": 60, "ignore_eos": True, "stream": True,
                    "return_token_ids": True}
            tokens = 0
            try:
                with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            tokens += sum(len(c.get("token_ids") or ()) for c in json.loads(line[6:])["choices"])
                            if tokens and ("first", i) not in results:
                                results.append(("first", i))
            except httpx.HTTPError:
                return "broken"
            return tokens

        futures = [started.submit(stream, i) for i in range(10)]
        wait_for(lambda: len(results) == 10, 60, "every stream's first token")
        os.kill(pid, signal.SIGKILL)
        outcomes = [f.result() for f in futures]
        broken = outcomes.count("broken")
        assert 1 <= broken <= 9, outcomes  # 2 / 2**10 that the kernel put all ten on one process
        assert all(o in ("broken", 60) for o in outcomes), outcomes
        wait_for(lambda: f"(process {pid}) is gone; cancelling its {broken} request(s)" in "".join(proc.lines), 10,
                 "the core to cancel the dead process's requests")
        for _ in range(4):
            assert httpx.post(proc.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "a", "max_tokens": 2}).status_code == 200
        core = core_pid(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM), "".join(proc.lines)  # uvicorn re-raises SIGTERM
        proc.drain.join(10)
        wait_for(lambda: gone(core) and gone(pid), 10, "no process left")
    assert "engine core: stopping" in "".join(proc.lines)


@pytest.fixture(scope="module")
def two_api_processes(tmp_path_factory):
    """A real engine core and two API processes, A and B, each on a port of its own (`--api-servers
    2`: one exact-replay store for both), the output the core queues for one bounded at 4 KiB;
    started once for the tests below, which leave them serving. Yields the core, [(Popen, url)]
    and a function giving everything the processes have logged so far. At the end each must have
    drained (uvicorn re-raises SIGTERM) and exited, none killed, and no process is left."""
    log = tmp_path_factory.mktemp("api_processes") / "output.log"
    with open(log, "wb") as out, contextlib.ExitStack() as stack:
        saved = [os.dup(1), os.dup(2)]  # the processes inherit this file as their stdout and stderr
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            core, api = stack.enter_context(api_processes("--ctx", "1024", "--prefill-chunk", "32", "--api-servers",
                                                          "2", "--api-backlog-mb", str(4 / 1024)))
        finally:
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
        yield core, api, lambda: log.read_text(errors="replace")
    (a, _), (b, _) = api
    assert (a.returncode in (0, -signal.SIGTERM), b.returncode in (0, -signal.SIGTERM), core.proc.returncode) == \
        (True, True, 0), log.read_text(errors="replace")
    wait_for(lambda: all(gone(p.pid) for p in (core.proc, a, b)), 10, "no process left")


def test_a_stopped_api_process_never_holds_up_the_others(model, tok, two_api_processes):
    """Real processes: a core and two API processes, A and B. B streams two long replies (20
    logprobs a token: big step messages) and is SIGSTOPped; A's stream then answers the plain
    greedy text while B reads nothing: the core drops B's output past the bound and cancels B's
    requests (its metrics, its log). SIGCONT: B's streams end with a 503-coded error event, and
    B answers new requests correctly. (Every process exits at the end: `two_api_processes`.)"""
    core, ((a, a_url), (b, b_url)), output = two_api_processes

    def counted(name: str) -> float:  # A's /metrics, merged with the core's
        m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(a_url + "/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0

    aborted, behind = 'ds4_requests_aborted_total{stage="decode"}', "ds4_api_process_behind_total"
    before = counted(aborted), counted(behind)
    pool = concurrent.futures.ThreadPoolExecutor(2)  # B's streams
    started = threading.Semaphore(0)

    def long_stream(i):
        return stream_text(b_url, dict(prompt=f"Stream {i}:\n", max_tokens=900, temperature=0, ignore_eos=True,
                                       logprobs=20), started.release)

    streams = [pool.submit(long_stream, i) for i in range(2)]
    for _ in streams:
        assert started.acquire(timeout=60)
    os.kill(b.pid, signal.SIGSTOP)
    try:
        prompt = tok.encode("ROMEO:\n")
        assert stream_text(a_url, dict(prompt=prompt, max_tokens=160, temperature=0, ignore_eos=True)) == \
            (tok.decode(list(generate(model, prompt, 160))), [])
        wait_for(lambda: counted(aborted) == before[0] + 2, 30, "B's requests to be cancelled")
        assert counted(behind) == before[1] + 1
    finally:
        os.kill(b.pid, signal.SIGCONT)
    for stream in streams:
        text, errors = stream.result(timeout=60)
        assert text and [e["code"] for e in errors] == ["api_process_behind"], (text, errors)
    for url in (a_url, b_url):
        assert stream_text(url, dict(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True)) == \
            (tok.decode(list(generate(model, prompt, 8))), [])
    log = output()
    assert len(re.findall(rf"engine core: API process \d \(process {b.pid}\) is not reading its output", log)) == 1, log
    assert "this API process fell behind the engine core's output; 2 request(s) cancelled" in log, log


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city today",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_conversation_continues_the_same_on_either_api_process(two_api_processes):
    """Real processes, `--api-servers 2` (each API process on a port of its own, so the test picks
    which serves a turn: `two_api_processes`): tool loops, the call made on A, its result sent to
    B, then to A again. Exact replay is one store for both processes, so B encodes the call A
    generated from its sampled ids: the same prompt as A's, the same answer, and the cache reused
    through the call.
    (Each process had a store of its own: B rendered the call from its parsed arguments, which
    for Mantua's gave 605 prompt tokens instead of 606, and another answer. Plain replies re-encode to
    the ids sampled with the current weights, so chats without calls do not show it.)"""
    _, ((_, a_url), (_, b_url)), _ = two_api_processes

    def chat(url, messages):
        r = httpx.post(url + "/v1/chat/completions", timeout=TIMEOUT, json={
            "model": MODEL, "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 40, "temperature": 0})
        assert r.status_code == 200, r.text
        data = r.json()
        return data["choices"][0]["message"], data["usage"]

    for city in ["Mantua", "Paris", "Oslo"]:
        turn = [{"role": "user", "content": f"Weather for {city}, please."}]
        call, usage1 = chat(a_url, turn)
        assert call.get("tool_calls"), (city, call)
        turn2 = turn + [{k: call[k] for k in ("role", "content", "tool_calls")}] + [
            {"role": "tool", "tool_call_id": c["id"], "content": '{"temp_c": 18, "sky": "clear"}'}
            for c in call["tool_calls"]]
        on_b, usage_b = chat(b_url, turn2)
        on_a, usage_a = chat(a_url, turn2)
        assert (on_b.get("content"), usage_b["prompt_tokens"]) == (on_a.get("content"), usage_a["prompt_tokens"]), \
            (city, usage_b["prompt_tokens"], usage_a["prompt_tokens"])
        reused = usage_b["prompt_tokens_details"]["cached_tokens"]
        assert reused >= usage1["prompt_tokens"] + usage1["completion_tokens"] - 1, (city, reused, usage1)


def test_a_message_that_cannot_be_decoded_fails_its_request_alone(model, monkeypatch):
    """A request the core cannot decode, and a record of another the API process cannot read:
    each fails alone (500 naming the problem) while a third request beside them is answered."""
    import serve.core.process
    from serve.core import client as core_client

    decode = serve.core.process.request_from

    def request_from(data, structured):
        req = decode(data, structured)
        if req.prompt_ids[:1] == [7]:
            raise ValueError("damaged in transit")
        return req

    monkeypatch.setattr(serve.core.process, "request_from", request_from)
    Token = core_client.Token

    def token(req, *fields):  # a record of one request that cannot be read here
        if req.prompt_ids[:1] == [9]:
            raise TypeError("unreadable record")
        return Token(req, *fields)

    monkeypatch.setattr(core_client, "Token", token)
    with server(model, True) as srv:
        def complete(first):
            return post(srv, "/v1/completions", dict(prompt=[first, 20, 30, 40], max_tokens=8, temperature=0,
                                                     ignore_eos=True, return_token_ids=True))

        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            bad_request, bad_record, good = ex.map(complete, (7, 9, 11))
    assert bad_request.status_code == 500 and "could not decode" in bad_request.json()["error"]["message"]
    assert bad_record.status_code == 500 and "could not be read" in bad_record.json()["error"]["message"]
    assert good.status_code == 200
    assert good.json()["choices"][0]["token_ids"] == list(generate(model, [11, 20, 30, 40], 8))
