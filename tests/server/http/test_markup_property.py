"""Nothing but text reaches text: random token sequences, heavy in special and protocol tokens,
through the output parser and each API's view (chat completions, completions, Responses,
Anthropic Messages), streamed and whole, in chat and thinking mode. No markup may appear in
anything a client gets; a well-formed call the model writes is still a call."""
from __future__ import annotations

import json
import random

import pytest

from ds4_torch.chat_encoding import EOS
from ds4_torch.output_parser import MarkupFilter, StreamingOutputParser
from serve.http import anthropic_api, openai_api, responses_api
from serve.http.app import ServerConfig, create_app
from serve.http.chat import Choices, Generation
from serve.engine.loop import TokenOut

MARKUP = ("｜DSML｜", "<｜", "<think>", "</think>", "<tool_result>", "</tool_result>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def state(model, tok):
    return create_app(model, tok, ServerConfig(ctx=4096)).state.server  # not started: views only


def random_ids(tok, rng, n):
    specials = [tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens] if hasattr(tok, "all_special_tokens") \
        else []
    protocol = [i for i in range(tok.vocab_size) if "<" in tok.decode([i], skip_special_tokens=False)
                or "｜" in tok.decode([i], skip_special_tokens=False)]
    pool = sorted(set(specials + protocol))
    return [rng.choice(pool) if rng.random() < 0.45 else rng.randrange(tok.vocab_size) for _ in range(n)]


def pieces(tok, ids):
    """The text each token releases, as the engine's incremental detokenizer does."""
    out, prev = [], ""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=False)
        if text.endswith("\ufffd"):
            out.append("")
            continue
        out.append(text[len(prev):])
        prev = text
    return out


def test_the_parser_lets_no_markup_through(tok):
    rng = random.Random(7)
    for trial in range(300):
        ids = random_ids(tok, rng, rng.randint(1, 60))
        thinking = trial % 2 == 1
        parser = StreamingOutputParser(thinking=thinking)
        events = []
        for piece in pieces(tok, ids):
            events += parser.feed(piece)
        events += parser.finish()
        texts = [e.text for e in events if type(e).__name__ in ("ReasoningDelta", "ContentDelta")]
        assert not [m for m in MARKUP for t in texts if m in t], (f"seed 7, trial {trial}", ids, texts)
        r = parser.result
        assert not [m for m in MARKUP if m in r.content or m in r.reasoning]


def test_the_markup_filter_drops_tags_not_text():
    f = MarkupFilter()
    pieces_ = ["a <b> c <", "thi", "nk>d</｜DSML｜par", "ameter>e <｜Us", "er｜> f <｜ not a tag", ""]
    out = "".join(f.feed(p, final=i == len(pieces_) - 1) for i, p in enumerate(pieces_))
    assert out == "a <b> c de  f <｜ not a tag"
    assert f.dropped == ["<think>", "</｜DSML｜parameter>", "<｜User｜>"]
    g = MarkupFilter()  # a tag dropped between two halves of another: the joined one goes too
    assert g.feed("<thi<think>nk>x", final=True) == "x" and g.dropped == ["<think>", "<think>"]


def _drive(state, tok, api: str, body: dict, ids: list[int], stream: bool) -> str:
    """Run `ids` as the model's output through the API's own parsing, Generation and view;
    everything the client would get (SSE bytes or the JSON body), as text."""
    if api == "chat":
        creq, opts = openai_api.parse_chat(body, state=state)
        gen = Choices([Generation.chats(state, creq, 1)])
        view = openai_api.ChatView(state, opts, gen)
    elif api == "completions":
        gen, opts, texts = openai_api.parse_completion(body, state)
        view = openai_api.CompletionView(state, opts, gen, texts)
    elif api == "responses":
        creq, echo = responses_api.parse_request(body, state)
        gen = Generation.chat(state, creq)
        view = responses_api.ResponseView(state, gen, echo)
    else:
        creq, model, _, shown = anthropic_api.parse_request(body)
        gen = Generation.chat(state, creq, call_id_prefix="toolu_")
        view = anthropic_api.MessageView(state, gen, model, shown)
    g = gen.gens[0] if isinstance(gen, Choices) else gen
    req = g.first_request(type("Sink", (), {"push": lambda self, event: None})())
    out = [view.start()]
    for tid, piece in zip(ids, pieces(tok, ids)):
        req.generated.append(tid)
        req.text += piece
        out.append(view.feed(g.events([("token", TokenOut(tid, piece))])))
    req.finish_reason = "length"
    out.append(view.feed(g.events([("done", None)])))
    if stream:
        return b"".join(out).decode("utf-8")
    return json.dumps(view.body(), ensure_ascii=False)


BODIES = {
    "chat": lambda thinking: {"model": "m", "messages": [{"role": "user", "content": "q"}], "tools": TOOLS,
                              "thinking": {"type": "enabled" if thinking else "disabled"}},
    "completions": lambda thinking: {"model": "m", "prompt": "q", "max_tokens": 64},
    "responses": lambda thinking: {"model": "m", "input": "q", "tools": [
        {"type": "function", **TOOLS[0]["function"]}], **({"reasoning": {"effort": "high"}} if thinking else {})},
    "anthropic": lambda thinking: {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "q"}],
                                   "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
                                   **({"thinking": {"type": "enabled", "budget_tokens": 32}} if thinking else {})},
}


@pytest.mark.parametrize("api", list(BODIES))
@pytest.mark.parametrize("thinking", [False, True], ids=["chat-mode", "thinking-mode"])
def test_no_api_lets_markup_through(state, tok, api, thinking):
    seed = 1000 + 2 * list(BODIES).index(api) + thinking  # fixed per case (hash() of a str changes every run)
    rng = random.Random(seed)
    for trial in range(40):
        ids = random_ids(tok, rng, rng.randint(1, 48))
        for stream in (False, True):
            got = _drive(state, tok, api, BODIES[api](thinking), ids, stream)
            assert not [m for m in MARKUP if m in got], (f"seed {seed}, trial {trial}, stream {stream}", ids, got[-800:])


@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
def test_a_well_formed_call_is_still_a_call(state, tok, api):
    text = ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
            "string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    ids = tok.encode(text, add_special_tokens=False) + tok.encode(EOS, add_special_tokens=False)
    got = _drive(state, tok, api, BODIES[api](False), ids, stream=False)
    assert "Paris" in got and "get_weather" in got and not [m for m in MARKUP if m in got]
