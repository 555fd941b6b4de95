"""The request policy through HTTP (serve/http/request_policy.py): what real clients send beyond our
own tests. Unknown fields and types are ignored and logged once; the refused few are 400s naming
them; system messages anywhere; max_tokens clamped to the room; hosted tools left out; Codex's
namespace and freeform tools; any model name; the access log; HEAD / and GET /v1/models/{id}."""
from __future__ import annotations

import json
import logging

import anthropic
import httpx
import openai
import pytest

from helpers import metric, server
from serve.http.request_policy import REFUSED, forget_logged

CTX = 1024
WEATHER = {"name": "get_weather", "description": "Get the weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_TOOL = {"type": "function", "function": WEATHER}
RESPONSES_TOOL = {"type": "function", **WEATHER}
ANTHROPIC_TOOL = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def srv(model, tok):
    with server(model, tok, ctx=CTX) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)


def post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=120)


def prompt_ids(srv, messages, tools=None):
    """What the chat endpoint renders for `messages` (its own prompt ids)."""
    body = {"model": "m", "messages": messages, "max_tokens": 1, "return_token_ids": True, **GREEDY}
    if tools:
        body["tools"] = tools
    r = post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"]


# --------------------------------------------------------------------------- unknown and refused fields
def test_unknown_fields_are_ignored_and_logged_once(srv, caplog):
    forget_logged()  # as in a fresh process (earlier tests may have sent these)
    chat = {"model": "m", "max_tokens": 2, "frobnicate_top": 1, "tools": [{**CHAT_TOOL, "frob_tool": 1}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "frob_part": 1}],
                          "frob_message": 1}]}
    responses = {"model": "m", "max_output_tokens": 2, "frobnicate_top": 1, "client_metadata": {"a": "b"},
                 "tools": [{**RESPONSES_TOOL, "frob_tool": 1}],
                 "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                           {"type": "frob_item", "x": 1}]}
    messages = {"model": "m", "max_tokens": 2, "frobnicate_top": 1, "tools": [{**ANTHROPIC_TOOL, "frob_tool": 1}],
                "messages": [{"role": "user", "frob_message": 1, "content": [
                    {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}},
                    {"type": "frob_block"}, {"type": "redacted_thinking", "data": "x"}]}]}
    with caplog.at_level(logging.WARNING, logger="ds4.serve"):
        for _ in range(2):
            for path, body in (("/v1/chat/completions", chat), ("/v1/responses", responses),
                               ("/v1/messages", messages), ("/v1/messages/count_tokens", messages)):
                r = post(srv, path, body)
                assert r.status_code == 200, r.text
    logged = [rec.getMessage() for rec in caplog.records if "ignoring" in rec.getMessage()]
    for needle in ("chat: ignoring the unknown field 'frobnicate_top'", "chat: ignoring the unknown field "
                   "'messages[].frob_message'", "chat: ignoring the unknown field 'tools[].frob_tool'",
                   "responses: ignoring the unknown field 'client_metadata'", "input items of type 'frob_item'",
                   "responses: ignoring the unknown field 'tools[].frob_tool'",
                   "anthropic: ignoring the unknown field 'frobnicate_top'",
                   "anthropic: ignoring the unknown field 'messages[].frob_message'",
                   "content blocks of type 'frob_block'", "content blocks of type 'redacted_thinking'"):
        assert sum(needle in m for m in logged) == 1, (needle, logged)  # once, though sent twice


REFUSED_CASES = [(api, field) for api, field in REFUSED]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
         "anthropic": "/v1/messages"}
ASKING = {"functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "x"}, "suffix": "end",
          "previous_response_id": "resp_1", "conversation": "conv_1", "prompt": {"id": "p"}, "background": True,
          "top_logprobs": 2, "n": 2}


def base_body(api):
    return {"chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            "completions": {"model": "m", "prompt": "hi", "max_tokens": 2},
            "responses": {"model": "m", "input": "hi", "max_output_tokens": 2},
            "anthropic": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}[api]


