"""A small validator for the JSON-Schema subset tool definitions use.

Checks ``type`` (one or a list), ``enum``, ``const``, ``properties``, ``required``,
``additionalProperties`` (false or a schema), ``items``, ``anyOf``, ``oneOf`` and ``allOf``,
nested to any depth. Other keywords (formats, bounds, ``$ref`` ...) are not checked: a value
they would reject passes. ``validate_json_schema`` never raises on a schema it does not
understand (a client's tool schema may be anything): a malformed keyword (``"required": 5``,
``"anyOf": true``) constrains nothing; it returns the violations it finds as readable strings.
"""
from __future__ import annotations

from typing import Any, Mapping


def _is_type(value: Any, name: str) -> bool:
    if name == "null":
        return value is None
    if name == "boolean":
        return isinstance(value, bool)
    if name == "string":
        return isinstance(value, str)
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if isinstance(value, bool):  # JSON keeps true/false apart from numbers
        return False
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, (int, float))
    return True  # an unknown type name constrains nothing we can check


def json_type_name(value: Any) -> str:
    for name in ("null", "boolean", "string", "object", "array", "integer", "number"):
        if _is_type(value, name):
            return name
    return type(value).__name__


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    return a == b


def _list(schema: Mapping, keyword: str) -> list:
    """The keyword's list, or [] when it is missing or malformed (not a list)."""
    value = schema.get(keyword)
    return value if isinstance(value, list) else []


def validate_json_schema(value: Any, schema: Any, path: str = "$") -> list[str]:
    """The ways ``value`` violates ``schema``; empty when it conforms. Never raises."""
    try:
        return _validate(value, schema, path)
    except RecursionError:  # a schema or value nested past Python's stack
        return [f"{path}: nested too deeply to check"]


def _validate(value: Any, schema: Any, path: str) -> list[str]:
    if schema is False:
        return [f"{path}: no value is allowed here"]
    if not isinstance(schema, Mapping):
        return []
    types = schema.get("type")
    if isinstance(types, str):
        types = [types]
    if isinstance(types, list) and all(isinstance(t, str) for t in types) and types \
            and not any(_is_type(value, t) for t in types):
        return [f"{path}: expected {' or '.join(types)}, got {json_type_name(value)}"]
    errors = []
    if "enum" in schema and isinstance(schema["enum"], list) and not any(_json_equal(value, e) for e in schema["enum"]):
        errors.append(f"{path}: {value!r} is not one of {schema['enum']!r}")
    if "const" in schema and not _json_equal(value, schema["const"]):
        errors.append(f"{path}: must be {schema['const']!r}")
    if isinstance(value, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        for name in _list(schema, "required"):
            if isinstance(name, str) and name not in value:
                errors.append(f"{path}: missing required property {name!r}")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                errors += _validate(item, props[key], f"{path}.{key}")
            elif extra is False:
                errors.append(f"{path}: unexpected property {key!r}")
            elif isinstance(extra, Mapping):
                errors += _validate(item, extra, f"{path}.{key}")
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for k, item in enumerate(value):
            errors += _validate(item, schema["items"], f"{path}[{k}]")
    for sub in _list(schema, "allOf"):
        errors += _validate(value, sub, path)
    if _list(schema, "anyOf"):
        if not any(not _validate(value, sub, path) for sub in schema["anyOf"]):
            errors.append(f"{path}: matches none of the anyOf alternatives")
    if _list(schema, "oneOf"):
        matches = sum(not _validate(value, sub, path) for sub in schema["oneOf"])
        if matches != 1:
            errors.append(f"{path}: matches {matches} of the oneOf alternatives, not exactly one")
    return errors
