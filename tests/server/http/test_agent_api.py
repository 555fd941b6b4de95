"""The agent protocol through a real server and the official SDKs: chat completions with tools,
the Responses API, Anthropic Messages; streaming equals non-streaming; tool loops reuse the
cache to the last token; replay survives a restart; errors in each API's shape.

The expectations are the embedded model's own greedy output (`ds4_torch.generate` on the same
prompt, parsed with `ds4_torch.output_parser.parse_output`) and what it was trained to do
(`examples/train_tools.py`): asked about a city's weather with a get_weather tool offered, it
calls get_weather with a city; given the result, it answers in text. (Which city it writes is
the model's business, measured in training.json: the tests compare with its own greedy output.)
"""
from __future__ import annotations

import base64
import importlib.util
import json
import logging
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from ds4_torch.chat_encoding import render_prompt
from ds4_torch.generation import generate
from ds4_torch.output_parser import parse_output
from serve.kvstore.store import KVStore
from serve.http.chat import dsml_tokens

from helpers import metric, server

ROOT = Path(__file__).resolve().parents[3]
MODEL = "ds4-default"
CTX, CHUNK = 2048, 256  # the tools section alone is ~550 tokens
QUESTION = "What is the weather in Paris?"
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name."}},
                          "required": ["city"]}}
TIME = {"name": "get_time", "description": "Get the local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name."}},
                       "required": ["city"]}}
CHAT_TOOLS = [{"type": "function", "function": WEATHER}]
ANTHROPIC_TOOLS = [{"name": WEATHER["name"], "description": WEATHER["description"],
                    "input_schema": WEATHER["parameters"]}]
RESULT = json.dumps({"city": "Paris", "temperature": 21, "condition": "sunny"})
GREEDY = {"temperature": 0}  # Anthropic's SDK sends sampling settings only through extra_body


def _load_example():
    spec = importlib.util.spec_from_file_location("agent_tool_loop", ROOT / "examples" / "agent_tool_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()


def running_server(model, tok, **config):
    return server(model, tok, **{"ctx": CTX, "prefill_chunk": CHUNK, **config})


@pytest.fixture(scope="module")
def srv(model, tok):
    with running_server(model, tok) as s:
        yield s


@pytest.fixture
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def claude(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)


def greedy_ids(model, tok, ids, tools=None, thinking=False, n=96, forbidden=()):
    """The model's own greedy reply to prompt `ids`: (parsed, token ids with the EOS); `forbidden`
    tokens never drawn."""
    tokens = list(generate(model, ids, n, eos_token_id=tok.eos_token_id, forbidden_token_ids=forbidden))
    text = tok.decode([t for t in tokens if t != tok.eos_token_id])
    return parse_output(text, thinking=thinking, tools=tools), tokens


def greedy(model, tok, messages, tools=None, thinking=False, n=96, forbidden=()):
    """The model's own greedy reply to `messages`, parsed (the library, not the server)."""
    return greedy_ids(model, tok, tok.encode_chat(messages, tools=tools, thinking=thinking), tools, thinking, n,
                      forbidden)[0]


def replayed_prompt(tok, messages, prompt_ids, reply_ids, tools=None, thinking=False):
    """What exact replay makes of `messages` (a first user turn, the reply, then more): the first
    prompt's ids, the reply's sampled ids (EOS included), then the rest encoded as text."""
    k = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    head = render_prompt(messages[:k + 1], tools=tools, thinking=thinking, add_generation_prompt=False)
    rest = render_prompt(messages, tools=tools, thinking=thinking)[len(head):]
    return prompt_ids + reply_ids + tok.encode(rest, add_special_tokens=False)


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def example_history(messages: list) -> list:
    """An Anthropic conversation of text / tool_use / tool_result blocks as chat messages."""
    out = []
    for m in messages:
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": "".join(b["text"] for b in blocks if b["type"] == "text"),
                        "tool_calls": [{"id": b["id"], "type": "function",
                                        "function": {"name": b["name"], "arguments": b["input"]}}
                                       for b in blocks if b["type"] == "tool_use"] or None})
        else:
            out += [{"role": "tool", "tool_call_id": b["tool_use_id"], "content": b["content"]}
                    if b["type"] == "tool_result" else {"role": "user", "content": b["text"]} for b in blocks]
    return out


def markup_free(text: str | None) -> bool:
    return not any(m in (text or "") for m in ("｜DSML｜", "<think>", "</think>", "<｜end▁of▁sentence｜>"))


