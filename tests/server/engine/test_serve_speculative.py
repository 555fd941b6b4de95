"""Speculative decoding in the server (`serve --speculative-tokens N`, issue #24): continuous
batching with one batched verify step per iteration and per-sequence acceptance. The independent
expectation is the same server without speculation: the tokens (greedy, seeded, penalised,
grammar-constrained), their logprobs, the finish reasons and what the sessions keep for the next
turn must be the same; only the number of forwards changes. Prompts are long enough to cross the
prefill chunk (the MTP layer is carried from chunk to chunk) and requests end inside a step's
tokens (stop token ids, max_tokens), which must give the rest back to the cache."""
from __future__ import annotations

import concurrent.futures
import json
import logging

import httpx
import pytest

from ds4_torch.default_model import default_tokenizer
from ds4_torch.faults import reset_fault_counts
from serve.cli import build_parser, load
from ds4_torch.runtime import UserError
from helpers import server

MODEL = "ds4-default"
TIMEOUT = 120
PROMPTS = ["ROMEO:\nWhat light through yonder", "First Citizen:\nBefore we proceed any further, hear me speak. " * 3,
           "KING HENRY:\n", "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind"]


def speculating_server(model, n, **config):
    """A server speculating N tokens in every step ("always": the steps under test; the "auto"
    policy is tested on its own below)."""
    return server(model, **{"ctx": 512, "prefill_chunk": 32, "max_batch": 4, "speculative_tokens": n,
                             "speculative_policy": "always", **config})


def complete(srv, prompt, max_tokens, **extra):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


_plain_runs: dict = {}


def run_all(model, n, requests, **config):
    """The four prompts at once (one batch), each with its own settings; the choices, the
    server's metrics and its resident sessions. A plain server's (n = 0, the expectation) are
    worked out once per model, requests and settings: several tests compare with the same."""
    key = (id(model), json.dumps(requests, sort_keys=True), json.dumps(config, sort_keys=True)) if n == 0 else None
    if key in _plain_runs:
        return _plain_runs[key]
    with speculating_server(model, n, **config) as srv:
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as ex:
            out = list(ex.map(lambda kw: complete(srv, **kw), requests))
        engine = srv.app.state.engine
        sessions = [(list(s.tokens), int(engine.resident.positions[s.slot])) for s in engine.sessions if s.tokens]
    if key is not None:
        _plain_runs[key] = out, srv.app.state.metrics, sessions
    return out, srv.app.state.metrics, sessions


@pytest.fixture(scope="module")
def model(model):
    assert model.mtp is not None, "the embedded model ships an MTP layer"
    return model


@pytest.mark.parametrize("n,mode", [(1, "eager"), (3, "eager")])
def test_greedy_batch_gives_plain_tokens(model, n, mode):
    """Graph mode (the verify, MTP and rollback steps captured per power-of-two width, the capture
    emulator on CPU, the rows past the batch idle) is test_twelve_chats_ending_in_different_steps_
    keep_their_own_state's "graph" run: the same tokens and counts, each session's cache at its
    tokens' position, with more going on."""
    requests = [dict(prompt=p, max_tokens=23 + 7 * i) for i, p in enumerate(PROMPTS)]
    plain, _, plain_sessions = run_all(model, 0, requests)
    spec, metrics, sessions = run_all(model, n, requests, decode_mode=mode)
    assert [c["token_ids"] for c in spec] == [c["token_ids"] for c in plain]
    assert [c["finish_reason"] for c in spec] == ["length"] * 4
    # each session holds what plain decoding fed (every token but the last), at that position
    assert sorted(sessions) == sorted(plain_sessions)
    assert all(len(tokens) == position for tokens, position in sessions)
    drafted, accepted = metrics.value("ds4_spec_draft_tokens_total"), metrics.value("ds4_spec_accepted_tokens_total")
    steps, emitted = metrics.value("ds4_spec_verify_steps_total"), metrics.value("ds4_spec_emitted_tokens_total")
    assert 0 < accepted <= drafted <= n * steps
    assert emitted == steps + accepted
    assert metrics.value("ds4_spec_acceptance_length") == pytest.approx(emitted / steps)


