"""What real clients ask of the engine beyond plain sampling, checked on `GenRequest`s submitted
straight to an `Engine` (no HTTP): prompt logprobs against the model's own stateless forward,
several seeded choices sharing one prefill, logit bias, penalties against their formulas
recomputed here, stop_token_ids and min_tokens, and JSON-schema outputs that always validate."""
from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch

from ds4_torch.faults import reset_fault_counts
from ds4_torch.json_schema import validate_json_schema
from ds4_torch.sampling import SamplingParams
from helpers import held_prefill, penalised_greedy, reference_logprobs, wait_for
from serve.engine.loop import Engine, GenRequest

CTX = 256
CHUNK = 16
TEXT = ("MENENIUS:\nEither you must confess yourselves wondrous malicious, or be accused of folly. "
        "I shall tell you a pretty tale.")


@pytest.fixture(scope="module")
def engine(model, tok):
    eng = Engine(model, tok, ctx=CTX, prefill_chunk=CHUNK, max_batch=8)
    eng.start()
    yield eng
    eng.stop()


def ids_of(n, salt):
    return [(i * 17 + salt * 29) % 997 + 2 for i in range(n)]


def run(engine, *reqs, timeout=300.0):
    """Submit `reqs` together (as the choices of one HTTP request are) and wait for them; each
    request's events, in order."""
    events = {id(r): [] for r in reqs}
    for r in reqs:
        r.emit = events[id(r)].append
    engine.submit_all(list(reqs))
    wait_for(lambda: all(r.finished() for r in reqs), timeout, "every request to finish")
    return [events[id(r)] for r in reqs]


def chunks(engine):
    return engine.metrics.value("ds4_prefill_chunks_total")


# --------------------------------------------------------------------------- prompt logprobs
def check_prompt_logprobs(outs, ids, ref, k, tok):
    assert [o.token_id for o in outs] == ids
    assert outs[0].logprob is None and outs[0].top is None
    for i in range(1, len(ids)):
        assert outs[i].logprob == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
        if k:
            vals, idx = torch.topk(ref[i - 1], k)
            assert [t for t, _ in outs[i].top] == idx.tolist()
            assert [lp for _, lp in outs[i].top] == pytest.approx(vals.tolist(), abs=1e-4)
        else:
            assert outs[i].top is None
    assert "".join(o.text for o in outs) == tok.decode(ids)


def test_prompt_logprobs_of_a_text_prompt_with_max_tokens_0(engine, model, tok):
    ids = tok.encode(TEXT)
    assert len(ids) > 2 * CHUNK  # several chunks
    assert run(engine, GenRequest(ids, 4))[0][-1] == ("done", "length")  # now a session holds the prompt
    c0 = chunks(engine)
    req = GenRequest(ids, 0, prompt_logprobs=3)
    events = run(engine, req)[0]
    assert [e[0] for e in events] == ["prompt_logprobs", "done"] and events[1][1] == "length"
    assert req.generated == [] and req.cached_tokens == 0
    # Cached tokens have no logits: the whole prompt was prefilled again, chunk by chunk.
    assert chunks(engine) - c0 == math.ceil(len(ids) / CHUNK)
    check_prompt_logprobs(events[0][1], ids, reference_logprobs(model, ids), 3, tok)
    assert req.prompt_logprob_outs is events[0][1]


def test_prompt_logprobs_of_token_ids_then_generated_tokens(engine, model, tok):
    ids = ids_of(37, 1)
    req = GenRequest(ids, 6, prompt_logprobs=0, logprobs=2)
    events = run(engine, req)[0]
    assert [e[0] for e in events] == ["prompt_logprobs"] + ["token"] * 6 + ["done"]
    full = ids + req.generated
    ref = reference_logprobs(model, full)
    check_prompt_logprobs(events[0][1], ids, ref, 0, tok)
    for j, (_, out) in enumerate(events[1:7]):
        row = ref[len(ids) - 1 + j]
        assert out.token_id == int(torch.argmax(row))  # greedy
        assert out.logprob == pytest.approx(float(row[out.token_id]), abs=1e-4)
        assert [t for t, _ in out.top] == torch.topk(row, 2).indices.tolist()
    assert req.cumulative_logprob == pytest.approx(sum(o.logprob for _, o in events[1:7]))


def test_prompt_logprobs_survive_a_failed_chunk(engine, model, tok, monkeypatch):
    ids = ids_of(50, 2)
    reset_fault_counts()
    monkeypatch.setenv("DS4_TORCH_FAULT", "prefill:2")  # the second chunk fails: start over
    req = GenRequest(ids, 2, prompt_logprobs=1)
    events = run(engine, req)[0]
    monkeypatch.delenv("DS4_TORCH_FAULT")
    assert req.attempts == 2 and req.finish_reason == "length"
    kinds = [e[0] for e in events]
    assert kinds.count("prompt_logprobs") == 1 and kinds[0] == "prompt_logprobs"
    check_prompt_logprobs(events[0][1], ids, reference_logprobs(model, ids), 1, tok)


