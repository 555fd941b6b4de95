"""Strict function tools under tool_choice "auto": the reply is text, or text then a DSML call
block whose strict calls follow their schemas. The grammar is checked against what
`chat_encoding` renders; the server through the official SDKs, every returned call validated with
`jsonschema` against the tool's own parameters."""
from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import jsonschema
import openai
import pytest

from ds4_torch.chat_encoding import render_assistant_completion
from ds4_torch.structured import StructuredOutputs
from serve.http.chat import ChatRequest, ToolChoice, strict_tool_grammar
from serve.http.protocol import APIError

from helpers import metric, server

MODEL = "ds4-default"
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]

# Keywords the tiny model would not honour by itself: enum values it never writes, a narrow
# integer range, a nested object, an array.
SCHEMAS = {
    "enum": {"type": "object", "properties": {"city": {"type": "string"},
                                              "units": {"type": "string", "enum": ["metric", "imperial"]}},
             "required": ["city", "units"], "additionalProperties": False},
    "integer": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                "required": ["city", "days"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"where": {
        "type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"], "additionalProperties": False}}, "required": ["where"]},
    "array": {"type": "object", "properties": {"cities": {"type": "array", "items": {"type": "string"},
                                                          "minItems": 1, "maxItems": 3},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 2}},
              "required": ["cities", "days"]},
}


def weather(schema, strict=True):
    return {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                             "parameters": schema, "strict": strict}}


TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


# --------------------------------------------------------------------------- the grammar itself
@pytest.fixture(scope="module")
def state(model, tok):
    so = StructuredOutputs(tok, model.config.vocab_size)
    return SimpleNamespace(engine=SimpleNamespace(structured_outputs=lambda: so))


@pytest.fixture(scope="module")
def auto_grammar(state, tok):
    so = state.engine.structured_outputs()
    grammar = strict_tool_grammar(state, ChatRequest(messages=[], tools=[weather(SCHEMAS["integer"]), TIME]))
    hf = getattr(tok, "hf", tok)

    def run(text: str) -> str:
        """'rejected', 'open' (a prefix), 'eos' (complete, EOS may follow) or 'stopped' (complete, nothing may follow)."""
        m = grammar.constraint().matcher
        for t in hf.encode(text, add_special_tokens=False):
            if not m.consume_token(t):
                return "rejected"
        if m.is_stopped():
            return "stopped"
        return "eos" if m.validate_tokens([so.eos]) == 1 else "open"
    return run