def test_plain_steps_above_the_speculation_limit(model):
    """`speculative_max_batch=2`: four requests of different lengths decode plainly while more
    than two run, then speculate (their MTP layers rejoining after the plain steps): the tokens
    of a server that never speculates, seeded ones included."""
    requests = [dict(prompt=p, max_tokens=12 + 14 * i, temperature=0.7 * (i % 2), seed=i) for i, p in enumerate(PROMPTS)]
    plain, _, plain_sessions = run_all(model, 0, requests)
    spec, metrics, sessions = run_all(model, 2, requests, speculative_max_batch=2)
    assert [c["token_ids"] for c in spec] == [c["token_ids"] for c in plain]
    assert sorted(sessions) == sorted(plain_sessions)
    assert metrics.value("ds4_spec_accepted_tokens_total") > 0
    steps = metrics.value("ds4_batch_size_count")
    assert metrics.value("ds4_spec_verify_steps_total") < metrics.value("ds4_batch_size_sum") and steps > 0


def test_seeded_penalised_and_logprobs_match_plain(model):
    requests = [dict(prompt=PROMPTS[0], max_tokens=30, temperature=0.8, seed=11),
                dict(prompt=PROMPTS[1], max_tokens=30, temperature=1.0, top_k=20, seed=12, logprobs=3),
                dict(prompt=PROMPTS[2], max_tokens=30, presence_penalty=1.5, frequency_penalty=0.5),
                dict(prompt=PROMPTS[3], max_tokens=30, logprobs=2, logit_bias={"11": 3.0})]
    plain, _, _ = run_all(model, 0, requests)
    spec, metrics, _ = run_all(model, 2, requests)
    assert [c["token_ids"] for c in spec] == [c["token_ids"] for c in plain]
    # Verify steps score several positions in one forward, so fp32 sums run in another order:
    # the house's fp32 tolerance (1e-4), not bit equality (CI saw 1.0e-5 on a logprob of -4.7).
    for got, want in zip(spec, plain):
        if want["logprobs"] is None:
            continue
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
        for g, w in zip(got["logprobs"]["top_logprobs"], want["logprobs"]["top_logprobs"]):
            assert g.keys() == w.keys() and list(g.values()) == pytest.approx(list(w.values()), abs=1e-4)
    assert metrics.value("ds4_spec_accepted_tokens_total") > 0


def test_a_request_ending_inside_a_step_gives_the_rest_back(model):
    """A stop token id met among a step's accepted drafts ends the request there: the finish is
    the plain one, and the session holds exactly what plain decoding fed, so the next turn
    (which extends it) gives the plain continuation."""
    base, _, _ = run_all(model, 0, [dict(prompt=p, max_tokens=40) for p in PROMPTS])
    requests = []
    for i, p in enumerate(PROMPTS):  # each stops at a token of its greedy continuation, 5 to 20 tokens in
        ids = base[i]["token_ids"]
        k = next(j for j in range(5 + 3 * i, 40) if ids[j] not in ids[:j])
        requests.append(dict(prompt=p, max_tokens=40, stop_token_ids=[ids[k]]))
    for n in (0, 3):
        with speculating_server(model, n) as srv:
            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                first = list(ex.map(lambda kw: complete(srv, **kw), requests))
            engine = srv.app.state.engine
            held = sorted((list(s.tokens), int(engine.resident.positions[s.slot])) for s in engine.sessions if s.tokens)
            # the next turn: the prompt, the reply and more text
            follow = [complete(srv, PROMPTS[i] + c["text"] + "\nJULIET:", 12) for i, c in enumerate(first)]
            result = ([c["token_ids"] for c in first], [c["finish_reason"] for c in first], held,
                      [c["token_ids"] for c in follow])
        if n == 0:
            want = result
    assert result[1] == ["stop"] * 4
    assert all(len(tokens) == position for tokens, position in result[2])
    assert result == want