def test_a_prompt_logprobs_prefill_is_cancellable(engine):
    """Cancelled while its third chunk runs (of more): that chunk ends, no other starts."""
    ids = ids_of(200, 3)
    assert math.ceil(len(ids) / CHUNK) > 3
    with held_prefill(engine) as gate:
        req = GenRequest(ids, 1, prompt_logprobs=0)
        req.emit = (events := []).append
        engine.submit(req)
        gate.allow(2)
        gate.wait_entered(3)
        engine.cancel(req)
    wait_for(req.finished, 60, "the cancelled request to end")
    assert events == [("cancelled", "prefill")] and req.prefill_chunks == 3


# --------------------------------------------------------------------------- n choices
def test_n_choices_share_one_prefill_even_when_they_end_at_once(engine):
    """Three choices of 2 tokens: the first finishes one step after its prefill, so the others must
    fork its session right away (before its release extends it) to reuse the prompt."""
    ids = ids_of(3 * CHUNK + 5, 4)
    params = SamplingParams(temperature=1.0, seed=3)
    c0 = chunks(engine)
    reqs = [GenRequest(ids, 2, sampling=params.for_choice(i)) for i in range(3)]
    run(engine, *reqs)
    assert chunks(engine) - c0 == math.ceil(len(ids) / CHUNK)
    assert [r.cached_tokens for r in reqs] == [0, len(ids), len(ids)]
    assert all(len(r.generated) == 2 for r in reqs)


def test_choices_behind_a_prompt_logprobs_request_fork_its_prefill(engine, model, tok):
    """echo with n = 2: the first choice computes the prompt logprobs (a full prefill), the second
    forks its session."""
    ids = ids_of(2 * CHUNK + 3, 10)
    c0 = chunks(engine)
    first, second = GenRequest(ids, 3, prompt_logprobs=0), GenRequest(ids, 3)
    events = run(engine, first, second)
    assert chunks(engine) - c0 == math.ceil(len(ids) / CHUNK)
    assert [first.cached_tokens, second.cached_tokens] == [0, len(ids)]
    assert "prompt_logprobs" not in [e[0] for e in events[1]]
    check_prompt_logprobs(events[0][0][1], ids, reference_logprobs(model, ids), 0, tok)
    assert first.generated == second.generated  # greedy both


def test_n_choices_with_a_seed_are_reproducible_and_each_is_its_seed(engine, tok):
    ids = tok.encode("GLOUCESTER:\nNow is the winter of our discontent")
    params = SamplingParams(temperature=1.3, top_k=40, seed=1234)

    def choices():
        reqs = [GenRequest(ids, 12, sampling=params.for_choice(i), ignore_eos=True) for i in range(3)]
        run(engine, *reqs)
        return [r.generated for r in reqs]

    first = choices()
    assert choices() == first
    assert len({tuple(c) for c in first}) == 3, "three seeds gave equal choices"
    # Choice i is what a lone request seeded seed + i gives: the rule is the seed, not the order.
    for i in (2, 0):
        lone = GenRequest(ids, 12, sampling=SamplingParams(temperature=1.3, top_k=40, seed=1234 + i), ignore_eos=True)
        run(engine, lone)
        assert lone.generated == first[i]


# --------------------------------------------------------------------------- bias and penalties
def test_logit_bias_minus_100_removes_the_greedy_token(engine, model):
    ids = ids_of(30, 5)
    top2 = torch.topk(reference_logprobs(model, ids)[-1], 2).indices.tolist()
    plain = GenRequest(ids, 1)
    run(engine, plain)
    assert plain.generated == top2[:1]
    biased = GenRequest(ids, 1, sampling=SamplingParams(logit_bias={str(top2[0]): -100}))
    run(engine, biased)
    assert biased.generated == top2[1:]


def test_penalties_follow_their_formulas_in_the_engine(engine, model, tok):
    # Text whose greedy continuation repeats itself, so the penalties have something to act on.
    ids = tok.encode("To be, or not to be")
    plain = GenRequest(ids, 16, ignore_eos=True)
    pen = GenRequest(ids, 16, ignore_eos=True,
                     sampling=SamplingParams(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3))
    run(engine, plain, pen)
    assert pen.generated == penalised_greedy(model, ids, 16, 0.6, 0.4, 1.3)
    assert pen.generated != plain.generated, "the penalties changed nothing: the test shows nothing"
    assert len(set(pen.generated)) > len(set(plain.generated))