def rendered(*calls, content=""):
    return render_assistant_completion({"role": "assistant", "content": content, "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls]})


def test_auto_grammar_allows_text_and_calls_as_the_encoding_renders_them(auto_grammar):
    assert auto_grammar("It is sunny, 2 < 3 and a </b> tag is fine.") == "eos"
    assert auto_grammar("") == "eos"
    good = ("get_weather", {"city": "Paris", "days": 2})
    assert auto_grammar(rendered(good)) == "stopped"  # the block closed: nothing may follow it
    assert auto_grammar(rendered(good, content="Let me look.")) == "stopped"
    # Parallel calls, a non-strict tool with any parameters (text and JSON) among them.
    assert auto_grammar(rendered(good, ("get_time", {"city": "Oslo", "tz": [1, 2]}), ("get_time", {}))) == "stopped"


def test_a_strict_tool_with_only_optional_parameters_can_be_called_with_none(state, tok):
    """The encoding renders a call without parameters with an empty line in it: the grammar of a
    strict tool whose parameters are all optional must take that, and a call with them."""
    optional = weather({"type": "object", "properties": {"city": {"type": "string"}}, "additionalProperties": False})
    grammar = strict_tool_grammar(state, ChatRequest(messages=[], tools=[optional]))
    hf = getattr(tok, "hf", tok)
    for args in ({}, {"city": "Oslo"}):
        m = grammar.constraint().matcher
        assert all(m.consume_token(t) for t in hf.encode(rendered(("get_weather", args)), add_special_tokens=False))
        assert m.is_stopped()


def test_auto_grammar_rejects_markup_in_text_bad_arguments_and_unknown_tools(auto_grammar):
    # Tags spelled in plain tokens inside the text (the parser would read them as markup), and
    # a tag token without the blank line before the block.
    assert auto_grammar("Sure <｜DSML") == "rejected"
    assert auto_grammar("Done <｜end") == "rejected"
    assert auto_grammar("x </｜DSML") == "rejected"
    assert auto_grammar("Sure <｜DSML｜tool_calls>") == "rejected"
    assert auto_grammar(rendered(("get_weather", {"city": "Paris", "days": 4}))) == "rejected"  # maximum 3
    assert auto_grammar(rendered(("get_weather", {"city": "Paris"}))) == "rejected"  # days is required
    assert auto_grammar(rendered(("get_weather", {"city": "Paris", "days": 1, "x": 1}))) == "rejected"
    assert auto_grammar(rendered(("get_news", {}))) == "rejected"
    assert auto_grammar(rendered(("get_weather", {"city": "Paris", "days": 1})) + "More text") == "rejected"


def test_forced_and_auto_share_the_schema_check(state):
    bad_schema = {"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1}
    for tools, choice, where in (([TIME, weather(bad_schema)], ToolChoice(), "tools[1]"),
                                 ([weather(bad_schema)], ToolChoice("required"), "tools[0]")):
        with pytest.raises(APIError) as e:
            strict_tool_grammar(state, ChatRequest(messages=[], tools=tools, tool_choice=choice))
        assert e.value.status == 400 and e.value.param == f"{where}.function.parameters"
        assert "minProperties" in e.value.message
    # Nothing strict, or a response format with auto (the format holds): no tool grammar.
    assert strict_tool_grammar(state, ChatRequest(messages=[], tools=[TIME])) is None
    fmt = object()
    assert strict_tool_grammar(state, ChatRequest(messages=[], tools=[weather(bad_schema)], grammar=fmt)) is fmt


# --------------------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def srv(model, tok):
    with server(model, tok, ctx=1024, prefill_chunk=8) as s:
        yield s


@pytest.fixture
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(choices, schemas, n_choices) -> int:
    """All `n_choices` choices are there; every call validates against its tool's schema; no markup
    leaks into content; the count of calls."""
    assert [c.index for c in choices] == list(range(n_choices))
    n = 0
    for c in choices:
        assert "｜DSML｜" not in (c.message.content or ""), c.message.content
        for call in c.message.tool_calls or []:
            assert call.function.name in schemas
            if schemas[call.function.name] is not None:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            n += 1
        # A sampled text reply may also run into max_tokens; a call always ends the turn.
        assert c.finish_reason in (("tool_calls",) if c.message.tool_calls else ("stop", "length")), c
    return n


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_auto_strict_calls_validate_at_temperature_1(oai, name):
    schema = SCHEMAS[name]
    calls = 0
    for seed, prompt in enumerate(["What is the weather in Paris?", "Will it rain in Tokyo this week?"]):
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                        tools=[weather(schema)], temperature=1.0, seed=seed, n=6, max_tokens=100)
        calls += check_calls(r.choices, {"get_weather": schema}, 6)
    assert calls > 0


def test_strict_and_non_strict_tools_mixed(oai):
    schema = SCHEMAS["enum"]
    r = oai.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[TIME, weather(schema)],
                                    tool_choice="auto", temperature=1.0, seed=5, n=8, max_tokens=100)
    assert check_calls(r.choices, {"get_weather": schema, "get_time": None}, 8) > 0


def test_plain_text_replies_still_work(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello! Who are you?"}],
                                    tools=[weather(SCHEMAS["integer"])], temperature=1.0, seed=1, n=6, max_tokens=80)
    check_calls(r.choices, {"get_weather": SCHEMAS["integer"]}, 6)
    texts = [c for c in r.choices if not c.message.tool_calls]
    assert texts and all(c.message.content.strip() and "<｜" not in c.message.content for c in texts)


def test_streaming_equals_non_streaming(oai):
    kw = dict(model=MODEL, messages=WEATHER_Q, tools=[weather(SCHEMAS["nested"])], temperature=1.0, seed=7,
              max_tokens=100)
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.message.tool_calls
    content, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                calls.setdefault(d.index, ["", ""])
                calls[d.index][0] += d.function.name or ""
                calls[d.index][1] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert content == (whole.message.content or "") and finish == whole.finish_reason == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [[t.function.name, t.function.arguments]
                                                 for t in whole.message.tool_calls]


def test_thinking_mode_reasons_then_calls_strictly(oai):
    schema = SCHEMAS["integer"]
    r = oai.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[weather(schema)], temperature=1.0,
                                    seed=2, n=4, max_tokens=160, extra_body={"thinking": {"type": "enabled"}})
    assert check_calls(r.choices, {"get_weather": schema}, 4) > 0
    assert all(c.message.model_extra.get("reasoning_content") for c in r.choices)


