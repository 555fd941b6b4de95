"""Bad input is never a 500: seeded random bodies against every POST route of the server.

Bodies are valid requests with fields mutated (a random type, NaN, Infinity, huge numbers, lone
surrogates, deep nesting, unknown keys, hostile sizes), random JSON values, truncated JSON, raw bytes. Each
must be answered below 500, in the error shape of the API that received it; afterwards the
server still answers a normal request on every route.
"""
from __future__ import annotations

import json
import random

import httpx
import pytest

from helpers import server

MODEL = "ds4-default"
BODIES_PER_ROUTE = 60
SEED = 20240613

TOOL = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}
# A valid request per route (small max_tokens: a body that gets through generates little).
VALID = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                             "temperature": 0.5, "n": 2, "logprobs": True, "top_logprobs": 2, "seed": 1,
                             "presence_penalty": 0.1, "logit_bias": {"5": 1}, "stop": ["x"], "tools": [TOOL],
                             "tool_choice": "auto", "response_format": {"type": "json_object"}},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 1, "n": 2,
                        "best_of": 2, "frequency_penalty": 0.1, "repetition_penalty": 1.1, "min_tokens": 1,
                        "stop_token_ids": [3]},
    "/v1/responses": {"model": MODEL, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2,
                      "instructions": "be brief", "temperature": 0.5,
                      "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}},
    "/v1/messages": {"model": MODEL, "max_tokens": 2, "system": "be brief",
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "top_k": 5},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [5, 6]},
}
# The render routes (a router's) read the request of their API: the same bodies.
VALID.update({route + "/render": VALID[route] for route in ("/v1/chat/completions", "/v1/completions", "/v1/responses")})
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")


@pytest.fixture(scope="module")
def srv():
    with server(ctx=1024, prefill_chunk=256) as s:
        yield s


def test_every_post_route_is_fuzzed(srv):
    routes = {r.path for r in srv.app.routes if "POST" in (getattr(r, "methods", None) or ())}
    assert routes == set(VALID), "a POST route without a fuzzed body: add it to VALID"


def _nested(rng: random.Random) -> object:
    depth = rng.choice([50, 500, 5000])
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    return json.loads(opener * min(depth, 500) + "1" + closer * min(depth, 500)) if depth <= 500 else \
        opener * depth + "1" + closer * depth  # as text: deeper than json.loads goes


