"""The server samples a whole decode batch in one call and makes text on the output part's thread
(issue #22): through HTTP, a seeded request's tokens are the same alone, in a batch of 16 and
beside requests with penalties, bias or grammars, and equal a sequential reference written from
the sampling definitions over stateless forwards (with the same noise, `gumbel_noise`); stop
strings cut the text exactly where they begin, streamed or whole, also when the stop spans tokens,
and usage counts the tokens up to the one that completed the stop; a row whose logits overflow
fails only its own request."""
from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import pytest
import torch

from ds4_torch.default_model import default_tokenizer
from ds4_torch.generation import generate
from ds4_torch.sampling import gumbel_noise, seed_words
from helpers import MODEL, metric, prompt_ids, server, stop_spanning_tokens, wait_for

TIMEOUT = 120


@pytest.fixture(scope="module")
def srv(model):
    with server(model, ctx=256, prefill_chunk=32, max_batch=16) as s:
        yield s


def complete(srv, prompt, n, **extra):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT)


def seeded_reference(model, ids, n, temperature, top_k, seed):
    """Temperature and top-k, then Gumbel-max with the noise of (seed, token index), from
    stateless forwards: what a seeded request must give however it is batched."""
    seeds = torch.tensor([seed_words(seed)])
    gen = []
    for i in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids + gen]))[0, -1].float() / temperature
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        noise = gumbel_noise(seeds, torch.tensor([i]), logits.numel())[0]
        gen.append(int(torch.argmax(logits + noise)))
    return gen


def test_seeded_request_is_the_same_alone_in_a_batch_of_16_and_beside_any_settings(srv, model):
    ids, n = prompt_ids(20, 7), 12
    seeded = dict(temperature=0.9, top_k=40, seed=4321)
    want = seeded_reference(model, ids, n, 0.9, 40, 4321)
    alone = complete(srv, ids, n, **seeded)
    assert alone.status_code == 200, alone.text
    assert alone.json()["choices"][0]["token_ids"] == want

    neighbours = [
        dict(),                                                       # greedy
        dict(temperature=0.7, seed=1),
        dict(temperature=1.0, top_p=0.8, seed=2),
        dict(temperature=0.8, min_p=0.1, seed=3),
        dict(presence_penalty=1.5, frequency_penalty=0.5),
        dict(repetition_penalty=1.3, temperature=0.6, seed=5),
        dict(logit_bias={"100": 5, "200": -100}),
        dict(min_tokens=8, ignore_eos=False),
        dict(temperature=1.2, top_k=5, seed=6, logprobs=3),
        dict(stop_token_ids=[50, 60]),
        dict(temperature=0.5, seed=7, presence_penalty=-1.0),
    ]
    engine = srv.app.state.engine
    steps0, rows0 = metric(srv, "ds4_batch_size_count"), metric(srv, "ds4_batch_size_sum")
    engine.chunk_delay = 0.02  # admissions spread over the first steps: everyone decodes together
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            ours = [pool.submit(complete, srv, ids, n, **seeded) for _ in range(2)]
            others = [pool.submit(complete, srv, prompt_ids(15 + i, 40 + i), 24, **extra)
                      for i, extra in enumerate(neighbours)]
            grammars = [pool.submit(httpx.post, srv.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": f"Give me a record {i}"}],
                "max_tokens": 24, "temperature": 0.8, "seed": i,
                "response_format": {"type": "json_object"}}, timeout=TIMEOUT) for i in range(3)]
            results = [f.result() for f in ours + others + grammars]
    finally:
        engine.chunk_delay = 0.0
    for r in results:
        assert r.status_code == 200, r.text
    for r in results[:2]:
        assert r.json()["choices"][0]["token_ids"] == want
    for r in results[-3:]:
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    steps = metric(srv, "ds4_batch_size_count") - steps0
    rows = metric(srv, "ds4_batch_size_sum") - rows0
    assert rows / steps > 8, f"mean batch {rows / steps:.2f}: the requests did not decode together"