# --------------------------------------------------------------------------- chat completions
def test_chat_tool_call_is_the_models_own_and_what_it_learned(oai, model, tok):
    messages = [{"role": "user", "content": QUESTION}]
    ids = tok.encode_chat(messages, tools=CHAT_TOOLS)
    want, sampled = greedy_ids(model, tok, ids, CHAT_TOOLS)
    assert [(n, list(a)) for n, a in calls_of(want)] == [("get_weather", ["city"])]  # what it learned
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, temperature=0, max_tokens=96,
                                    extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert r.prompt_token_ids == ids and c.token_ids == sampled
    assert c.finish_reason == "tool_calls" and not c.message.content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == calls_of(want)
    assert c.message.tool_calls[0].id.startswith("call_") and c.message.tool_calls[0].type == "function"

    # The result goes back: the prompt is the first prompt, the sampled reply, then the result
    # turn; the model answers in text, as its own greedy output on that prompt does.
    messages += [c.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": RESULT}]
    ids2 = replayed_prompt(tok, messages, ids, sampled, CHAT_TOOLS)
    want = greedy_ids(model, tok, ids2, CHAT_TOOLS)[0]
    r2 = oai.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, temperature=0, max_tokens=96,
                                     extra_body={"return_token_ids": True})
    assert r2.prompt_token_ids == ids2
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    assert r2.choices[0].message.content == want.content and want.content and markup_free(want.content)
    # The reply and everything before it came from the cache (all but the last sampled token).
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens + r.usage.completion_tokens - 1


def _accumulate(stream) -> tuple[str, str, list, str, list]:
    content, reasoning, calls, finish, deltas = "", "", {}, None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        deltas.append(d)
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for t in d.tool_calls or []:
            calls[t.index] = (t.id, t.function.name, t.function.arguments)
        finish = ch.finish_reason or finish
    return content, reasoning, [calls[k] for k in sorted(calls)], finish, deltas


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
def test_chat_streaming_equals_non_streaming(oai, thinking):
    extra = {"thinking": {"type": "enabled" if thinking else "disabled"}}
    turns = [[{"role": "user", "content": QUESTION}],
             [{"role": "user", "content": QUESTION},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]]
    for messages in turns:  # a tool call, then a text answer
        kw = dict(model=MODEL, messages=messages, tools=CHAT_TOOLS, temperature=0, max_tokens=96, extra_body=extra)
        whole = oai.chat.completions.create(**kw).choices[0]
        content, reasoning, calls, finish, deltas = _accumulate(oai.chat.completions.create(stream=True, **kw))
        assert content == (whole.message.content or "") and finish == whole.finish_reason
        assert reasoning == (getattr(whole.message, "reasoning_content", None) or "")
        assert [(n, a) for _, n, a in calls] == [(t.function.name, t.function.arguments)
                                                 for t in whole.message.tool_calls or []]
        assert all(markup_free(d.content) and markup_free(getattr(d, "reasoning_content", None)) for d in deltas)
        assert bool(reasoning) == thinking  # the model reasons in thinking mode, and only there


