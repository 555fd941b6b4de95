"""Everything a client sends is bounded before it costs anything (serve/http/request_policy.py LIMITS),
and thinking's second phase is never refused for a queue others filled. Through HTTP: each
hostile request gets a 4xx naming what is too large, a stream running beside them all ends with
exactly the tokens it gets alone, and a normal request afterwards is served."""
from __future__ import annotations

import contextlib
import json
import socket
import threading

import httpx
import pytest

from serve.http.request_policy import LIMITS
from helpers import held_prefill, server, wait_for

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(model, tok):
    with server(model, tok, ctx=1024) as s:
        yield s


def _raw_request(srv, raw: bytes) -> bytes:
    """`raw` on a fresh connection; what the server answered before closing (or within 30 s)."""
    with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):  # it answered and closed mid-send
            pass
        data = b""
        with contextlib.suppress(ConnectionResetError, socket.timeout):
            while chunk := sock.recv(65536):
                data += chunk
        return data


@pytest.mark.parametrize("headers", [b"X-Big: " + b"a" * (1 << 20) + b"\r\n",
                                     b"".join(b"X-%d: v\r\n" % i for i in range(20_000))],
                         ids=["one 1 MiB header", "20,000 headers"])
def test_oversized_headers_are_refused_by_the_http_parser(srv, headers):
    """Headers are bounded before the app sees them (uvicorn's h11 parser refuses past 16 KB);
    the server then answers the next request."""
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n")
    tail = b"Content-Length: %d\r\n\r\n" % len(body) + body
    assert _raw_request(srv, head + headers + tail).startswith(b"HTTP/1.1 400 ")
    assert _raw_request(srv, head + tail).startswith(b"HTTP/1.1 200 ")


def _stream_ids(url: str, out: list) -> None:
    body = {"model": "m", "prompt": "To be, or not to be", "max_tokens": 96, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out += json.loads(line[6:])["choices"][0].get("token_ids") or []


HOSTILE = [
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": HI,
                      "stop_sequences": [f"s{i}" for i in range(200_000)]}, "stop_sequences"),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": HI, "stop": ["x" * 5000]}, "stop"),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": HI,
                              "logit_bias": {str(i % 1000) + "0" * (i // 1000): 1 for i in range(5000)}}, "logit_bias"),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": HI,
                              "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(600)]},
     "tools"),
    ("/v1/responses", {"model": "m", "max_output_tokens": 4, "input": "hi", "tools": [
        {"type": "function", "name": "f", "description": "d" * 300_000}]}, "tools[0]"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": HI * 20_001}, "messages"),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"}] * 20_001}]}, "messages[0].content"),
]


def test_hostile_sizes_are_400s_and_a_stream_beside_them_is_untouched(srv, model, tok):
    alone: list[int] = []
    _stream_ids(srv.url, alone)
    beside: list[int] = []
    t = threading.Thread(target=_stream_ids, args=(srv.url, beside))
    t.start()
    for path, body, param in HOSTILE:
        r = httpx.post(srv.url + path, json=body, timeout=120)
        assert r.status_code == 400, (param, r.text[:300])
        message = r.json()["error"]["message"]
        assert param in message and "at most" in message, message
    # A body of more values than any client sends is refused on its bytes, before parsing.
    raw = b'{"model": "m", "prompt": [' + b"0," * LIMITS["array_items"] + b"0]}"
    r = httpx.post(srv.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code == 400 and "values" in r.json()["error"]["message"]
    t.join(300)
    assert beside == alone and len(alone) == 96
    assert httpx.post(srv.url + "/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 2}
                      ).status_code == 200


def test_bounds_sit_above_what_the_clients_send():
    """The recorded Claude Code and Codex bodies (tests/data/clients) are far inside every bound."""
    from pathlib import Path

    for path in (Path(__file__).resolve().parents[2] / "data" / "clients").glob("*.json"):
        body = json.loads(path.read_text())["body"]
        tools = body.get("tools") or []
        assert len(tools) * 10 <= LIMITS["tools"]
        assert max((len(json.dumps(t)) for t in tools), default=0) * 10 <= LIMITS["tool_schema_bytes"]
        assert len(body.get("messages") or body.get("input") or []) * 100 <= LIMITS["messages"]


def test_thinkings_second_phase_goes_first(model, tok):
    """A forced tool call in thinking mode runs in two phases; the second is queued when the
    reasoning ends. It goes to the front (before requests that arrived meanwhile), and a full
    queue never refuses it: its request was admitted when it arrived."""
    # A long prompt in small chunks, its first held: the fillers are queued while it is prefilled.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    with server(model, tok, ctx=1024, max_queue=4, max_batch=1, max_sessions=2, prefill_chunk=16) as s:
        engine = s.app.state.engine
        finished, results = [], {}  # the order the answers came back in (one request runs at a time)

        def post(name, path, body):
            results[name] = httpx.post(s.url + path, json=body, timeout=300)
            finished.append(name)

        forced = threading.Thread(target=post, args=("forced", "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": "Hello! " * 60}], "tools": tools,
            "tool_choice": "required", "thinking": {"type": "enabled"}, "max_tokens": 200, "temperature": 0}))
        fillers = [threading.Thread(target=post, args=(f"filler{i}", "/v1/completions", {
            "model": "m", "prompt": f"To be {i}", "max_tokens": 60, "ignore_eos": True})) for i in range(2)]
        with held_prefill(engine) as gate:
            forced.start()
            gate.wait_entered(1)
            for i, f in enumerate(fillers):
                f.start()
                wait_for(lambda: engine.queue_depth() == i + 1, what=f"filler {i} queued")
        for t in [forced, *fillers]:
            t.join(300)
        r = results["forced"]
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["reasoning_content"] and choice["message"]["tool_calls"]
        assert all(results[f"filler{i}"].status_code == 200 for i in range(2))
        # At most the filler the engine took as the reasoning ended ran before the second phase.
        assert finished.index("forced") < finished.index("filler1"), finished