def everything_reference(model, ids, n, *, temperature, top_k, top_p, min_p, presence, frequency, repetition,
                         bias, seed):
    """Every setting at once, each from its definition over stateless forwards: logit_bias (-100
    bans), repetition penalty (seen in the prompt or the output: divided when positive, multiplied
    otherwise), frequency and presence penalties (generated tokens), temperature, top-k, top-p (a
    token goes when the better ones before it already reach top_p), min-p (p < min_p * p_max goes),
    then Gumbel-max with the noise of (seed, token index)."""
    seeds = torch.tensor([seed_words(seed)])
    gen = []
    for i in range(n):
        with torch.no_grad():
            x = model(torch.tensor([ids + gen]))[0, -1].float().clone()
        for t, b in bias.items():
            x[t] = float("-inf") if b <= -100 else x[t] + b
        for t in set(ids + gen):
            x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
        for t in set(gen):
            x[t] -= gen.count(t) * frequency + presence
        x = x / temperature
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], float("-inf"))
        ranked, order = torch.sort(x, descending=True, stable=True)
        probs = torch.softmax(ranked, -1)
        before = torch.cumsum(probs, -1) - probs
        x[order[before >= top_p]] = float("-inf")
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < min_p * probs.max(), float("-inf"))
        gen.append(int(torch.argmax(x + gumbel_noise(seeds, torch.tensor([i]), x.numel())[0])))
    return gen


# Two sets of settings under which every setting changes the tokens (each was checked by leaving
# it out of the reference): the first bites with top-k, top-p, min-p, presence, repetition and
# bias; the second (penalties that favour repeats) with presence, frequency, repetition and bias.
EVERYTHING = [dict(temperature=1.3, top_k=40, top_p=0.6, min_p=0.15, presence=-1.5, frequency=1.0, repetition=2.0,
                   bias={15: -100.0, 552: 4.0}, seed=99),
              dict(temperature=1.3, top_k=40, top_p=0.6, min_p=0.15, presence=-2.0, frequency=-1.0, repetition=2.0,
                   bias={15: -100.0, 552: 4.0}, seed=99)]


def _body(settings):
    return dict(temperature=settings["temperature"], top_k=settings["top_k"], top_p=settings["top_p"],
                min_p=settings["min_p"], presence_penalty=settings["presence"],
                frequency_penalty=settings["frequency"], repetition_penalty=settings["repetition"],
                logit_bias={str(t): b for t, b in settings["bias"].items()}, seed=settings["seed"])


def test_every_setting_at_once_equals_its_definitions_alone_and_in_a_batch(srv, model):
    ids, n = prompt_ids(24, 13), 16
    wants = [everything_reference(model, ids, n, **settings) for settings in EVERYTHING]
    assert wants[0] != wants[1]
    for settings, want in zip(EVERYTHING, wants):
        assert complete(srv, ids, n, **_body(settings)).json()["choices"][0]["token_ids"] == want
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        others = [pool.submit(complete, srv, prompt_ids(14 + i, 70 + i), 24, temperature=0.6 + 0.1 * i, seed=i)
                  for i in range(6)]
        ours = [pool.submit(complete, srv, ids, n, **_body(settings)) for settings in EVERYTHING]
        assert all(f.result().status_code == 200 for f in others)
    for f, want in zip(ours, wants):
        assert f.result().json()["choices"][0]["token_ids"] == want


def test_greedy_requests_in_a_batch_of_16_equal_generate(srv, model):
    prompts = [prompt_ids(10 + 3 * i, 90 + i) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: complete(srv, p, 16), prompts))
    for p, r in zip(prompts, results):
        assert r.json()["choices"][0]["token_ids"] == list(generate(model, p, 16))


# --------------------------------------------------------------------------- stop strings
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_tokens_cuts_exactly_and_counts_usage(srv, model, stream):
    tok = default_tokenizer()
    ids, n = prompt_ids(25, 3), 40
    tokens = list(generate(model, ids, n))
    stop, text, upto = stop_spanning_tokens(tok, tokens)
    body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stop": [stop],
            "return_token_ids": True}
    if not stream:
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == text and choice["finish_reason"] == "stop"
        assert choice["token_ids"] == tokens[:upto]
        assert r.json()["usage"]["completion_tokens"] == upto
        return
    body.update(stream=True, stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices", []):
                    pieces.append(c["text"])
                    finish = c.get("finish_reason") or finish
    assert "".join(pieces) == text and finish == "stop"
    assert usage["completion_tokens"] == upto


def test_stop_string_in_a_busy_batch_and_the_session_keeps_what_was_fed(srv, model):
    """Beside other streams (the output thread lags the engine by a step or two), the cut and the
    count are the same; a follow-up reuses at least the reply up to the stop."""
    tok = default_tokenizer()
    ids, n = prompt_ids(30, 11), 40
    tokens = list(generate(model, ids, n))
    stop, text, upto = stop_spanning_tokens(tok, tokens)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        others = [pool.submit(complete, srv, prompt_ids(12 + i, 60 + i), 48) for i in range(6)]
        r = complete(srv, ids, n, stop=[stop])
        assert all(f.result().status_code == 200 for f in others)
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["token_ids"], r.json()["usage"]["completion_tokens"]) == \
        (text, tokens[:upto], upto)
    follow = ids + tokens[:upto] + prompt_ids(5, 12)
    again = complete(srv, follow, 4).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids) + upto - 1
    assert again["choices"][0]["token_ids"] == list(generate(model, follow, 4))