@pytest.mark.parametrize("api,field", REFUSED_CASES, ids=[f"{a}-{f}" for a, f in REFUSED_CASES])
def test_refused_fields_are_400s_naming_them(srv, api, field):
    r = post(srv, PATHS[api], {**base_body(api), field: ASKING[field]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and err["message"].count("not supported") == 1, err["message"]
    if api != "anthropic":
        assert err["param"] == field and err["code"] == "unsupported_parameter"


def test_input_that_cannot_be_read_is_refused(srv):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    r = post(srv, "/v1/chat/completions", {**base_body("chat"), "messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"
    r = post(srv, "/v1/messages", {**base_body("anthropic"), "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- system messages anywhere
def test_system_messages_anywhere_in_all_three_apis(srv, tok):
    """A system message after the conversation started renders where it stands, as a block of
    the user turn (chat_encoding): the same prompt from every API, and count_tokens agrees."""
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"},
            {"role": "system", "content": "Be brief."}]
    want = tok.encode_chat(conv)
    assert prompt_ids(srv, conv) == want
    r = post(srv, "/v1/responses", {"model": "m", "max_output_tokens": 1, "instructions": "S", "input": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"role": "user", "content": "again"}, {"role": "developer", "content": "Be brief."}]})
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == len(want)
    body = {"model": "m", "max_tokens": 1, "system": "S", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"}, {"role": "system", "content": "Be brief."}]}
    r = post(srv, "/v1/messages", body)
    usage = r.json()["usage"]
    assert r.status_code == 200 and usage["input_tokens"] + usage["cache_read_input_tokens"] == len(want)
    r = post(srv, "/v1/messages/count_tokens", body)
    assert r.status_code == 200 and r.json()["input_tokens"] == len(want)


# --------------------------------------------------------------------------- max_tokens
def test_max_tokens_beyond_the_room_is_clamped_in_all_three_apis(srv, oai, tok):
    text = "To be, or not to be, that is the question. " * 55
    room = CTX - len(tok.encode_chat([{"role": "user", "content": text}]))
    assert 0 < room < 200
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                    max_completion_tokens=10**6, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == room
    # Greedy, this prompt's reply runs past the room (EOS allowed, chat's is cut by it). Responses
    # and Anthropic take no ignore_eos: theirs must be that reply, cut there too.
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=32000,
                                    temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == room
    reply = r.choices[0].message.content
    r = oai.responses.create(model="m", input=text, max_output_tokens=10**6, temperature=0)
    assert (r.status, r.usage.output_tokens, r.output_text) == ("incomplete", room, reply)
    # (Anthropic's SDK streams such a max_tokens itself: sent as Claude Code sends it, raw.)
    m = post(srv, "/v1/messages", {"model": "m", "max_tokens": 32000, "messages": [{"role": "user", "content": text}],
                                   **GREEDY}).json()
    assert (m["stop_reason"], m["usage"]["output_tokens"], m["content"][0]["text"]) == ("max_tokens", room, reply)
    # A prompt that does not fit on its own is still context_length_exceeded.
    long = [{"role": "user", "content": text * 3}]
    for path, body in (("/v1/chat/completions", {"model": "m", "messages": long, "max_tokens": 5}),
                       ("/v1/responses", {"model": "m", "input": text * 3, "max_output_tokens": 5}),
                       ("/v1/messages", {"model": "m", "messages": long, "max_tokens": 5})):
        r = post(srv, path, body)
        assert r.status_code == 400, r.text
        if path != "/v1/messages":
            assert r.json()["error"]["code"] == "context_length_exceeded"
        else:
            assert "maximum context length" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- tools
def test_hosted_tools_are_left_out_of_the_prompt(srv, caplog):
    forget_logged()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    want = prompt_ids(srv, messages, [CHAT_TOOL])
    with caplog.at_level(logging.WARNING, logger="ds4.serve"):
        assert prompt_ids(srv, messages, [{"type": "web_search"}, CHAT_TOOL]) == want
        r = post(srv, "/v1/responses", {"model": "m", "max_output_tokens": 1, "input": messages[0]["content"],
                                        "tools": [{"type": "web_search", "external_web_access": False},
                                                  {"type": "file_search", "vector_store_ids": ["x"]}, RESPONSES_TOOL],
                                        "tool_choice": {"type": "web_search"}})
        assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == len(want)
        r = post(srv, "/v1/messages/count_tokens", {"model": "m", "messages": messages, "tools": [
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}, ANTHROPIC_TOOL],
            "tool_choice": {"type": "tool", "name": "web_search"}})
        assert r.status_code == 200 and r.json()["input_tokens"] == len(want)
    assert any("'web_search' tool" in rec.getMessage() for rec in caplog.records)


def _items(r):
    assert r.status_code == 200, r.text
    return r.json()["output"]


def test_namespace_tools_come_back_as_codex_dispatches_them(srv, tok):
    """Codex's MCP tools arrive in a namespace: the model is offered get_weather; its call comes
    back as a function_call with name and namespace apart, streamed the same; sent back with its
    namespace it renders as it was offered, so the turn is replayed from the cache."""
    ns = {"type": "namespace", "name": "mcp__weather", "description": "Tools in the mcp__weather namespace.",
          "tools": [{**RESPONSES_TOOL, "strict": False}]}
    body = {"model": "m", "input": "What is the weather in Paris?", "tools": [ns], "max_output_tokens": 64,
            "tool_choice": {"type": "function", "name": "get_weather", "namespace": "mcp__weather"}, **GREEDY}
    # The prompt offers the tool by its own name: the same prompt as a plain function tool.
    plain = prompt_ids(srv, [{"role": "user", "content": body["input"]}], [CHAT_TOOL])
    (call,) = [i for i in _items(post(srv, "/v1/responses", body)) if i["type"] == "function_call"]
    assert call["name"] == "get_weather" and call["namespace"] == "mcp__weather"
    assert set(json.loads(call["arguments"])) == {"city"}
    r = post(srv, "/v1/responses", {**body, "stream": True})
    done = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    items = [e["item"] for e in done if e["type"] == "response.output_item.done"]
    assert [(i["name"], i["namespace"]) for i in items if i["type"] == "function_call"] == \
        [("get_weather", "mcp__weather")]
    follow = {**body, "tool_choice": "auto", "max_output_tokens": 4, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": body["input"]}]},
        {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]}
    r = post(srv, "/v1/responses", follow)
    usage = r.json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= len(plain)
    # Two namespaces with a tool of one name: each is offered by its flat name, and comes back apart.
    other = {**ns, "name": "mcp__backup"}
    r = post(srv, "/v1/responses", {**body, "tools": [ns, other],
                                    "tool_choice": {"type": "function", "name": "get_weather",
                                                    "namespace": "mcp__backup"}})
    (call,) = [i for i in _items(r) if i["type"] == "function_call"]
    assert (call["name"], call["namespace"]) == ("get_weather", "mcp__backup")


def test_a_freeform_tool_call_is_a_custom_tool_call(srv):
    tool = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
    body = {"model": "m", "input": "Fix the bug.", "tools": [tool], "max_output_tokens": 48,
            "tool_choice": {"type": "custom", "name": "apply_patch"}, **GREEDY}
    (call,) = [i for i in _items(post(srv, "/v1/responses", body)) if i["type"] == "custom_tool_call"]
    assert call["name"] == "apply_patch" and isinstance(call["input"], str) and "namespace" not in call
    # Sent back (the call and its output), the conversation renders and goes on.
    r = post(srv, "/v1/responses", {**body, "tool_choice": "auto", "max_output_tokens": 2, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the bug."}]},
        {"type": "custom_tool_call", "call_id": call["call_id"], "name": "apply_patch", "input": call["input"]},
        {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Done."}]})
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------- model names
def test_any_model_name_is_answered_and_echoed(srv, oai, claude):
    r = oai.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert r.model == "gpt-17"
    assert oai.completions.create(model="x/y", prompt="hi", max_tokens=1).model == "x/y"
    assert oai.responses.create(model="claude-haiku", input="hi", max_output_tokens=1).model == "claude-haiku"
    assert claude.messages.create(model="claude-opus-9", max_tokens=1,
                                  messages=[{"role": "user", "content": "hi"}]).model == "claude-opus-9"
    assert [m.id for m in oai.models.list()] == ["ds4-default"]
    assert httpx.get(srv.url + "/v1/models/anything").json()["id"] == "anything"
    assert httpx.head(srv.url + "/").status_code == 200 and httpx.get(srv.url + "/").status_code == 200


def test_strict_model_names_and_served_names(model, tok):
    with server(model, tok, ctx=CTX, strict_model_name=True, served_model_names=("deepseek-v4",)) as s:
        ok = httpx.post(s.url + "/v1/chat/completions", json={**base_body("chat"), "model": "deepseek-v4"})
        assert ok.status_code == 200
        r = httpx.post(s.url + "/v1/chat/completions", json={**base_body("chat"), "model": "gpt-17"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
        listed = [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]]
        assert listed == ["ds4-default", "deepseek-v4"]
        assert httpx.get(s.url + "/v1/models/deepseek-v4").status_code == 200
        missing = httpx.get(s.url + "/v1/models/gpt-17")
        assert missing.status_code == 404
        for refusal in (r, missing):  # the error names every name the server answers to
            assert all(f"'{name}'" in refusal.json()["error"]["message"] for name in listed), refusal.text


def test_a_path_without_v1_is_told_the_path_with_it(srv):
    """An OpenAI client whose base URL lacks /v1, or an Anthropic client whose base URL has it,
    gets a 404 naming the path it meant."""
    for method, path, meant in [("POST", "/chat/completions", "/v1/chat/completions"), ("GET", "/models", "/v1/models"),
                                ("GET", "/models/ds4-default", "/v1/models/ds4-default"),
                                ("POST", "/v1/v1/messages", "/v1/messages"), ("POST", "/responses", "/v1/responses")]:
        r = httpx.request(method, srv.url + path, json=base_body("chat"))
        assert r.status_code == 404 and f"did you mean {meant}?" in r.json()["error"]["message"], (path, r.text)
    r = httpx.get(srv.url + "/v1/nothing")
    assert r.status_code == 404 and "did you mean" not in r.text


# --------------------------------------------------------------------------- the access log
def test_every_request_has_an_access_log_line(srv, model, tok, caplog):
    with caplog.at_level(logging.INFO, logger="ds4.serve"):
        r = post(srv, "/v1/chat/completions", {"model": "m", "messages": "nope"})
        assert r.status_code == 400
        assert httpx.get(srv.url + "/v1/nothing").status_code == 404
        assert post(srv, "/v1/chat/completions", base_body("chat")).status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if '"POST /v1/chat/completions"' in rec.getMessage()
             or '"GET /v1/nothing"' in rec.getMessage()]
    assert any(" 400 " in l and "error=" in l and "'messages' must be" in l and "127.0.0.1:" in l for l in lines)
    assert any(" 404 " in l for l in lines)
    assert any(" 200 " in l and "prompt_tokens=" in l for l in lines)
    before = metric(srv, "ds4_requests_total", endpoint="/v1/chat/completions", code="400")
    assert before >= 1
    with server(model, tok, ctx=CTX, access_log=False) as quiet:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ds4.serve"):
            httpx.post(quiet.url + "/v1/chat/completions", json={"model": "m", "messages": "nope"})
        assert not [rec for rec in caplog.records if "/v1/chat/completions" in rec.getMessage()]


def test_a_function_call_output_without_a_call_id_is_a_tool_result(srv):
    """Codex 0.169 sends its own tools' outputs with no call_id (`{"type": "function_call_output",
    "name": "goal_objective", "namespace": "agent", "output": ...}`): the model reads it as the
    same tool result with an id would be (ids are not in the prompt), and the turn is answered.
    A call_id that is there but not a string is still the client's error."""
    def body(**output):
        return {"model": "m", "max_output_tokens": 4, "temperature": 0, "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
            {"type": "function_call_output", "name": "goal_objective", "namespace": "agent", "output": "find the weather",
             **output}]}

    plain = post(srv, "/v1/responses/render", body(call_id="call_1")).json()["token_ids"]
    assert post(srv, "/v1/responses/render", body()).json()["token_ids"] == plain
    r = post(srv, "/v1/responses", body())
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
    assert r.json()["usage"]["input_tokens"] == len(plain) and r.json()["usage"]["output_tokens"] > 0
    r = httpx.post(srv.url + "/v1/responses", json=body(call_id=7), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].call_id"
