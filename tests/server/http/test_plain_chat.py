"""First contact: plain chat with the embedded model, and the tool-call opener masked when no
tools are offered (`serve.http.chat.no_calls_sampling`, `SamplingParams.forbidden_token_ids`).

The embedded model was trained to call a weather tool; left alone it opens a call on most plain
chat turns, which the server must drop when no tools are offered, so the reply came back empty.
The guard: a fixed set of plain prompts through each API (chat completions, Responses, Anthropic
Messages) comes back with visible text, and the weather question with the tool offered calls it.
These hold for any model trained as `examples/train_tools.py` trains it: they assert visible
text and a call of the offered tool, not what the model says. The independent expectations: the
opener's token id from the tokenizer, the same request without the bias (a masked token's bias
changes nothing), and the same server with `--free-tool-calls` (the old behaviour).
"""
from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest
import torch

from ds4_torch.chat_encoding import (INVOKE_CLOSE, INVOKE_OPEN, PARAMETER_CLOSE, PARAMETER_OPEN, TOOL_CALLS_CLOSE,
                                     TOOL_CALLS_OPEN)
from ds4_torch.default_model import default_tokenizer
from ds4_torch.sampling import BatchSampler, SamplingParams, sample
from ds4_torch.tokenizer import ByteTokenizer
from serve.http import chat
from serve.http.app import ServerConfig
from serve.http.chat import ChatRequest, ToolChoice, dsml_tokens, no_calls_sampling

from helpers import metric, server

MODEL = "ds4-default"
# Plain turns a new user sends first: greetings, questions, a line of verse (no tools anywhere).
PROMPTS = ["Hello", "What news?", "Good morrow, sir.", "Shall I compare thee to a summer's day?",
           "Who goes there?", "Hi there!", "Farewell, good friend.", "What light through yonder window breaks?"]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name."}},
                          "required": ["city"]}}
DSML_TAGS = (TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE, INVOKE_OPEN, INVOKE_CLOSE, PARAMETER_OPEN, PARAMETER_CLOSE)
MARKUP = re.compile(r"<｜|｜>|</?think>|</?tool_result>")


def visible(text: str | None) -> bool:
    """Text a user sees: not only whitespace, and no protocol markup."""
    return bool(text and text.strip()) and not MARKUP.search(text)


@pytest.fixture(scope="module")
def opener():
    (token,) = default_tokenizer().encode(TOOL_CALLS_OPEN, add_special_tokens=False)
    return token


def chat_server(model, **config):
    return server(model, **{"ctx": 1024, "prefill_chunk": 128, "max_batch": 8, **config})


@pytest.fixture(scope="module")
def srv(model):
    with chat_server(model) as s:
        yield s


def clients(srv):
    return (openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120))