def test_tool_choice(oai, model, tok):
    hello = [{"role": "user", "content": "Hello!"}]
    kw = dict(model=MODEL, temperature=0, max_tokens=64)
    # none: no tools are offered, so the reply is the greedy reply to the chat without tools, with
    # the DSML tags' tokens forbidden (serve.http.chat.no_calls_sampling): left alone the model calls
    # anyway (its drills had no tools section), a call the server could only drop.
    r = oai.chat.completions.create(messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS,
                                    tool_choice="none", **kw)
    assert greedy(model, tok, [{"role": "user", "content": QUESTION}]).tool_calls
    want = greedy(model, tok, [{"role": "user", "content": QUESTION}], forbidden=dsml_tokens(tok)[0])
    assert not want.tool_calls
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    assert (r.choices[0].message.content or "") == want.content and markup_free(r.choices[0].message.content)
    # required: even a greeting gets a tool call.
    assert not greedy(model, tok, hello, CHAT_TOOLS).tool_calls
    r = oai.chat.completions.create(messages=hello, tools=CHAT_TOOLS, tool_choice="required", **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    # a named function: asked for the weather, it must call get_time.
    both = CHAT_TOOLS + [{"type": "function", "function": TIME}]
    r = oai.chat.completions.create(messages=[{"role": "user", "content": QUESTION}], tools=both,
                                    tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and set(json.loads(call.function.arguments)) <= {"city"}
    # Thinking mode: the reasoning comes first, then the forced call.
    r = oai.chat.completions.create(messages=hello, tools=CHAT_TOOLS, tool_choice="required",
                                    extra_body={"thinking": {"type": "enabled"}}, **kw)
    assert r.choices[0].message.reasoning_content and r.choices[0].message.tool_calls


def test_a_call_its_schema_rejects_is_dropped_logged_and_counted(srv, oai, model, tok, caplog):
    """get_weather offered with an integer city: the model's call (a string city) violates the
    schema, so it is no call; its markup never reaches the text: it is logged with its raw text
    and counted in ds4_markup_dropped_total."""
    strict = [{"type": "function", "function": {**WEATHER, "parameters": {
        "type": "object", "properties": {"city": {"type": "integer"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": QUESTION}]
    want = greedy(model, tok, messages, strict)
    assert len(want.tool_calls) == 1 and want.tool_calls[0].problems
    before = metric(srv, "ds4_markup_dropped_total", kind="call")
    with caplog.at_level(logging.WARNING, logger="ds4.serve"):
        r = oai.chat.completions.create(model=MODEL, messages=messages, tools=strict, temperature=0, max_tokens=96)
    c = r.choices[0]
    assert not c.message.tool_calls and c.finish_reason == "stop"
    assert (c.message.content or "") == want.content and markup_free(c.message.content)
    assert any("markup kept out of the text (call" in rec.getMessage() and 'name="get_weather"' in rec.getMessage()
               for rec in caplog.records)
    assert metric(srv, "ds4_markup_dropped_total", kind="call") == before + 1


def test_markup_in_a_completion_is_logged_once_and_counted_each_time(srv, tok, caplog):
    """A raw completion biased toward `<think>` emits it at every step: the text never holds it,
    the metric counts every one, and the log has one warning for the request (not one a token)."""
    think = tok.encode("<think>", add_special_tokens=False)
    assert len(think) == 1
    before = metric(srv, "ds4_markup_dropped_total", kind="token")
    with caplog.at_level(logging.DEBUG, logger="ds4.serve"):
        r = httpx.post(f"{srv.url}/v1/completions", json={
            "model": MODEL, "prompt": "To be", "max_tokens": 5, "temperature": 0,
            "logit_bias": {str(think[0]): 100}, "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == think * 5 and "<think>" not in choice["text"]
    assert metric(srv, "ds4_markup_dropped_total", kind="token") == before + 5
    logged = [rec for rec in caplog.records if "markup kept out" in rec.getMessage()]
    assert [rec.levelno for rec in logged] == [logging.WARNING] + [logging.DEBUG] * 4


# --------------------------------------------------------------------------- tool loops, all APIs
@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
@pytest.mark.parametrize("loop", ["chat_completions_loop", "responses_loop", "anthropic_loop"])
def test_tool_loop_reuses_the_whole_previous_turn(srv, loop, thinking):
    """The example's loop (examples/agent_tool_loop.py): a call, its result, a text answer; every
    turn after the first finds the previous prompt and reply (reasoning included, which the
    format keeps when tools are given) in the cache."""
    turns = getattr(example, loop)(srv.url, QUESTION, thinking=thinking)
    assert [(n, list(a)) for n, a in turns[0]["calls"]] == [("get_weather", ["city"])]
    assert len(turns) == 2 and not turns[1]["calls"] and turns[1]["text"] and markup_free(turns[1]["text"])
    for before, after in zip(turns, turns[1:]):
        assert after["cached"] >= before["prompt"] + before["completion"] - 1


def test_replay_survives_a_restart(tmp_path, model, tok):
    """Turn 1 on one server, turn 2 on a new one over the same --kv-disk-dir: the recorded ids
    make the prompt match the stored KV snapshot, so the whole previous turn is reused."""
    def server():
        store = KVStore(tmp_path, 64, model, ctx=CTX, min_tokens=8)
        return running_server(model, tok, kv_disk_dir=str(tmp_path), kv_store=store)

    messages = [{"role": "user", "content": QUESTION}]
    with server() as s1:
        client = openai.OpenAI(base_url=s1.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r1 = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, temperature=0,
                                            max_tokens=96)
    call = r1.choices[0].message.tool_calls[0]
    messages += [r1.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    with server() as s2:
        assert len(s2.app.state.replay) == 0  # nothing in memory: what follows comes from the disk
        client = openai.OpenAI(base_url=s2.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, temperature=0,
                                            max_tokens=96)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens + r1.usage.completion_tokens - 1


# --------------------------------------------------------------------------- responses
def test_responses_create_and_stream(oai, model, tok):
    tools = [{"type": "function", **WEATHER}]
    r = oai.responses.create(model=MODEL, input=QUESTION, tools=tools, temperature=0, max_output_tokens=96)
    assert r.status == "completed" and r.output_text == ""
    (call,) = [o for o in r.output if o.type == "function_call"]
    want = greedy(model, tok, [{"role": "user", "content": QUESTION}], CHAT_TOOLS)
    assert [(call.name, json.loads(call.arguments))] == calls_of(want) and call.name == "get_weather"
    assert r.usage.input_tokens == len(tok.encode_chat([{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS))

    with oai.responses.stream(model=MODEL, input=QUESTION, tools=tools, temperature=0, max_output_tokens=96) as s:
        types = [e.type for e in s]
        final = s.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.function_call_arguments.done" in types
    assert [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in final.output] == \
        [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in r.output]

    # Text, with a reasoning item first in thinking mode (reasoning.effort); streamed the same.
    items = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    for effort in (None, "high"):
        kw = dict(model=MODEL, input=items, tools=tools, temperature=0, max_output_tokens=96,
                  **({"reasoning": {"effort": effort}} if effort else {}))
        whole = oai.responses.create(**kw)
        with oai.responses.stream(**kw) as s:
            deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
            final = s.get_final_response()
        assert whole.output_text and deltas == whole.output_text == final.output_text
        assert markup_free(whole.output_text)
        kinds = [o.type for o in whole.output]
        assert kinds == (["reasoning", "message"] if effort else ["message"])
        if effort:
            assert whole.output[0].content[0].text == final.output[0].content[0].text


def test_responses_reasoning_comes_back_from_encrypted_content(srv, oai):
    """Codex's way: `include: ["reasoning.encrypted_content"]`, then the next turn sends the
    reasoning item back with that field and no text. It is read into the prompt as the same item
    with its text is (the reasoning of a tool-call turn stays in the prompt), so the turn reuses
    the cache to the last token; a summary-only item renders no reasoning; a damaged field is a
    400 naming it."""
    kw = dict(model=MODEL, tools=[{"type": "function", **WEATHER}], temperature=0,
              reasoning={"effort": "high"})
    r = oai.responses.create(input=QUESTION, include=["reasoning.encrypted_content"], max_output_tokens=96, **kw)
    reasoning = next(o for o in r.output if o.type == "reasoning")
    call = next(o for o in r.output if o.type == "function_call")
    text = reasoning.content[0].text
    assert text and reasoning.encrypted_content and text not in reasoning.encrypted_content

    def turn(item):
        return [{"role": "user", "content": QUESTION}, item, call.model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]

    base = {"type": "reasoning", "id": reasoning.id, "summary": []}
    sent = oai.responses.create(input=turn({**base, "encrypted_content": reasoning.encrypted_content}),
                                max_output_tokens=1, **kw)
    assert sent.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens + r.usage.output_tokens - 1
    with_text = oai.responses.create(input=turn({**base, "content": [{"type": "reasoning_text", "text": text}]}),
                                     max_output_tokens=1, **kw)
    summary_only = oai.responses.create(input=turn(base), max_output_tokens=1, **kw)
    assert sent.usage.input_tokens == with_text.usage.input_tokens > summary_only.usage.input_tokens
    for damaged in ("ds4-reasoning:not base64!", "ds4-reasoning:" + base64.b64encode(b"\xff\xfe").decode()):
        r = httpx.post(srv.url + "/v1/responses", timeout=60, json={
            "model": MODEL, "input": turn({**base, "encrypted_content": damaged}), "max_output_tokens": 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "input[1].encrypted_content" and "damaged" in r.json()["error"]["message"]


def test_responses_errors(srv, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    r = httpx.post(srv.url + "/v1/responses", json={"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].type"
    r = httpx.post(srv.url + "/v1/responses", json={"model": MODEL, "input": [{"type": "message", "role": "user",
                                                                                "content": [{"type": "input_image",
                                                                                             "image_url": "x"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0]"


# --------------------------------------------------------------------------- anthropic
def test_messages_create_stream_and_tool_result(claude, model, tok):
    messages = [{"role": "user", "content": QUESTION}]
    r = claude.messages.create(model=MODEL, max_tokens=96, messages=messages, tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    assert r.stop_reason == "tool_use" and r.role == "assistant" and r.type == "message"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert [(use.name, use.input)] == calls_of(greedy(model, tok, messages, CHAT_TOOLS)) and use.id.startswith("toolu_")
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == \
        len(tok.encode_chat(messages, tools=CHAT_TOOLS))
    with claude.messages.stream(model=MODEL, max_tokens=96, messages=messages, tools=ANTHROPIC_TOOLS,
                                extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [b.model_dump(exclude={"id"}) for b in r.content]
    assert final.stop_reason == r.stop_reason

    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    counted = claude.messages.count_tokens(model=MODEL, messages=messages, tools=ANTHROPIC_TOOLS)
    r2 = claude.messages.create(model=MODEL, max_tokens=96, messages=messages, tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    assert r2.stop_reason == "end_turn" and [b.type for b in r2.content] == ["text"]
    first_ids = tok.encode_chat(example_history(messages[:1]), tools=CHAT_TOOLS)
    ids2 = replayed_prompt(tok, example_history(messages), first_ids,
                           greedy_ids(model, tok, first_ids, CHAT_TOOLS)[1], CHAT_TOOLS)
    assert r2.content[0].text == greedy_ids(model, tok, ids2, CHAT_TOOLS)[0].content
    assert counted.input_tokens == r2.usage.input_tokens + r2.usage.cache_read_input_tokens
    assert r2.usage.cache_read_input_tokens >= r.usage.input_tokens + r.usage.cache_read_input_tokens \
        + r.usage.output_tokens - 1
    with claude.messages.stream(model=MODEL, max_tokens=96, messages=messages, tools=ANTHROPIC_TOOLS,
                                extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        assert s.get_final_message().content[0].text == text == r2.content[0].text


def test_messages_thinking_blocks(claude, model, tok):
    messages = [{"role": "user", "content": QUESTION}]
    want = greedy(model, tok, messages, CHAT_TOOLS, thinking=True)
    kw = dict(model=MODEL, max_tokens=96, messages=messages, tools=ANTHROPIC_TOOLS, extra_body=GREEDY,
              thinking={"type": "enabled", "budget_tokens": 1024})
    r = claude.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking", "tool_use"]
    assert r.content[0].thinking == want.reasoning and r.content[0].signature
    with claude.messages.stream(**kw) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert "thinking" in events and [b.model_dump(exclude={"id"}) for b in final.content] == \
        [b.model_dump(exclude={"id"}) for b in r.content]


def test_messages_stop_sequences(claude, model, tok):
    messages = [{"role": "user", "content": "Hello!"}]
    text = greedy(model, tok, messages).content
    stop = text[4:7]
    r = claude.messages.create(model=MODEL, max_tokens=32, messages=messages, stop_sequences=[stop], extra_body=GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[:text.find(stop)]


def test_messages_errors(srv, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    for body, field in [({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [
                            {"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
                        ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [
                            {"type": "document", "source": {"type": "base64", "data": "eA=="}}]}]},
                         "messages[0].content[0]"),
                        ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                          "tool_choice": {"type": "tool", "name": "nope"}, "tools": ANTHROPIC_TOOLS}, "tool_choice")]:
        r = httpx.post(srv.url + "/v1/messages", json=body)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert field in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_api_keys(srv, monkeypatch):
    monkeypatch.setattr(srv.app.state.config, "api_key", "s3cret")
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(**body)
    assert e.value.body["error"]["type"] == "authentication_error"
    ok = anthropic.Anthropic(base_url=srv.url, api_key="s3cret", max_retries=0)  # sends x-api-key
    assert ok.messages.create(**body).stop_reason in ("end_turn", "max_tokens")
    assert httpx.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": "s3cret"}).status_code == 200
    assert httpx.post(srv.url + "/v1/chat/completions", json={**body, "max_tokens": 2},
                      headers={"x-api-key": "s3cret"}).status_code == 200
    assert httpx.post(srv.url + "/v1/responses", json={"model": MODEL, "input": "hi"},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_omitted_thinking_still_replays(claude):
    """thinking.display "omitted": the reply's thinking blocks hold no text, only a signature;
    sent back, the signature restores the reasoning, so the next turn reuses the cache fully."""
    kw = dict(model=MODEL, max_tokens=96, tools=ANTHROPIC_TOOLS, extra_body=GREEDY,
              thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})
    messages = [{"role": "user", "content": QUESTION}]
    r = claude.messages.create(messages=messages, **kw)
    thinking = [b for b in r.content if b.type == "thinking"]
    assert thinking and all(b.thinking == "" and b.signature for b in thinking)
    uses = [b for b in r.content if b.type == "tool_use"]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": RESULT}
                                              for u in uses] or "Go on."}]
    r2 = claude.messages.create(messages=messages, **kw)
    assert r2.usage.cache_read_input_tokens >= r.usage.input_tokens + r.usage.cache_read_input_tokens \
        + r.usage.output_tokens - 1
