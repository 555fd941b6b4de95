"""The HTTP server (serve/): OpenAI endpoints through the official client and raw httpx.

One uvicorn server on a free loopback port (background thread) serves the default model for
the whole module; tests that need other settings adjust the engine/config and restore them.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from ds4_torch.generation import generate
from serve.http.chat import dsml_tokens
from helpers import MODEL, expected, metric, server

CTX = 512
CHUNK = 32


def running_server(**config):
    return server(**{"ctx": CTX, "prefill_chunk": CHUNK, **config})



@pytest.fixture(scope="module")
def srv():
    with running_server() as s:
        yield s


@pytest.fixture
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


# --------------------------------------------------------------------------- basics
def test_models_health_metrics(srv, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    # Interactive Claude Code's connectivity check at start (HEAD, as it sends it).
    assert httpx.head(srv.url + "/api/hello").status_code == 200
    text = httpx.get(srv.url + "/metrics").text
    for name in ("ds4_requests_total", "ds4_prompt_tokens_total", "ds4_cached_prompt_tokens_total",
                 "ds4_generated_tokens_total", "ds4_prefill_chunks_total", "ds4_prefill_aborted_total",
                 "ds4_device_errors_total", "ds4_engine_resets_total", "ds4_queue_depth",
                 "ds4_time_to_first_token_seconds_bucket"):
        assert name in text, name
    assert 'ds4_requests_total{code="200",endpoint="/health"}' in text


def test_chat_greedy_matches_generate(srv, client, model, tok):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ids = tok.encode_chat(messages)
    # No tools offered: the model's greedy text would open a call block (it was trained to call
    # get_weather for this question); the server forbids the
    # DSML tags' tokens (serve.http.chat.no_calls_sampling), so it is generate's with them forbidden.
    assert "<｜DSML｜tool_calls>" in expected(model, tok, ids, 24)[1]
    tokens, text = expected(model, tok, ids, 24, forbidden=dsml_tokens(tok)[0])
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                       logprobs=True, top_logprobs=2,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    c = r.choices[0]
    assert "｜DSML｜" not in text
    assert c.message.content == text and c.message.role == "assistant"
    assert c.finish_reason == "length"
    assert c.token_ids == tokens
    assert [e.token for e in c.logprobs.content] == [tok.decode([t], skip_special_tokens=False) for t in tokens]
    assert all(bytes(e.bytes).decode("utf-8", "replace") == e.token for e in c.logprobs.content)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in c.logprobs.content)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 24
    assert r.usage.total_tokens == len(ids) + 24

    # Streaming, same text; usage last with include_usage.
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    # The same prompt again (a regenerate): its end was checkpointed, nothing is prefilled again.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(ids)
    assert all(ch.usage is None for ch in chunks[:-1])


def test_eos_stops_like_generate(srv, client, model, tok, monkeypatch):
    """The server stops at an EOS token (finish_reason "stop") as generate(eos_token_id=...) does,
    unless ignore_eos. The tiny model never emits its real EOS in chat, so a token it does emit
    plays EOS here."""
    messages = [{"role": "user", "content": "Speak, what say you?"}]
    ids = tok.encode_chat(messages)
    free, _ = expected(model, tok, ids, 24, forbidden=dsml_tokens(tok)[0])
    eos = free[3]
    tokens, text = expected(model, tok, ids, 24, eos=eos, forbidden=dsml_tokens(tok)[0])
    assert tokens[-1] == eos and len(tokens) <= 4
    monkeypatch.setattr(srv.app.state.engine, "eos_ids", frozenset({eos}))
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                       extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.token_ids == tokens and c.message.content == text and c.finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].token_ids == free and r.choices[0].finish_reason == "length"


def test_completions_greedy_matches_generate(srv, client, model, tok):
    prompt = "It was the best of times, it was the worst of times"
    tokens, text = expected(model, tok, tok.encode(prompt), 20)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 20 and len(lp.token_logprobs) == 20 and all(len(t) <= 3 for t in lp.top_logprobs)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in stream) == text
    # Token-id prompts work too.
    ids = tok.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].token_ids == tokens


def test_prefix_reuse(srv, client, model, tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 3)
    body = dict(model=MODEL, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    r1 = client.completions.create(prompt=ids, max_tokens=6, **body)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    gen = r1.choices[0].token_ids
    # A client resending the conversation (prompt + reply + more) only prefills the new suffix:
    # the cache holds the prompt and every generated token but the last.
    chunks0 = metric(srv, "ds4_prefill_chunks_total")
    more = tok.encode(" And then?")
    ids2 = ids + gen + more
    r2 = client.completions.create(prompt=ids2, max_tokens=6, **body)
    assert r2.usage.prompt_tokens_details.cached_tokens == len(ids) + len(gen) - 1
    assert metric(srv, "ds4_prefill_chunks_total") - chunks0 == 1  # 1 + len(more) tokens: one chunk
    assert r2.choices[0].token_ids == expected(model, tok, ids2, 6)[0]
    # The exact cached tokens as a prompt: no prefill at all, the stored logits give the first token.
    cached = ids2 + r2.choices[0].token_ids[:-1]  # what r2's session holds: its last token was never fed
    assert cached in srv.app.state.engine.resident_tokens()
    chunks0 = metric(srv, "ds4_prefill_chunks_total")
    r3 = client.completions.create(prompt=cached, max_tokens=1, **body)
    assert r3.usage.prompt_tokens_details.cached_tokens == len(cached)
    assert metric(srv, "ds4_prefill_chunks_total") == chunks0
    assert r3.choices[0].token_ids == expected(model, tok, cached, 1)[0]
    # A prompt that diverges inside the cached tokens: the cache cannot rewind, so a full prefill.
    r4 = client.completions.create(prompt=ids[:-1] + [ids[-1] ^ 1], max_tokens=2, **body)
    assert r4.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(srv, "ds4_cached_prompt_tokens_total") >= len(cached) + len(ids) + len(gen) - 1


def test_stop_seed_and_sampling(srv, client, model, tok):
    prompt = "Once upon a time"
    _, text = expected(model, tok, tok.encode(prompt), 40)
    stop = text[10:13]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\x00\x00"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.find(stop)]
    s = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True,
                                  extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in s) == text[:text.find(stop)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"top_k": 50, "min_p": 0.05, "return_token_ids": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].token_ids == b.choices[0].token_ids


def test_tokenize_detokenize(srv, tok):
    r = httpx.post(srv.url + "/tokenize", json={"prompt": "héllo"})
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode("héllo") and r.json()["max_model_len"] == CTX
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(srv.url + "/tokenize", json={"messages": msgs})
    assert r.json()["tokens"] == tok.encode_chat(msgs) and r.json()["count"] == len(tok.encode_chat(msgs))
    r = httpx.post(srv.url + "/detokenize", json={"tokens": tok.encode("héllo")})
    assert r.status_code == 200 and r.json() == {"prompt": "héllo"}
    vocab = srv.app.state.server.model.config.vocab_size
    assert httpx.post(srv.url + "/detokenize", json={"tokens": [vocab]}).status_code == 400


# --------------------------------------------------------------------------- bad input
def _chat(**kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body.update(kw)
    return body


BAD = [
    ("malformed json", "/v1/chat/completions", b'{"model": "ds4-default", "messages": [', None, "invalid_json"),
    ("not an object", "/v1/completions", b"[1, 2]", None, "invalid_json"),
    ("temperature type", "/v1/chat/completions", _chat(temperature="hot"), "temperature", "invalid_type"),
    ("max_tokens bool", "/v1/chat/completions", _chat(max_tokens=True), "max_tokens", "invalid_type"),
    ("top_p range", "/v1/chat/completions", _chat(top_p=0), "top_p", "invalid_value"),
    ("n=0", "/v1/chat/completions", _chat(n=0), "n", "invalid_value"),
    ("tool without function", "/v1/chat/completions", _chat(tools=[{"type": "function"}]), "tools", "invalid_value"),
    ("tool_choice unknown function", "/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "f"}}],
           tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice", "invalid_value"),
    ("tool_choice without tools", "/v1/chat/completions", _chat(tool_choice="required"), "tool_choice",
     "invalid_value"),
    ("legacy functions", "/v1/chat/completions", _chat(functions=[{"name": "f"}]), "functions",
     "unsupported_parameter"),
    ("thinking shape", "/v1/chat/completions", _chat(thinking={"type": "on"}), "thinking", "invalid_type"),
    ("reasoning_effort", "/v1/chat/completions", _chat(reasoning_effort="extreme"), "reasoning_effort",
     "invalid_value"),
    ("tool message without id", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]), "messages[1].tool_call_id",
     "missing_required_parameter"),
    ("bad role", "/v1/chat/completions", _chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role",
     "invalid_value"),
    ("no messages", "/v1/chat/completions", {"model": MODEL}, "messages", "invalid_type"),
    ("stop type", "/v1/chat/completions", _chat(stop=[1]), "stop", "invalid_type"),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": [5] * CTX, "max_tokens": 1}, "prompt",
     "context_length_exceeded"),
    ("token id", "/v1/completions", {"model": MODEL, "prompt": [1, 10**6]}, "prompt", "invalid_value"),
    ("prompt batch item", "/v1/completions", {"model": MODEL, "prompt": ["a", [5, True]]}, "prompt[1]",
     "invalid_type"),
    ("stream_options without stream", "/v1/chat/completions", _chat(stream_options={"include_usage": True}),
     "stream_options", "invalid_value"),
]


@pytest.mark.parametrize("name,path,body,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input(srv, name, path, body, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
    assert err["message"]


def test_bad_input_through_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * CTX)
    assert e.value.code == "context_length_exceeded"


def test_body_limit_and_auth(srv, monkeypatch):
    config = srv.app.state.config
    monkeypatch.setattr(config, "max_body_bytes", 1000)
    big = json.dumps(_chat(messages=[{"role": "user", "content": "x" * 2000}])).encode()
    r = httpx.post(srv.url + "/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # Chunked upload (no Content-Length) is cut off the same way.
    r = httpx.post(srv.url + "/v1/chat/completions", content=iter([big[:600], big[600:]]),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    monkeypatch.setattr(config, "max_body_bytes", 32 * 2**20)

    monkeypatch.setattr(config, "api_key", "s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = httpx.post(srv.url + "/v1/chat/completions", json=_chat(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
    ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
    assert ok.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=2, extra_body={"ignore_eos": True}).choices[0].finish_reason \
        == "length"  # (sampled at temperature 1, EOS could otherwise come second)
    assert metric(srv, "ds4_requests_total", endpoint="/v1/chat/completions", code="401") >= 3


# --------------------------------------------------------------------------- concurrency
def test_32_concurrent_streams(srv, model, tok):
    """32 streams at once: each gets exactly its own greedy continuation (no mix-up between
    requests), checked against `generate()` on the same model."""
    prompts = [f"client {i}: hello" for i in range(32)]

    async def main():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i):
            stream = await client.completions.create(
                model=MODEL, prompt=prompts[i], max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
            chunks = [ch async for ch in stream]
            return chunks

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 32
    for prompt, chunks in zip(prompts, results):
        expected = list(generate(model, tok.encode(prompt), 4))  # greedy, no EOS stop (as ignore_eos)
        got = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
        assert got == expected, prompt
        assert chunks[-1].usage.completion_tokens == 4
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert metric(srv, "ds4_queue_depth") == 0