# --------------------------------------------------------------------------- the mask itself
def test_a_forbidden_token_is_never_sampled_whatever_its_bias():
    """Against the grammar mask (an independent path that is never lifted): forbidding a token
    gives exactly the logits of a mask without it, even with logit_bias +100 on it, and a batch
    of forbidden tokens is not lifted when it leaves the row nothing else (the row fails)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    logits[:, 7] += 20  # the forbidden token is every row's favourite
    params = SamplingParams(logit_bias={7: 100.0}, forbidden_token_ids=[7])
    allowed = torch.ones(50, dtype=torch.bool)
    allowed[7] = False
    biased = SamplingParams(logit_bias={7: 100.0})
    for row in logits:
        assert sample(row, params) == sample(row, biased, allowed=allowed) != 7
    bs = BatchSampler(3, 50)
    for slot in range(3):
        bs.admit(slot, params if slot < 2 else SamplingParams(temperature=1.0, seed=1, forbidden_token_ids=[7]))
    out = bs.sample(logits)
    assert 7 not in out.tokens.tolist() and not out.failed.any()
    x = bs.adjust(logits, slice(0, 3), [p for p in bs.params if p is not None])
    assert torch.isinf(x[:, 7]).all()
    assert torch.equal(torch.isinf(x), ~allowed.expand(3, 50))
    # Everything forbidden: the row fails rather than sampling a forbidden token.
    bs.admit(0, SamplingParams(forbidden_token_ids=range(50)))
    assert bs.sample(logits).failed.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="forbidden_token_ids holds the token id 50"):
        SamplingParams(forbidden_token_ids=[50]).check(vocab_size=50)


def test_the_masked_tokens_come_from_the_tokenizer(opener):
    """The DSML tags are added tokens of the embedded tokenizer, one each: exactly those are
    forbidden when no tools are offered."""
    tok = default_tokenizer()
    tags = sorted(i for t in DSML_TAGS for i in tok.encode(t, add_special_tokens=False))
    assert len(tags) == len(DSML_TAGS) and opener in tags
    assert dsml_tokens(tok) == (tuple(tags), True)
    # A byte tokenizer spells the opener with 26 tokens: no token holds it, so the reply is
    # stopped where the opener would begin instead.
    state = type("S", (), {"tokenizer": ByteTokenizer(), "config": ServerConfig()})()
    creq = ChatRequest(messages=[{"role": "user", "content": "hi"}])
    assert no_calls_sampling(state, creq) == (creq.sampling, [TOOL_CALLS_OPEN])
    state.tokenizer = tok
    sampling, stops = no_calls_sampling(state, creq)
    assert sampling.forbidden_token_ids == tuple(tags) and stops == []
    offered = ChatRequest(messages=creq.messages, tools=[{"type": "function", "function": WEATHER}])
    assert no_calls_sampling(state, offered) == (offered.sampling, [])
    refused = ChatRequest(messages=creq.messages, tools=offered.tools, tool_choice=ToolChoice("none"))
    assert no_calls_sampling(state, refused)[0].forbidden_token_ids == tuple(tags)
    state.config = ServerConfig(tool_call_grammar=False)  # --free-tool-calls
    assert no_calls_sampling(state, creq) == (creq.sampling, [])


# --------------------------------------------------------------------------- the guard
def test_plain_prompts_get_visible_text_through_every_api(srv):
    """No tools offered: every prompt of the set, greedy, comes back with visible text through
    chat completions, Responses and Anthropic Messages (streamed for one of them), and nothing
    was dropped as a call."""
    oai, ant = clients(srv)
    for p in PROMPTS:
        msgs = [{"role": "user", "content": p}]
        r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
        assert visible(r.choices[0].message.content), (p, r.choices[0].message.content)
        assert not r.choices[0].message.tool_calls
        text = oai.responses.create(model=MODEL, input=p, max_output_tokens=24, temperature=0).output_text
        assert visible(text), (p, text)
        with ant.messages.stream(model=MODEL, messages=msgs, max_tokens=24, extra_body={"temperature": 0}) as s:
            m = s.get_final_message()
        assert [b.type for b in m.content] == ["text"] and visible(m.content[0].text), (p, m.content)
    assert metric(srv, "ds4_markup_dropped_total", kind="call") == 0


def test_sampled_plain_prompts_get_visible_text(srv):
    """At temperature 0.8 (seeded: the same draws every run), four choices of each prompt."""
    oai, _ = clients(srv)
    for p in PROMPTS:
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=24,
                                        temperature=0.8, seed=5, n=4)
        assert len(r.choices) == 4
        for c in r.choices:
            assert visible(c.message.content) and not c.message.tool_calls, (p, c.message.content)
    assert metric(srv, "ds4_markup_dropped_total", kind="call") == 0


def test_the_weather_question_with_the_tool_offered_calls_it(srv):
    oai, ant = clients(srv)
    q = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oai.chat.completions.create(model=MODEL, messages=q, max_tokens=60, temperature=0,
                                    tools=[{"type": "function", "function": WEATHER}])
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    assert isinstance(json.loads(calls[0].function.arguments).get("city"), str)
    resp = oai.responses.create(model=MODEL, input=q[0]["content"], max_output_tokens=60, temperature=0,
                                tools=[{"type": "function", **WEATHER}])
    assert [o.name for o in resp.output if o.type == "function_call"] == ["get_weather"]
    m = ant.messages.create(model=MODEL, messages=q, max_tokens=60, extra_body={"temperature": 0},
                            tools=[{"name": WEATHER["name"], "description": WEATHER["description"],
                                    "input_schema": WEATHER["parameters"]}])
    assert m.stop_reason == "tool_use" and [b.name for b in m.content if b.type == "tool_use"] == ["get_weather"]


# --------------------------------------------------------------------------- the mask against logit_bias
def _ids(r):
    return r.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize("extra", [{"temperature": 0}, {"temperature": 0.8, "seed": 3}], ids=["greedy", "sampled"])
def test_the_mask_wins_over_logit_bias(srv, opener, extra):
    """logit_bias +100 on the opener, no tools: the opener is never sampled, and the reply is
    the one the same request without the bias gets (a masked token's bias changes nothing)."""
    oai, _ = clients(srv)
    for p in PROMPTS[:4]:
        msgs = [{"role": "user", "content": p}]
        pushed = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, logit_bias={str(opener): 100},
                                             extra_body={"return_token_ids": True}, **extra)
        plain = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24,
                                            extra_body={"return_token_ids": True}, **extra)
        assert opener not in _ids(pushed) and _ids(pushed) == _ids(plain)
        assert visible(pushed.choices[0].message.content), (p, pushed.choices[0].message.content)
    # tool_choice "none" with the tool given: offered nothing, so masked the same way.
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                    max_tokens=24, logit_bias={str(opener): 100}, tool_choice="none",
                                    tools=[{"type": "function", "function": WEATHER}],
                                    extra_body={"return_token_ids": True}, **extra)
    assert opener not in _ids(r) and not r.choices[0].message.tool_calls
    assert metric(srv, "ds4_markup_dropped_total", kind="call") == 0


