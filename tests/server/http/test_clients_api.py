"""Everything real clients send, through a live server and the official SDKs: prompt logprobs
(`echo` + `logprobs`) against the model's own forward, `n` and `best_of` choices, penalties and
logit bias against their formulas, structured outputs (response_format, Responses text.format,
strict tool calls) validated with `jsonschema`, and each option's bad values answered 400 naming
the field in the API's own error shape."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from helpers import penalised_greedy, reference_logprobs, server

MODEL = "ds4-default"
CTX, CHUNK = 1024, 8
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east."


@pytest.fixture(scope="module")
def srv(model, tok):
    with server(model, tok, ctx=CTX, prefill_chunk=CHUNK) as s:
        yield s


@pytest.fixture
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=120)


# --------------------------------------------------------------------------- prompt logprobs
def check_legacy_logprobs(lp, ids, ref, k, tt):
    """OpenAI's legacy logprobs of `ids` (the prompt and whatever followed) against `ref`, the
    log_softmax of the model's own forward over them."""
    assert lp.tokens == [tt(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-3)
        top = lp.top_logprobs[i]
        vals, idx = torch.topk(ref[i - 1], k)
        expected = {tt(t): v for t, v in zip(idx.tolist(), vals.tolist())}
        expected.setdefault(tt(ids[i]), float(ref[i - 1, ids[i]]))  # the chosen token always (up to k + 1)
        assert top.keys() == expected.keys()
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-3)
    assert lp.text_offset == [sum(len(tt(t)) for t in ids[:i]) for i in range(len(ids))]


def test_echo_with_logprobs_scores_a_text_prompt_like_the_models_forward(oai, model, tok):
    ids = tok.encode(TEXT)
    assert len(ids) > 2 * CHUNK  # the prompt's logprobs come from several prefill chunks
    tt = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
    r = oai.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=2, max_tokens=0)
    c = r.choices[0]
    assert c.text == TEXT and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    check_legacy_logprobs(c.logprobs, ids, reference_logprobs(model, ids), 2, tt)


def test_echo_with_logprobs_then_generated_tokens_from_token_ids(oai, model, tok):
    ids = tok.encode(TEXT)[:29]
    tt = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
    r = oai.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=3, max_tokens=5, temperature=0,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    gen = c.token_ids
    assert len(gen) == 5
    full = ids + gen
    ref = reference_logprobs(model, full)
    assert gen == [int(torch.argmax(ref[len(ids) - 1 + j])) for j in range(5)]  # greedy
    check_legacy_logprobs(c.logprobs, full, ref, 3, tt)
    assert c.text == tok.decode(ids) + tok.decode(gen)


def test_a_batch_of_prompts_gives_n_choices_each_in_order(srv, model, tok):
    prompts = [TEXT[:30], tok.encode(TEXT[30:])]
    r = post(srv, "/v1/completions", {"prompt": prompts, "n": 2, "echo": True, "logprobs": 0, "max_tokens": 3,
                                      "temperature": 1, "seed": 5})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for j, c in enumerate(choices):
        ids = tok.encode(prompts[0]) if j < 2 else prompts[1]
        text = prompts[0] if j < 2 else tok.decode(prompts[1])
        assert c["text"].startswith(text)
        lp = c["logprobs"]["token_logprobs"]
        assert lp[0] is None and len(lp) == len(ids) + 3
        ref = reference_logprobs(model, ids)
        assert lp[1:len(ids)] == pytest.approx([float(ref[i - 1, ids[i]]) for i in range(1, len(ids))], abs=1e-3)
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(tok.encode(prompts[0])) + len(prompts[1])  # each prompt once
    assert usage["completion_tokens"] == 4 * 3