def test_a_reply_cut_by_max_tokens_mid_call_is_length(srv, oai):
    r = oai.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[weather(SCHEMAS["enum"])],
                                    temperature=1.0, seed=0, n=4, max_tokens=8)
    assert len(r.choices) == 4
    assert all(c.finish_reason == "length" and not c.message.tool_calls for c in r.choices)
    # A call was begun and cut: its markup does not reach the text.
    assert all("｜DSML｜" not in (c.message.content or "") for c in r.choices)
    assert metric(srv, "ds4_markup_dropped_total", kind="block") >= 1


def test_a_strict_call_sent_back_is_replayed_from_the_cache(oai):
    schema = SCHEMAS["integer"]
    first = oai.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[weather(schema)], temperature=1.0,
                                        seed=3, max_tokens=100)
    msg = first.choices[0].message
    assert msg.tool_calls
    turn = {"role": "assistant", "content": msg.content or "",
            "tool_calls": [t.model_dump(include={"id", "type", "function"}) for t in msg.tool_calls]}
    results = [{"role": "tool", "tool_call_id": t.id, "content": "sunny"} for t in msg.tool_calls]
    second = oai.chat.completions.create(model=MODEL, messages=WEATHER_Q + [turn] + results,
                                         tools=[weather(schema)], temperature=0, max_tokens=4)
    # The previous prompt and the sampled tokens are found in the cache (all but the last one,
    # which was never fed back): the turn is replayed from its sampled ids.
    assert second.usage.prompt_tokens_details.cached_tokens >= \
        first.usage.prompt_tokens + first.usage.completion_tokens - 1


def test_responses_and_anthropic_strict_auto(srv, oai):
    """A strict tool offered with tool_choice auto, greedy (neither API takes a seed): the model
    calls it, with arguments its schema accepts, and no markup reaches the text."""
    schema = SCHEMAS["integer"]
    r = oai.responses.create(model=MODEL, input="What is the weather in Paris?", temperature=0,
                             max_output_tokens=100, tools=[{"type": "function", "name": "get_weather",
                                                            "parameters": schema, "strict": True}])
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1, r.output
    jsonschema.validate(json.loads(calls[0].arguments), schema)
    assert all("｜DSML｜" not in part.text for item in r.output if item.type == "message" for part in item.content)
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
    m = client.messages.create(model=MODEL, max_tokens=100, messages=WEATHER_Q, extra_body={"temperature": 0},
                               tools=[{"name": "get_weather", "input_schema": schema, "strict": True}])
    uses = [block for block in m.content if block.type == "tool_use"]
    assert len(uses) == 1, m.content
    jsonschema.validate(uses[0].input, schema)
    assert all("｜DSML｜" not in block.text for block in m.content if block.type == "text")


UNSUPPORTED = {"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1}


def test_a_forced_call_of_non_strict_tools_always_names_an_offered_tool(oai):
    """tool_choice required without strict: the grammar still writes an offered tool's name and
    well-formed parameters, so every choice is a call (the tiny model, left alone, sometimes
    names a tool it saw in training but was not offered, which would come back as text)."""
    offered = [weather({"type": "object", "properties": {"city": {"type": "string"}}}, strict=False), TIME]
    for thinking in (False, True):
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], tools=offered,
                                        tool_choice="required", temperature=1.0, seed=5, n=6, max_tokens=96,
                                        extra_body={"thinking": {"type": "enabled" if thinking else "disabled"}})
        for c in r.choices:
            assert c.finish_reason == "tool_calls", (thinking, c.message)
            assert [t.function.name in ("get_weather", "get_time") for t in c.message.tool_calls] == [True]


def test_a_schema_the_grammar_cannot_enforce_is_a_400_naming_it(srv, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[TIME, weather(UNSUPPORTED)], max_tokens=4)
    err = e.value.response.json()["error"]
    assert err["param"] == "tools[1].function.parameters" and "minProperties" in err["message"]
    assert err["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=4, tools=[
            {"type": "function", "name": "f", "parameters": UNSUPPORTED, "strict": True}])
    err = e.value.response.json()["error"]
    assert err["param"] == "tools[0].parameters" and "minProperties" in err["message"]
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=WEATHER_Q,
                               tools=[{"name": "f", "input_schema": UNSUPPORTED, "strict": True}])
    body = e.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "tools[0].input_schema" in body["error"]["message"] and "minProperties" in body["error"]["message"]
