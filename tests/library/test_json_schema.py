"""The tool-schema validator (ds4_torch.json_schema): a malformed keyword in a client's schema
constrains nothing and never raises (it runs when the model calls that tool)."""
from __future__ import annotations

import pytest

from ds4_torch.json_schema import validate_json_schema

VALUE = {"a": 1, "b": "x"}


@pytest.mark.parametrize("schema", [
    {"required": 5},
    {"required": [["a"]]},
    {"required": [{"a": 1}, 7]},
    {"type": 5},
    {"type": [5, None]},
    {"type": {"object": True}},
    {"anyOf": 5},
    {"anyOf": True},
    {"oneOf": True},
    {"oneOf": "string"},
    {"allOf": 5},
    {"items": [1, 2], "properties": [1], "additionalProperties": 3, "enum": 4},
    {"type": "object", "properties": {"a": {"anyOf": 5, "oneOf": {}, "required": "a"}}},
])
def test_a_malformed_keyword_constrains_nothing(schema):
    assert validate_json_schema(VALUE, schema) == []
    assert validate_json_schema([VALUE], {"items": schema}) == []


def test_well_formed_keywords_beside_malformed_ones_still_apply():
    schema = {"type": "object", "required": ["c", ["a"]], "anyOf": 5,
              "properties": {"a": {"type": "string", "oneOf": True}}}
    assert validate_json_schema(VALUE, schema) == ["$: missing required property 'c'",
                                                   "$.a: expected string, got integer"]


def test_deep_nesting_is_a_problem_not_an_exception():
    schema = value = {}
    for _ in range(5000):
        schema, value = {"properties": {"x": schema}}, {"x": value}
    assert validate_json_schema(value, schema) == ["$: nested too deeply to check"]