def _value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(14)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2, 7, 2**31, -2**63 - 1, 2**64, 10**30, -10**300])
    if kind == 3:
        return rng.choice([0.5, -0.0, 1e308, -1e-320, 3.7, 1e20])
    if kind == 4:
        return rng.choice([float("nan"), float("inf"), float("-inf")])
    if kind == 5:
        return rng.choice(["", "x", "hi there", "\ud800", "a\udfffb", "\x00", "é" * 50, "1", "null", "<think>"])
    if kind == 6 and depth < 3:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7 and depth < 3:
        return {rng.choice(["type", "text", "role", "content", "name", "x", "\ud801"]): _value(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    if kind == 8:
        return _nested(rng)
    if kind == 9:
        return rng.choice(["user", "assistant", "system", "tool", "function", "text", "json_schema", "required"])
    if kind == 10:
        return [rng.randrange(-5, 2000) for _ in range(rng.randrange(1, 6))]
    if kind == 11:  # hostile sizes: past every bound of serve.http.request_policy
        return rng.choice([["s"] * 70_000, "x" * 300_000, list(range(30_000)), {str(i): 1 for i in range(5000)},
                           [{"type": "function", "function": {"name": f"f{i}"}} for i in range(600)]])
    return rng.choice([{}, [], "", 0])


def _mutate(rng: random.Random, value: object, depth: int = 0) -> object:
    """`value` with one part (at any depth) replaced by a random value."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        out = dict(value)
        out[key] = _mutate(rng, value[key], depth + 1)
        if rng.random() < 0.1:
            out[rng.choice(["frobnicate", "n", "echo", "\udc00"])] = _value(rng)
        return out
    if isinstance(value, list) and value and rng.random() < 0.7:
        out = list(value)
        i = rng.randrange(len(out))
        out[i] = _mutate(rng, out[i], depth + 1)
        return out
    return _value(rng)


def _encode(rng: random.Random, body: object) -> bytes:
    """JSON text of `body` (NaN/Infinity as Python writes them, surrogates escaped), sometimes cut."""
    if isinstance(body, str) and body.startswith(("[", '{"a":')):
        text = body  # nesting deeper than a parser recurses
    else:
        text = json.dumps(body)  # ensure_ascii: a lone surrogate becomes "\ud800", as a client would send it
    data = text.encode()
    if rng.random() < 0.12:
        data = data[:rng.randrange(len(data) + 1)]  # truncated
    elif rng.random() < 0.03:
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))  # not even text
    return data


def bodies(rng: random.Random, route: str, count: int):
    for _ in range(count):
        r = rng.random()
        if r < 0.75:
            body = VALID[route]
            for _ in range(rng.randint(1, 3)):
                body = _mutate(rng, body)
        elif r < 0.9:
            body = _value(rng)  # not an object at all, mostly
        else:
            body = {k: _value(rng) for k in rng.sample(sorted(VALID[route]), k=min(3, len(VALID[route])))}
        yield _encode(rng, body)


def _greedy(route: str) -> dict:
    """The valid request of `route`, greedy where it samples: its answer is the same every time."""
    return {**VALID[route], "temperature": 0} if "max_tokens" in VALID[route] or route == "/v1/responses" \
        else VALID[route]


def test_fuzzed_bodies_never_get_a_5xx_and_the_server_stays_up(srv):
    rng = random.Random(SEED)
    seen = {}
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        before = {route: _answer(route, client.post(route, json=_greedy(route)).json()) for route in VALID}
        for route in sorted(VALID):
            for data in bodies(rng, route, BODIES_PER_ROUTE):
                r = client.post(route, content=data, headers={"content-type": "application/json"})
                assert r.status_code < 500, (route, data[:300], r.text[:500])
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
                if r.status_code >= 400:
                    err = r.json()
                    if route in ANTHROPIC:
                        assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, err
                    else:
                        assert set(err["error"]) == {"message", "type", "param", "code"}, err
        assert seen.get(400, 0) > len(VALID) * BODIES_PER_ROUTE // 2  # mostly rejected ...
        assert seen.get(200, 0) > 0  # ... but not all: the mutations leave some valid requests
        # Alive afterwards: every route answers its valid request as it did before.
        for route in VALID:
            r = client.post(route, json=_greedy(route))
            assert r.status_code == 200, (route, r.text[:500])
            assert _answer(route, r.json()) == before[route], route
        assert client.get("/health").json() == {"status": "ok"}


# --------------------------------------------------------------------------- the request policy
UNKNOWN_NAMES = ["cache_control", "citations", "annotations", "allowed_callers", "defer_loading", "eager_input_streaming",
                 "input_examples", "status", "id", "x_future_field", "context_management", "service_tier"]
HOSTED = {"/v1/chat/completions": [{"type": "web_search"}, {"type": "web_search_preview", "search_context_size": "low"}],
          "/v1/responses": [{"type": "web_search", "external_web_access": False}, {"type": "file_search"},
                            {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
                            {"type": "local_shell"}, {"type": "tool_search"}],
          "/v1/messages": [{"type": "web_search_20250305", "name": "web_search"},
                           {"type": "code_execution_20250825", "name": "code_execution"}]}
UNKNOWN_BLOCKS = {"/v1/chat/completions": {"type": "frob_part", "frob": 1},
                  "/v1/responses": {"type": "frob_item", "frob": 1},
                  "/v1/messages": {"type": "frob_block", "frob": 1}}
DATA_KEYS = {"tools", "logit_bias", "metadata", "parameters", "input_schema", "schema", "format", "text"}
POLICY_ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")


def _sprinkle(rng: random.Random, value: object, route: str, depth: int = 0) -> object:
    """`value` with unknown fields added to its objects, unknown block/item types added to its
    content arrays and hosted tools added to its tools: nothing that may change the answer."""
    if isinstance(value, dict):
        # (Maps and schemas are data, not objects with fields: left alone.)
        out = {k: _sprinkle(rng, v, route, depth + 1) if k not in DATA_KEYS else v for k, v in value.items()}
        if rng.random() < 0.5:
            out[rng.choice(UNKNOWN_NAMES)] = rng.choice([1, "x", None, True, {"k": "v"}, [1, 2], {"type": "ephemeral"}])
        if "tools" in out and rng.random() < 0.7:
            hosted = HOSTED.get(route.replace("/count_tokens", ""), [])
            out["tools"] = list(out["tools"]) + rng.sample(hosted, k=min(len(hosted), rng.randint(1, 2)))
        return out
    if isinstance(value, list):
        out = [_sprinkle(rng, v, route, depth + 1) for v in value]
        # Content arrays (depth 3: body, messages, message, content) and Responses' input items (1).
        if depth in ((1, 3) if route == "/v1/responses" else (3,)) and rng.random() < 0.5 \
                and all(isinstance(v, dict) for v in value):
            out.insert(rng.randrange(len(out) + 1), dict(UNKNOWN_BLOCKS[route.replace("/count_tokens", "")]))
        return out
    return value


def _answer(route: str, body: dict) -> object:
    """What a client reads of a 200 answer, less what differs between any two requests (ids,
    times, how much of the prompt was cached): the text, calls, logprobs, finish and token counts."""
    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in ("id", "call_id")}
        return [strip(x) for x in v] if isinstance(v, list) else v

    if route in ("/v1/chat/completions", "/v1/completions"):
        u = body["usage"]
        return strip(body["choices"]), u["prompt_tokens"], u["completion_tokens"]
    if route == "/v1/responses":
        u = body["usage"]
        return body["status"], strip(body["output"]), u["input_tokens"], u["output_tokens"]
    if route == "/v1/messages":
        u = body["usage"]
        prompt = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
        return strip(body["content"]), body["stop_reason"], prompt, u["output_tokens"]
    return body


def test_unknown_fields_types_and_hosted_tools_never_change_a_valid_answer(srv):
    """Sprinkled with what future clients may send, every valid request gets the answer it gets
    without them: the same prompt (token counts) and the same output (greedy, or seeded)."""
    rng = random.Random(SEED + 1)
    greedy = {"temperature": 0}
    base = {**VALID, "/v1/chat/completions": {**VALID["/v1/chat/completions"], "response_format": None,
                                              "messages": [{"role": "user", "content": [{"type": "text",
                                                                                         "text": "hi"}]}]},
            "/v1/messages": {**VALID["/v1/messages"], **greedy,
                             "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
            "/v1/responses": {**VALID["/v1/responses"], **greedy, "tools": [{"type": "function", "name": "f"}],
                              "input": [{"type": "message", "role": "user",
                                         "content": [{"type": "input_text", "text": "hi"}]}]}}
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        for route in POLICY_ROUTES:
            r = client.post(route, json=base[route])
            assert r.status_code == 200, (route, r.text[:500])
            want = _answer(route, r.json())
            for i in range(25):
                body = _sprinkle(rng, base[route], route)
                r = client.post(route, json=body)
                assert r.status_code == 200, (route, json.dumps(body)[:600], r.text[:500])
                assert _answer(route, r.json()) == want, (f"seed {SEED + 1}, {route} body {i}", json.dumps(body)[:600])
