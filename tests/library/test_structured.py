"""Structured outputs (ds4_torch.structured): every output of the embedded model, sampled at
temperature > 0 under a JSON schema with a small token budget, parses and validates; features
that cannot be enforced are refused by name."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from ds4_torch.decode import make_decoder, prefill
from ds4_torch.default_model import build_default_model, default_tokenizer
from ds4_torch.json_schema import validate_json_schema
from ds4_torch.sampling import SamplingParams, sample
from ds4_torch.structured import StructuredOutputs

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "alive"],
               "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "alive": {"type": "boolean"}}},
    "enum_and_array": {"type": "object", "required": ["mood", "lines"],
                       "properties": {"mood": {"enum": ["angry", "merry", "sad"]},
                                      "lines": {"type": "array", "items": {"type": "string"}, "minItems": 1}}},
    "nested": {"type": "object", "required": ["scene", "speaker"], "additionalProperties": False,
               "properties": {"scene": {"type": "object", "required": ["act", "place"], "additionalProperties": False,
                                        "properties": {"act": {"type": "integer", "minimum": 1, "maximum": 5},
                                                       "place": {"type": "string", "maxLength": 30}}},
                              "speaker": {"type": "string"}, "aside": {"type": "boolean"}}},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3,
                         "items": {"type": "object", "required": ["who", "n"], "additionalProperties": False,
                                   "properties": {"who": {"type": "string"}, "n": {"type": "number"}}}},
    "recursive": {"$defs": {"node": {"type": "object", "required": ["v", "kids"], "additionalProperties": False,
                                     "properties": {"v": {"type": "string"},
                                                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
                  "$ref": "#/$defs/node"},
}
PROMPTS = ["ROMEO:\nWhat light through yonder window breaks?\nJULIET:", "First Citizen:\nBefore we proceed any further,",
           "KING RICHARD III:\nNow is the winter of our discontent"]


@pytest.fixture(scope="module")
def model():
    return build_default_model()


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


@pytest.fixture(scope="module")
def so(tok, model):
    return StructuredOutputs(tok, model.config.vocab_size)


def constrained(model, so, prompt_ids, grammar, max_tokens, params, closing=True):
    """Sample under `grammar` as the engine does; `closing=False` hides the budget from the
    constraint (a plain mask), the control that shows what the closing path prevents."""
    c = grammar.constraint()
    gen = params.generator("cpu")
    cache = model.new_cache(1, len(prompt_ids) + max_tokens + 1)
    out = []
    with torch.no_grad():
        logits = prefill(model, cache, torch.tensor([prompt_ids]), 64)[0]
        decoder = make_decoder(model, cache, "eager")
        while True:
            left = max_tokens - len(out) if closing else 10**9
            token = c.step(lambda allowed: sample(logits, params, gen, allowed=allowed), left)
            out.append(token)
            if token == so.eos or c.done or len(out) == max_tokens:
                break
            logits = decoder.step(torch.tensor([token]))[0]
    return [t for t in out if t != so.eos], c


def assert_valid(text, schema):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    assert validate_json_schema(value, schema) == []
    return value


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_outputs_parse_and_validate_within_small_budgets(model, tok, so, name):
    schema = SCHEMAS[name]
    grammar = so.json_schema(schema)
    forced = 0
    for i, prompt in enumerate(PROMPTS):
        for max_tokens in (40, 64):
            params = SamplingParams(temperature=1.0 + 0.2 * i, top_p=0.95, seed=100 * i + max_tokens)
            ids, c = constrained(model, so, tok.encode(prompt), grammar, max_tokens, params)
            assert len(ids) <= max_tokens
            assert c.done or c.complete
            assert_valid(tok.decode(ids), schema)
            forced += c.forced
    assert forced > 0, "the budget never forced a closing token: the test did not exercise it"


def test_without_the_closing_path_the_same_outputs_are_cut(model, tok, so):
    """The control: the same sampling under the bare mask runs out of budget mid-value."""
    schema = SCHEMAS["person"]
    grammar = so.json_schema(schema)
    cut = 0
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=1.0 + 0.2 * i, top_p=0.95, seed=100 * i + 40)
        ids, _ = constrained(model, so, tok.encode(prompt), grammar, 40, params, closing=False)
        try:
            assert_valid(tok.decode(ids), schema)
        except (ValueError, jsonschema.ValidationError):
            cut += 1
    assert cut > 0


def test_properties_come_in_the_schemas_order(model, tok, so):
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha", "mid"],
              "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}, "mid": {"type": "boolean"}}}
    ids, _ = constrained(model, so, tok.encode(PROMPTS[0]), so.json_schema(schema), 48,
                         SamplingParams(temperature=1.0, seed=3))
    assert list(assert_valid(tok.decode(ids), schema)) == ["zeta", "alpha", "mid"]


def test_json_object_is_any_object(model, tok, so):
    for seed in range(3):
        ids, _ = constrained(model, so, tok.encode(PROMPTS[1]), so.json_object(), 40,
                             SamplingParams(temperature=1.2, seed=seed))
        assert isinstance(json.loads(tok.decode(ids)), dict)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_an_adversarial_sampler_is_still_closed_at_every_feasible_budget(so, tok, name):
    """A sampler that never chooses to finish (it takes the allowed token that is not EOS and
    does not end a string or container, whenever there is one) still gets a complete value at
    every budget from the smallest the closing policy needs upward."""
    schema, grammar = SCHEMAS[name], so.json_schema(SCHEMAS[name])
    enders = {t for t in range(so.vocab_size) if set(tok.decode([t])) & set('"]}')} | {so.eos}

    def stubborn(allowed):
        ok = [t for t in torch.nonzero(allowed).flatten().tolist() if t not in enders]
        return ok[-1] if ok else int(torch.nonzero(allowed)[0])

    smallest = len(grammar.constraint().closing_path(10**6))
    for budget in range(smallest, smallest + 12):
        c, out = grammar.constraint(), []
        while not c.done and len(out) < budget:
            out.append(c.step(stubborn, budget - len(out)))
        assert_valid(tok.decode([t for t in out if t != so.eos]), schema)


@pytest.mark.parametrize("schema, feature", [
    ({"not": {"type": "string"}}, "not"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
    ({"$ref": "#/$defs/missing"}, "/[$]defs/missing"),
    ({"type": "string", "format": "colour"}, "format: colour"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"type": "strng"}, "strng"),
    (False, "false"),
    ([1, 2], "object"),
    ("{not json", "not valid JSON"),
])
def test_unsupported_schemas_are_refused_naming_the_feature(so, schema, feature):
    with pytest.raises(ValueError, match=feature):
        so.json_schema(schema)


def test_grammars_are_compiled_once_and_shared(so):
    a = so.json_schema({"type": "object", "properties": {"x": {"type": "string"}}})
    assert so.json_schema(json.dumps({"type": "object", "properties": {"x": {"type": "string"}}})) is a
    c1, c2 = a.constraint(), a.constraint()
    c1.step(lambda allowed: int(torch.nonzero(allowed)[0]), 10)
    assert c2.matcher.compute_ff_tokens() != c1.matcher.compute_ff_tokens()  # each its own state