def chat(srv, content, max_tokens, **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_grammar_requests_take_one_token_per_step(model):
    """A request with a JSON schema speculates one token per step (its grammar masks one
    position), beside others that take several: the same replies as without speculation."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    asks = [dict(content="Who are you?", max_tokens=40, response_format=fmt),
            dict(content=PROMPTS[1], max_tokens=20), dict(content=PROMPTS[3], max_tokens=25)]
    replies = []
    for n in (0, 2):
        with speculating_server(model, n) as srv:
            with concurrent.futures.ThreadPoolExecutor(len(asks)) as ex:
                replies.append(list(ex.map(lambda kw: chat(srv, **kw), asks)))
    assert [(c["message"], c["finish_reason"]) for c in replies[1]] == \
        [(c["message"], c["finish_reason"]) for c in replies[0]]
    assert json.loads(replies[1][0]["message"]["content"]).keys() == {"name"}


def test_metrics_and_request_log_show_acceptance(model, caplog):
    with speculating_server(model, 2) as srv, caplog.at_level(logging.INFO, logger="ds4.serve"):
        complete(srv, PROMPTS[1], 30)
        text = httpx.get(srv.url + "/metrics", timeout=TIMEOUT).text
    for name in ("ds4_spec_draft_tokens_total", "ds4_spec_accepted_tokens_total", "ds4_spec_verify_steps_total",
                 "ds4_spec_acceptance_length"):
        assert name in text
    line = next(r.getMessage() for r in caplog.records if "draft_tokens=" in r.getMessage())
    drafted = int(line.split("draft_tokens=")[1].split()[0])
    accepted = int(line.split("accepted_drafts=")[1].split()[0])
    assert 0 < accepted <= drafted


def test_a_failed_step_is_retried_with_the_same_tokens(model, monkeypatch):
    """A device error in a verify step resets the batch and retries the request after the
    tokens it sent (prefilled again, the MTP layer with them): the same tokens as without."""
    want, _, _ = run_all(model, 0, [dict(prompt=PROMPTS[1], max_tokens=30)])
    reset_fault_counts()
    monkeypatch.setenv("DS4_TORCH_FAULT", "decode:6")
    got, metrics, _ = run_all(model, 2, [dict(prompt=PROMPTS[1], max_tokens=30)])
    assert metrics.value("ds4_device_errors_total") == 1
    assert got[0]["token_ids"] == want[0]["token_ids"]


def test_serve_refuses_speculation_without_an_mtp_layer(tmp_path):
    """A model without an MTP layer (the asset with its config's MTP slot removed: the loader
    drops the mtp.* weights) is refused at start with a message naming the flag."""
    import json
    import shutil

    from ds4_torch.default_model import DEFAULT_MODEL_DIR

    shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(num_nextn_predict_layers=0, mtp_layer_types=[])
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    args = build_parser().parse_args(["--model", str(tmp_path / "m"), "--speculative-tokens", "1", "--ctx", "256"])
    with pytest.raises(UserError, match="--speculative-tokens 1 needs a model with an MTP layer"):
        load(args)


def test_a_stop_string_inside_a_step_leaves_the_session_at_the_stop(model):
    """The output part finds a stop string (spanning tokens) among the tokens one verify step
    took: the engine gives the step's later tokens back, so the session holds the reply up to
    the stop's last token and a follow-up reuses it, as without speculation; the text, tokens
    and usage are the plain ones."""
    from ds4_torch.generation import generate
    from helpers import prompt_ids, stop_spanning_tokens

    tok = default_tokenizer()
    ids, n = prompt_ids(30, 11), 40
    tokens = list(generate(model, ids, n))
    stop, text, upto = stop_spanning_tokens(tok, tokens)
    with speculating_server(model, 3) as srv:
        r = complete(srv, ids, n, stop=[stop])
        assert (r["text"], r["token_ids"], r["finish_reason"]) == (text, tokens[:upto], "stop")
        follow = ids + tokens[:upto] + prompt_ids(5, 12)
        body = {"model": MODEL, "prompt": follow, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        again = httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) + upto - 1
    assert again["choices"][0]["token_ids"] == list(generate(model, follow, 4))


def test_a_row_whose_verified_logits_overflow(model, monkeypatch):
    """NaN or inf in the verified logits of one request: at its first position the request fails
    alone (a 500 naming it); at later positions only, it keeps the tokens before them (and so
    gives the same tokens as a plain server); the stream beside it is exact."""
    from ds4_torch.decode import SpeculativeForwards

    seeded = [dict(prompt=PROMPTS[2], max_tokens=10, temperature=1.0, top_k=13, seed=seed) for seed in (1, 2)]
    want, _, _ = run_all(model, 0, [dict(prompt=PROMPTS[1], max_tokens=30), seeded[1]])
    with speculating_server(model, 2) as srv:
        engine = srv.app.state.engine
        real = SpeculativeForwards.verify

        def verify(self, ids, undo):
            logits, streams = real(self, ids, undo)
            logits = logits.clone()
            for i, req in enumerate(engine.running[:ids.shape[0]]):
                if req.sampling.top_k == 13 and len(req.generated) >= 2:
                    first = 0 if req.sampling.seed == 1 else 1
                    logits[i, first:, 7] = float("nan") if req.sampling.seed == 1 else float("inf")
            return logits, streams

        monkeypatch.setattr(SpeculativeForwards, "verify", verify)
        engine.token_delay = 0.01
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            beside = ex.submit(complete, srv, PROMPTS[1], 30)
            body = {"model": MODEL, "ignore_eos": True, "return_token_ids": True, **seeded[0]}
            failed = ex.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=TIMEOUT)
            capped = ex.submit(complete, srv, **seeded[1])
            r = failed.result()
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
            assert "not finite" in r.json()["error"]["message"]
            assert [beside.result()["token_ids"], capped.result()["token_ids"]] == [c["token_ids"] for c in want]
        assert engine.health() is None


def test_a_request_running_into_the_context_limit(model):
    """A reply that fills the context ends with "length" at the same token with or without
    speculation (the last steps draft only what still fits)."""
    from helpers import prompt_ids

    ids = prompt_ids(40, 21)
    replies = []
    for n in (0, 3):
        with speculating_server(model, n, ctx=64) as srv:
            r = complete(srv, ids, 100)
            replies.append((r["token_ids"], r["finish_reason"]))
    assert replies[1] == replies[0] and replies[0][1] == "length" and 64 - 40 <= len(replies[0][0]) <= 64 + 1 - 40


def test_the_auto_policy_runs_the_faster_kind_of_step():
    """`SpeculationPolicy("auto")`: each kind measured once per batch size (speculation first),
    then the faster one, the other tried every `probe_every` steps; a measured slowdown turns
    speculation off for that size only; the batch limit holds for every policy."""
    from serve.engine.speculation import SpeculationPolicy

    p = SpeculationPolicy("auto", max_batch=8, probe_every=4)
    assert p.speculate(1)
    p.record(1, True, 5, 0.010)                 # 500 tok/s speculating
    assert not p.speculate(1)
    p.record(1, False, 1, 0.004)                # 250 tok/s plain
    kinds = []
    for _ in range(8):
        kinds.append(p.speculate(1))
        p.record(1, kinds[-1], 5 if kinds[-1] else 1, 0.010 if kinds[-1] else 0.004)
    assert kinds == [True, False, True, True, True, False, True, True]  # plain tried every 4th step of the size
    q = SpeculationPolicy("auto", probe_every=4)
    q.record(16, True, 20, 0.020)               # at 16 rows speculation is slower
    q.record(16, False, 16, 0.010)
    assert q.speculate(16) is False and q.speculate(2) is True  # 2 rows: unmeasured, tried speculating
    q.record(16, False, 16, 0.010)
    before = dict(q.rate)
    assert q.speculate(16) is True  # the probe of speculation (the 4th step of the size) lasts 4 steps
    q.record(16, True, 16, 0.5, fair=False)  # its first: rows rejoining, counted, not measured
    assert q.rate == before
    assert [q.speculate(16) for _ in range(3)] == [True] * 3 and q.speculate(16) is False
    assert not p.speculate(9) and not SpeculationPolicy("always", max_batch=8).speculate(9)
    assert SpeculationPolicy("always").speculate(64)
    with pytest.raises(ValueError, match="speculative policy"):
        SpeculationPolicy("sometimes")


def test_the_auto_policy_serves_plain_tokens(model):
    """A server with the default policy ("auto") switches kinds as it measures them: the tokens
    are a plain server's, and it ran both kinds of step."""
    requests = [dict(prompt=p, max_tokens=60) for p in PROMPTS[:2]]
    plain, _, _ = run_all(model, 0, requests)
    spec, metrics, _ = run_all(model, 2, requests, speculative_policy="auto")
    assert [c["token_ids"] for c in spec] == [c["token_ids"] for c in plain]
    steps, verify = metrics.value("ds4_batch_size_count"), metrics.value("ds4_spec_verify_steps_total")
    assert 0 < verify and metrics.value("ds4_batch_size_sum") > verify  # some rows decoded plainly


def _stop_at(tok, tokens, k):
    """A stop string whose first occurrence in the text of `tokens` ends inside token k (k >= 2),
    and the count of tokens up to the one that completes it; None when there is none."""
    texts = [tok.decode(tokens[:m]) for m in range(len(tokens) + 1)]
    full = texts[-1]
    end = len(texts[k + 1])
    for width in (3, 4, 5, 6):
        stop = full[max(0, end - width):end]
        if stop.strip() and full.find(stop) == end - len(stop):
            return stop, next(m for m in range(len(tokens) + 1) if stop in texts[m])
    return None


def test_twelve_chats_ending_in_different_steps_keep_their_own_state(model):
    """Twelve greedy requests at once: six end at stop strings found among a verify step's tokens
    (given back one iteration later), six by length in other steps, so between a step and its trim
    requests leave (the last row moving into the hole) and new ones join (in graph mode into the
    step's padding rows). Every request's reply and its next turn (which reuses its session) are
    those of a server that does not speculate; three runs, since the batch's shape each time
    depends on arrival order. Before the speculator's trim touched only the rows it was asked to,
    other requests' rows took a stopped request's rollback."""
    tok = default_tokenizer()
    prompts = [f"{name}:\n" for name in ("ROMEO", "JULIET", "KING HENRY", "First Citizen", "MENENIUS", "HAMLET",
                                         "GLOUCESTER", "LADY MACBETH", "BRUTUS", "PORTIA", "OTHELLO", "CORIOLANUS")]
    base, _, _ = run_all(model, 0, [dict(prompt=p, max_tokens=40) for p in prompts], max_batch=12)
    requests = []
    for i, (p, c) in enumerate(zip(prompts, base)):
        found = _stop_at(tok, c["token_ids"], 4 + 3 * i // 2) if i % 2 == 0 else None
        if found is not None:
            requests.append(dict(prompt=p, max_tokens=40, stop=[found[0]]))
        else:
            requests.append(dict(prompt=p, max_tokens=9 + 2 * i))
    assert sum("stop" in r for r in requests) >= 4

    def turns(n, mode="eager"):
        with speculating_server(model, n, max_batch=12, max_sessions=32, decode_mode=mode) as srv:
            with concurrent.futures.ThreadPoolExecutor(12) as ex:
                first = list(ex.map(lambda kw: complete(srv, **kw), requests))
                second = list(ex.map(lambda i: httpx.post(srv.url + "/v1/completions", json={
                    "model": MODEL, "prompt": prompts[i] + first[i]["text"] + "\nJULIET:", "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}, timeout=TIMEOUT).json(),
                    range(12)))
            engine = srv.app.state.engine
            # each session's cache is at the position of the tokens it says it holds
            assert all(len(s.tokens) == int(engine.resident.positions[s.slot]) for s in engine.sessions)
            if n:  # the drafts were taken (the MTP layer's, graph mode's too, draft the right tokens)
                m = srv.app.state.metrics
                drafted, accepted = m.value("ds4_spec_draft_tokens_total"), m.value("ds4_spec_accepted_tokens_total")
                steps, emitted = m.value("ds4_spec_verify_steps_total"), m.value("ds4_spec_emitted_tokens_total")
                assert 0 < accepted <= drafted <= n * steps and emitted == steps + accepted, (n, mode)
        # (not the cached counts: without speculation a stop string found a step late leaves the
        # session a token past it, which the next turn does not share)
        return ([(c["token_ids"], c["text"], c["finish_reason"]) for c in first],
                [c["choices"][0]["token_ids"] for c in second])

    want = turns(0)
    assert {c[2] for c in want[0]} == {"stop", "length"}
    for n, mode in ((2, "eager"), (2, "graph"), (3, "eager")):
        got = turns(n, mode)
        assert got[0] == want[0], (n, mode)
        assert got[1] == want[1], (n, mode)