def test_thinking_mode_never_opens_a_call_either(srv, opener):
    """The block would open inside the reasoning as well (the parser reads a call there)."""
    oai, ant = clients(srv)
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Good morrow, sir."}],
                                    max_tokens=40, temperature=0, logit_bias={str(opener): 100},
                                    extra_body={"thinking": {"type": "enabled"}, "return_token_ids": True})
    assert opener not in _ids(r) and not r.choices[0].message.tool_calls
    m = ant.messages.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=40,
                            thinking={"type": "enabled", "budget_tokens": 32}, extra_body={"temperature": 0})
    assert m.stop_reason != "tool_use" and all(b.type in ("thinking", "text") for b in m.content)


def test_free_tool_calls_keeps_the_old_behaviour(model, opener):
    """--free-tool-calls: the biased opener is sampled, and the call, to a tool nobody offered,
    is dropped: the reply is what the issue saw (empty content)."""
    with chat_server(model, tool_call_grammar=False) as s:
        oai, _ = clients(s)
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=40,
                                        temperature=0, logit_bias={str(opener): 100},
                                        extra_body={"return_token_ids": True})
        assert _ids(r)[0] == opener and not r.choices[0].message.tool_calls
        assert sum(metric(s, "ds4_markup_dropped_total", kind=k) for k in ("call", "block", "token")) >= 1


def test_without_an_opener_token_the_reply_stops_where_the_opener_begins(model, opener, monkeypatch):
    """A tokenizer that spells the opener with several tokens (simulated: no token found): the
    reply ends where the opener would begin, as at EOS ("stop", not a stop sequence), with the
    text before it, and no call is dropped."""
    monkeypatch.setattr(chat, "dsml_tokens", lambda tokenizer: ((), False))
    with chat_server(model) as s:
        oai, _ = clients(s)
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=40,
                                        temperature=0, logit_bias={str(opener): 100},
                                        extra_body={"return_token_ids": True})
        c = r.choices[0]
        assert _ids(r)[-1] == opener and c.finish_reason == "stop" and not c.message.tool_calls
        assert "｜" not in (c.message.content or "")
        assert metric(s, "ds4_markup_dropped_total", kind="call") == 0


def test_speculating_gives_the_same_masked_tokens(srv, model, opener):
    """Speculative decoding verifies drafts with the same sampler: a draft holding a forbidden
    token is never taken, and the tokens are those of plain decoding."""
    def ids(s):
        oai, _ = clients(s)
        return [_ids(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=24,
                                                 temperature=0, logit_bias={str(opener): 100},
                                                 extra_body={"return_token_ids": True})) for p in PROMPTS[:3]]
    with chat_server(model, speculative_tokens=2) as s:
        speculated = ids(s)
    assert speculated == ids(srv) and not any(opener in t for t in speculated)