def test_echo_without_logprobs_and_streaming_echo(oai, tok):
    r = oai.completions.create(model=MODEL, prompt=TEXT, echo=True, max_tokens=4, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.choices[0].text.startswith(TEXT) and r.choices[0].logprobs is None
    stream = oai.completions.create(model=MODEL, prompt=TEXT, echo=True, max_tokens=4, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    chunks = [ch for ch in stream if ch.choices and ch.choices[0].text]
    assert chunks[0].choices[0].text == TEXT  # the prompt comes first, whole
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text


# --------------------------------------------------------------------------- n and best_of
def test_n_choices_with_a_seed_are_reproducible_and_choice_0_is_n_1(oai):
    kw = dict(model=MODEL, prompt=TEXT, max_tokens=12, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    a = oai.completions.create(n=3, **kw)
    b = oai.completions.create(n=3, **kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1, "three samples at temperature 1 all equal: the choices share one generator"
    assert oai.completions.create(n=1, **kw).choices[0].text == texts[0]
    assert a.usage.completion_tokens == 36 and a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_n_choices_streamed_carry_their_index(oai):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me of the king."}], max_tokens=10,
              temperature=1.0, seed=99, n=3)
    r = oai.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    again = oai.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    streamed = {0: "", 1: "", 2: ""}
    finished = {}
    usage = None
    for ch in oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert streamed == {c.index: c.message.content for c in r.choices}
    assert finished == {c.index: c.finish_reason for c in r.choices}
    assert usage.completion_tokens == r.usage.completion_tokens


def test_best_of_returns_the_choices_with_the_highest_cumulative_logprob(srv):
    body = {"prompt": TEXT, "max_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    every = post(srv, "/v1/completions", {**body, "n": 4, "logprobs": 0}).json()
    scores = [(sum(c["logprobs"]["token_logprobs"]), c["text"]) for c in every["choices"]]
    best = post(srv, "/v1/completions", {**body, "n": 2, "best_of": 4}).json()
    assert [c["text"] for c in best["choices"]] == [t for _, t in sorted(scores, key=lambda s: -s[0])[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1] and best["choices"][0]["logprobs"] is None
    assert best["usage"]["completion_tokens"] == 4 * 6  # every candidate counts


# --------------------------------------------------------------------------- penalties and bias
def test_logit_bias_minus_100_removes_the_greedy_token(srv, model, tok):
    ids = tok.encode(TEXT)
    top2 = torch.topk(reference_logprobs(model, ids)[-1], 2).indices.tolist()
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    assert post(srv, "/v1/completions", body).json()["choices"][0]["token_ids"] == top2[:1]
    r = post(srv, "/v1/completions", {**body, "logit_bias": {str(top2[0]): -100}})
    assert r.json()["choices"][0]["token_ids"] == top2[1:]


def test_penalties_through_the_server_follow_their_formulas(srv, model, tok):
    ids = tok.encode(TEXT)[:20]
    body = {"prompt": ids, "max_tokens": 12, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    plain = post(srv, "/v1/completions", body).json()["choices"][0]["token_ids"]
    r = post(srv, "/v1/completions", {**body, "presence_penalty": 0.6, "frequency_penalty": 0.4,
                                      "repetition_penalty": 1.3})
    pen = r.json()["choices"][0]["token_ids"]
    assert pen == penalised_greedy(model, ids, 12, 0.6, 0.4, 1.3)
    assert pen != plain, "the penalties changed nothing: the test shows nothing"


def test_min_tokens_and_stop_token_ids_through_chat(oai):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0)
    plain = oai.chat.completions.create(extra_body={"return_token_ids": True}, **kw).choices[0]
    first = plain.token_ids[0]
    stopped = oai.chat.completions.create(extra_body={"return_token_ids": True, "stop_token_ids": [first]},
                                          **kw).choices[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.message.content == ""
    held = oai.chat.completions.create(extra_body={"return_token_ids": True, "stop_token_ids": [first],
                                                   "min_tokens": 3}, **kw).choices[0]
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]


# --------------------------------------------------------------------------- structured outputs
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
     "minItems": 1, "maxItems": 3}, "ok": {"type": "boolean"}}, "required": ["tags", "ok"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number"},
     "y": {"type": "number"}}, "required": ["x", "y"]}, "label": {"type": ["string", "null"]}},
     "required": ["point"]},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "tags", "point"])
def test_chat_response_format_json_schema_validates_at_temperature_1(oai, schema):
    for seed, prompt in enumerate(["Describe a person.", "Which colours?", "Where is it?"]):
        r = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=1.0, seed=seed,
            n=2, response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                                         "strict": True}})
        assert len(r.choices) == 2
        for c in r.choices:
            jsonschema.validate(json.loads(c.message.content), schema)
            assert c.finish_reason == "stop"


def test_chat_json_object_and_thinking_mode(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Some JSON please"}],
                                    max_tokens=40, temperature=1.0, seed=3, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # Thinking mode: the reasoning is free, the content after it follows the schema.
    schema = SCHEMAS[0]
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], max_tokens=160, temperature=1.0,
        seed=4, extra_body={"thinking": {"type": "enabled"}},
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    msg = r.choices[0].message
    assert msg.model_extra.get("reasoning_content")
    jsonschema.validate(json.loads(msg.content), schema)