def test_stop_token_ids_end_the_request_and_min_tokens_holds_them_off(engine, tok):
    ids = ids_of(20, 7)
    plain = GenRequest(ids, 16, ignore_eos=True)
    run(engine, plain)
    g = plain.generated
    i = next(j for j in range(1, len(g)) if g[j] not in g[:j])  # a token's first appearance
    stopped = GenRequest(ids, 16, ignore_eos=True, sampling=SamplingParams(stop_token_ids=[g[i]]))
    events = run(engine, stopped)[0]
    assert stopped.generated == g[:i + 1] and events[-1] == ("done", "stop")
    assert stopped.text == tok.decode(g[:i])  # the stop token's own text is not output
    held = GenRequest(ids, 16, ignore_eos=True, sampling=SamplingParams(stop_token_ids=[g[i]], min_tokens=i + 3))
    run(engine, held)
    assert held.generated[:i] == g[:i] and g[i] not in held.generated[:i + 3]
    assert held.finish_reason == ("stop" if g[i] in held.generated else "length")


def test_max_tokens_0_without_prompt_logprobs_samples_nothing(engine):
    req = GenRequest(ids_of(10, 8), 0)
    assert run(engine, req)[0] == [("done", "length")] and req.generated == []


@pytest.mark.parametrize("bad, field", [  # V: the model's vocabulary size, the first id outside it
    (lambda V: dict(sampling=SamplingParams(logit_bias={V: 5.0})), "logit_bias"),
    (lambda V: dict(sampling=SamplingParams(stop_token_ids=[V])), "stop_token_ids"),
    (lambda V: dict(sampling=SamplingParams(min_tokens=9)), "min_tokens"),
    (lambda V: dict(prompt_logprobs=-1), "prompt_logprobs"),
    (lambda V: dict(max_tokens=-1), "max_tokens"),
])
def test_requests_the_model_cannot_serve_are_refused_naming_the_field(engine, bad, field):
    args = dict(max_tokens=8) | bad(engine.model.config.vocab_size)
    depth = engine.queue_depth()
    with pytest.raises(ValueError, match=field):
        engine.submit(GenRequest(ids_of(5, 9), **args))
    assert engine.queue_depth() == depth


# --------------------------------------------------------------------------- structured outputs
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age", "noble"],
     "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "noble": {"type": "boolean"}}},
    {"type": "object", "required": ["mood", "lines"],
     "properties": {"mood": {"enum": ["angry", "merry", "sad"]}, "lines": {"type": "array", "items": {"type": "string"}}}},
    {"type": "object", "required": ["scene"], "additionalProperties": False,
     "properties": {"scene": {"type": "object", "required": ["act", "where"],
                              "properties": {"act": {"type": "integer"}, "where": {"type": "string"}}},
                    "cast": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}},
]
PROMPTS = ["ROMEO:\nBut soft, what light", "First Citizen:\nWe are accounted poor citizens,", "{"]


def test_json_schema_outputs_validate_at_temperature_above_0(engine, tok):
    so = engine.structured_outputs()
    reqs, schemas = [], []
    for s, schema in enumerate(SCHEMAS):
        grammar = so.json_schema(schema)
        for p, prompt in enumerate(PROMPTS):
            for max_tokens in (40, 64):
                params = SamplingParams(temperature=1.0 + 0.25 * p, top_p=0.95, seed=10 * s + p + max_tokens)
                reqs.append(GenRequest(tok.encode(prompt), max_tokens, sampling=params, grammar=grammar))
                schemas.append(schema)
    run(engine, *reqs)
    forced = 0
    for req, schema in zip(reqs, schemas):
        assert req.finish_reason == "stop" and len(req.generated) <= req.max_tokens
        value = json.loads(req.text)
        jsonschema.validate(value, schema)
        assert validate_json_schema(value, schema) == []
        forced += req.constraint.forced
    assert forced > 0, "no output needed closing: the budgets did not test it"


def test_a_grammar_ends_the_request_when_the_value_is_complete(engine, tok):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    req = GenRequest(tok.encode(PROMPTS[0]), 100, sampling=SamplingParams(temperature=1.0, seed=1),
                     grammar=engine.structured_outputs().json_schema(schema), logprobs=0)
    events = run(engine, req)[0]
    assert req.finish_reason == "stop" and json.loads(req.text) in ({"ok": True}, {"ok": False})
    assert len(req.generated) < 100 and events[-1] == ("done", "stop")


def test_an_unsupported_schema_is_refused_before_it_reaches_the_engine(engine):
    with pytest.raises(ValueError, match="uniqueItems"):
        engine.structured_outputs().json_schema({"type": "array", "uniqueItems": True})
