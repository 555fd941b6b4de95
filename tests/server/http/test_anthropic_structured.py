"""Anthropic structured outputs: `output_config.format` ({"type": "json_schema", "schema": ...})
through the official `anthropic` SDK, streamed and not, with thinking on and off, and the SDK's
own `messages.parse` (a pydantic type). The reply's text is JSON the schema accepts: checked with
`jsonschema`, an independent validator, not the grammar that wrote it. Bad formats are 400s in
Anthropic's error shape naming the field. (Claude Code's first request in interactive mode is one.)
"""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pydantic
import pytest

from helpers import server

MODEL = "ds4-default"
SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string", "maxLength": 40}, "mood": {"enum": ["merry", "sad"]},
                         "lines": {"type": "integer", "minimum": 1}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "mood", "lines", "tags"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Name this play and its mood."}]


@pytest.fixture(scope="module")
def srv(model):
    with server(model, ctx=1024, max_batch=4) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120)


def fmt(schema=SCHEMA):
    return {"format": {"type": "json_schema", "schema": schema}}


def text_of(message) -> str:
    blocks = [b for b in message.content if b.type == "text"]
    assert len(blocks) == 1 and not any(b.type == "tool_use" for b in message.content)
    return blocks[0].text


@pytest.mark.parametrize("temperature", [0, 1.0])
@pytest.mark.parametrize("max_tokens", [80, 40])
def test_the_reply_is_json_the_schema_accepts(client, temperature, max_tokens):
    """Within the budget even when it is tight (the schema's shortest value takes 38 tokens of
    this tokenizer: the grammar closes the value in time)."""
    m = client.messages.create(model=MODEL, max_tokens=max_tokens, messages=ASK, output_config=fmt(),
                               extra_body={"temperature": temperature})
    jsonschema.validate(json.loads(text_of(m)), SCHEMA)
    assert m.stop_reason == "end_turn"


def test_a_budget_below_the_shortest_value_ends_max_tokens(client):
    m = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, output_config=fmt(),
                               extra_body={"temperature": 0})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 16


def test_streamed_equals_the_deltas_and_validates(client):
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ASK, output_config=fmt(),
                                extra_body={"temperature": 0}) as stream:
        deltas = "".join(e.delta.text for e in stream if e.type == "content_block_delta" and e.delta.type == "text_delta")
        final = stream.get_final_message()
    assert deltas == text_of(final)
    jsonschema.validate(json.loads(deltas), SCHEMA)
    plain = client.messages.create(model=MODEL, max_tokens=60, messages=ASK, output_config=fmt(),
                                   extra_body={"temperature": 0})
    assert text_of(plain) == deltas  # greedy: streamed and not give the same reply


def test_with_thinking_the_format_holds_after_the_reasoning(client):
    m = client.messages.create(model=MODEL, max_tokens=80, messages=ASK, output_config=fmt(),
                               thinking={"type": "enabled", "budget_tokens": 32}, extra_body={"temperature": 0})
    jsonschema.validate(json.loads(text_of(m)), SCHEMA)


def test_the_sdk_parse_helper_gets_its_type(client):
    class Verdict(pydantic.BaseModel):
        guilty: bool
        reason: str

    m = client.messages.parse(model=MODEL, max_tokens=40, messages=ASK, output_format=Verdict,
                              extra_body={"temperature": 0})
    assert isinstance(m.parsed_output, Verdict)


def test_a_tool_offered_with_auto_still_gets_the_format(client):
    """As chat's response_format: with tool_choice auto the format holds (no call is made)."""
    tools = [{"name": "get_weather", "description": "Weather in a city.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    m = client.messages.create(model=MODEL, max_tokens=60, tools=tools, output_config=fmt(),
                               messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                               extra_body={"temperature": 0})
    jsonschema.validate(json.loads(text_of(m)), SCHEMA)


@pytest.mark.parametrize("output_config, field", [
    ({"format": {"type": "json_object"}}, "output_config.format.type"),
    ({"format": {"schema": SCHEMA}}, "output_config.format.type"),
    ({"format": {"type": "json_schema"}}, "output_config.format.schema"),
    ({"format": {"type": "json_schema", "schema": ["not", "a", "schema"]}}, "output_config.format.schema"),
    ({"format": "json"}, "output_config.format"),
    # What the grammar cannot enforce is refused, never silently dropped:
    ({"format": {"type": "json_schema", "schema": {"type": "string", "format": "no-such-format"}}},
     "output_config.format.schema"),
    ({"format": {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}},
     "output_config.format.schema"),
    ({"format": {"type": "json_schema", "schema": {"$ref": "#/$defs/missing"}}}, "output_config.format.schema"),
])
def test_bad_formats_are_400s_naming_the_field(srv, output_config, field):
    r = httpx.post(srv.url + "/v1/messages", json={"model": MODEL, "max_tokens": 20, "messages": ASK,
                                                   "output_config": output_config})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"], body
    # and the server still answers
    ok = httpx.post(srv.url + "/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": ASK,
                                                    "output_config": fmt()}, timeout=120)
    assert ok.status_code == 200


def test_count_tokens_takes_the_format(srv):
    """Claude Code counts tokens with the same body: the format is accepted there (not compiled)."""
    r = httpx.post(srv.url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": ASK,
                                                                "output_config": fmt()})
    plain = httpx.post(srv.url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": ASK})
    assert r.status_code == 200 and r.json() == plain.json()