def test_responses_text_format_json_schema(oai):
    schema = SCHEMAS[1]
    for prompt in ("Which colours?", "Name the colours of the flag.", "Red or blue?"):  # unseeded: any sample
        r = oai.responses.create(model=MODEL, input=prompt, max_output_tokens=40, temperature=1.0,
                                 text={"format": {"type": "json_schema", "name": "colours", "schema": schema,
                                                  "strict": True}})
        jsonschema.validate(json.loads(r.output_text), schema)
        assert r.text.format.type == "json_schema"
    r = oai.responses.create(model=MODEL, input="JSON?", max_output_tokens=30, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(r.output_text), dict)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "units": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "days", "units"], "additionalProperties": False}


@pytest.mark.parametrize("thinking", [False, True])
def test_strict_tool_arguments_validate_when_the_call_is_forced(oai, thinking):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                               "parameters": WEATHER, "strict": True}}]
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "get_weather"}}]):
        r = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=tools,
            tool_choice=choice, max_tokens=120, temperature=1.0, seed=seed, n=2,
            extra_body={"thinking": {"type": "enabled" if thinking else "disabled"}})
        assert len(r.choices) == 2
        for c in r.choices:
            assert c.finish_reason == "tool_calls", c.message
            (call,) = c.message.tool_calls
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_strict_tool_through_responses(oai):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    r = oai.responses.create(model=MODEL, input="Weather in Rome?", tools=tools, tool_choice="required",
                             max_output_tokens=80, temperature=1.0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


# --------------------------------------------------------------------------- bad values, named
def _chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def _completion(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


BAD = [
    ("presence range", "/v1/chat/completions", _chat(presence_penalty=2.5), "presence_penalty"),
    ("frequency type", "/v1/completions", _completion(frequency_penalty="x"), "frequency_penalty"),
    ("repetition 0", "/v1/completions", _completion(repetition_penalty=0), "repetition_penalty"),
    ("logit_bias type", "/v1/chat/completions", _chat(logit_bias=[1]), "logit_bias"),
    ("logit_bias key", "/v1/chat/completions", _chat(logit_bias={"cat": 1}), "logit_bias"),
    ("logit_bias value", "/v1/completions", _completion(logit_bias={"5": 101}), "logit_bias"),
    ("logit_bias value type", "/v1/completions", _completion(logit_bias={"5": "x"}), "logit_bias"),
    ("logit_bias id", "/v1/completions", _completion(logit_bias={"99999": 1}), "logit_bias"),
    ("min_tokens > max_tokens", "/v1/completions", _completion(min_tokens=5), "min_tokens"),
    ("stop_token_ids type", "/v1/chat/completions", _chat(stop_token_ids="1"), "stop_token_ids"),
    ("n too many", "/v1/chat/completions", _chat(n=1000), "n"),
    ("best_of < n", "/v1/completions", _completion(n=3, best_of=2), "best_of"),
    ("best_of stream", "/v1/completions", _completion(best_of=2, stream=True), "best_of"),
    ("max_tokens 0 without echo", "/v1/completions", _completion(max_tokens=0), "max_tokens"),
    ("echo type", "/v1/completions", _completion(echo="yes"), "echo"),
    ("seed huge", "/v1/completions", _completion(seed=2**70), "seed"),
    ("response_format type", "/v1/chat/completions", _chat(response_format={"type": "xml"}), "response_format.type"),
    ("json_schema without name", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}), "response_format.json_schema.name"),
    ("unsupported schema", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "array", "uniqueItems": True}}}), "response_format.json_schema.schema"),
    ("text.format schema", "/v1/responses",
     {"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                         "schema": {"type": "string", "format": "weird"}}}},
     "text.format.schema"),
    ("strict tool schema", "/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
         "type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1}}}], tool_choice="required"),
     "tools[0].function.parameters"),
    ("lone surrogate", "/v1/completions", _completion(prompt="\ud800"), "prompt"),
    ("surrogate in a message", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]),
     "messages[0].content[0].text"),
]


@pytest.mark.parametrize("name,path,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_values_are_400s_naming_the_field(srv, name, path, body, param):
    r = httpx.post(srv.url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_unsupported_schema_feature_is_named(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "x", "schema": {"type": "array", "uniqueItems": True}}})
    assert "uniqueItems" in e.value.message


def test_anthropic_bad_text_in_anthropic_shape(srv):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "\ud800"}]}
    r = httpx.post(srv.url + "/v1/messages", content=json.dumps(body).encode(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "messages[0].content" in r.json()["error"]["message"]
    claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"temperature": 7})