def test_a_stop_string_that_is_one_token_ends_the_request_at_once(srv, model):
    """A stop string that is exactly one token's text (as `</think>` is) ends the request at that
    token on the engine thread: the same cut and count as any stop, and the session holds exactly
    the prompt and the reply but its last token, so a follow-up reuses all of it."""
    tok = default_tokenizer()
    ids, n = prompt_ids(26, 17), 40
    tokens = list(generate(model, ids, n))
    full = tok.decode(tokens)
    for m in range(3, n):
        stop = tok.decode([tokens[m]])
        if len(stop) >= 2 and stop.strip() == stop and tok.encode(stop, add_special_tokens=False) == [tokens[m]] \
                and full.find(stop) == len(tok.decode(tokens[:m])):
            break
    else:
        raise AssertionError("no single-token stop string in this continuation")
    r = complete(srv, ids, n, stop=[stop]).json()
    assert r["choices"][0]["text"] == full[:full.find(stop)] and r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["token_ids"] == tokens[:m + 1] and r["usage"]["completion_tokens"] == m + 1
    follow = ids + tokens[:m + 1] + prompt_ids(5, 18)
    again = complete(srv, follow, 4).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) + m
    assert again["choices"][0]["token_ids"] == list(generate(model, follow, 4))


# --------------------------------------------------------------------------- a row that overflows
def test_a_row_whose_logits_overflow_fails_alone(srv, model, monkeypatch):
    """Logits that turn NaN or inf in one row of a batched step (injected into the rows of requests
    asking for top_k 13) fail that request with a 500; the stream beside it is exact."""
    engine = srv.app.state.engine
    replica = engine.replica
    real = replica.decode

    def decode(ids):
        logits = real(ids).clone()
        for i, req in enumerate(engine.running[:len(ids)]):
            if req.sampling.top_k == 13 and len(req.generated) >= 2:
                logits[i, 7] = float("nan") if req.sampling.seed == 1 else float("inf")
        return logits

    monkeypatch.setattr(replica, "decode", decode)
    ids, n = prompt_ids(18, 5), 30
    want = list(generate(model, ids, n))
    engine.token_delay = 0.01
    out = {}
    try:
        beside = threading.Thread(target=lambda: out.update(r=complete(srv, ids, n)))
        beside.start()
        wait_for(lambda: engine.running, what="the stream to decode")
        for seed in (1, 2):
            r = complete(srv, prompt_ids(9, 6), 10, temperature=1.0, top_k=13, seed=seed)
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
            assert "not finite" in r.json()["error"]["message"]
        beside.join(TIMEOUT)
    finally:
        engine.token_delay = 0.0
    assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["token_ids"] == want
    assert engine.health() is None


def test_metrics_split_step_time_into_model_sampling_and_host(srv):
    before = {p: metric(srv, "ds4_step_seconds_count", part=p) for p in ("model", "sampling", "host")}
    assert complete(srv, prompt_ids(10, 1), 8).status_code == 200
    text = httpx.get(srv.url + "/metrics").text
    for part in ("model", "sampling", "host"):
        assert f'ds4_step_seconds_bucket{{le="0.001",part="{part}"}}' in text
        assert metric(srv, "ds4_step_seconds_count", part=part) >= before[part] + 7  # 7 decode steps
        assert metric(srv, "ds4_step_seconds_sum", part=part) > 0


def test_a_running_engine_bounds_how_long_another_thread_keeps_the_gil(srv):
    """The engine thread gives up the GIL around every op; Python's switch interval bounds how long
    the event loop or the output thread keeps it meanwhile, so a running engine shortens it."""
    import sys

    from serve.engine.loop import GIL_SWITCH_INTERVAL_S

    assert sys.getswitchinterval() <= GIL_SWITCH_INTERVAL_S <= 0.002
