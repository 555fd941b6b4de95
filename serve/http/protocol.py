"""What every API module shares: the checks of request fields.

They raise `serve.errors.APIError`s whose message names the field; the API modules build their
request parsing from them.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable

from serve.errors import APIError


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def parse_json_object(raw: bytes) -> dict:
    """The request body as a JSON object; 400 for anything else: malformed or truncated JSON,
    NaN/Infinity or numbers beyond float range, nesting too deep to parse, a body that is not an
    object, and text that is not valid Unicode (a lone surrogate such as "\\ud800" anywhere, named
    by its path: no such string can reach a tokenizer)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"malformed JSON in the request body: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad("malformed JSON in the request body: nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type_name(body)}", code="invalid_json")
    # A lone surrogate can only come from a \ud800-\udfff escape: without one, nothing to walk.
    where = unencodable_text(body) if _SURROGATE_ESCAPE.search(raw) else None
    if where is not None:
        raise bad(f"'{where}' holds text that is not valid Unicode (a lone surrogate); it cannot be encoded as "
                  f"UTF-8", where, "invalid_encoding")
    return body


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unencodable_text(value: Any) -> str | None:
    """The path (`messages[0].content`) of the first string or key in `value` that cannot be
    encoded as UTF-8, or None. Iterative (any nesting depth the JSON parser took) and O(body):
    a path is spelled out only for the string found, so a million-element array costs no million
    path strings; an array of numbers is skipped whole."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return _spell(path) or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                if not _encodable(k):
                    return (_spell(path) or "body") + ".<key>"
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (path, k)))
        elif isinstance(v, list):
            stack.extend((item, (path, i)) for i, item in enumerate(v) if isinstance(item, (str, dict, list)))
    return None


def _spell(path: tuple) -> str:
    """("", (("", "messages"), 0), "content") as nested pairs -> messages[0].content."""
    parts = []
    while path:
        path, part = path
        parts.append(part)
    out = ""
    for part in reversed(parts):
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(v), type(v).__name__)


def get_number(body: dict, name: str, default, lo=None, hi=None, lo_open=False, integer=False, where: str = ""):
    """`body[name]` as a number within [lo, hi] (`lo_open`: > lo); `where` prefixes the field's
    path in messages (e.g. "stream_options.")."""
    v = body.get(name)
    field = where + name
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        kind = "an integer" if integer else "a number"
        raise bad(f"'{field}' must be {kind}, got {type_name(v)} {json.dumps(v)[:40]}", field, "invalid_type")
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{field}' must be finite, got {v}", field)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(f"'{field}' must be {'>' if lo_open else '>='} {lo}, got {v}", field)
    if hi is not None and v > hi:
        raise bad(f"'{field}' must be <= {hi}, got {v}", field)
    return v


def get_bool(body: dict, name: str, default: bool, where: str = "") -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{where}{name}' must be a boolean, got {type_name(v)}", where + name, "invalid_type")
    return v


def get_str(body: dict, name: str, default: str | None = None, where: str = "", choices: Iterable[str] | None = None):
    v = body.get(name)
    field = where + name
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad(f"'{field}' must be a string, got {type_name(v)}", field, "invalid_type")
    if choices is not None and v not in choices:
        raise bad(f"'{field}' must be one of {', '.join(map(repr, choices))}; got {v!r}", field)
    return v


def get_object(body: dict, name: str, where: str = "") -> dict | None:
    v = body.get(name)
    if v is not None and not isinstance(v, dict):
        raise bad(f"'{where}{name}' must be an object, got {type_name(v)}", where + name, "invalid_type")
    return v


def get_list(body: dict, name: str, where: str = "") -> list | None:
    v = body.get(name)
    if v is not None and not isinstance(v, list):
        raise bad(f"'{where}{name}' must be an array, got {type_name(v)}", where + name, "invalid_type")
    return v


def fit_context(n_prompt: int, max_tokens: int | None, ctx: int, *, prompt_param: str) -> int:
    """The number of tokens to generate: `max_tokens` clamped to the room the prompt leaves in
    the context (None: all of it), so a reply that reaches it ends with "length"; a 400
    `context_length_exceeded` only when the prompt leaves no room at all."""
    if n_prompt >= ctx:
        raise bad(f"This model's maximum context length is {ctx} tokens. However, your prompt is {n_prompt} tokens, "
                  f"which leaves no room for a completion", prompt_param, "context_length_exceeded")
    room = ctx - n_prompt
    return room if max_tokens is None else min(max_tokens, room)


def check_fits(min_tokens: int, ctx: int, param: str) -> None:
    """400 `context_length_exceeded` for a prompt known to hold at least `min_tokens` (from its
    length, before it is tokenized or decoded: a huge prompt costs nothing)."""
    if min_tokens >= ctx:
        raise bad(f"This model's maximum context length is {ctx} tokens. However, your prompt is at least "
                  f"{min_tokens} tokens, which leaves no room for a completion", param, "context_length_exceeded")


def value_error(e: ValueError) -> APIError:
    """A ValueError of the library's checks (`ds4_torch.sampling`, the engine's, structured
    outputs) as a 400. Their messages start with the field's name ("logit_bias holds ...",
    "min_tokens (5) must be ..."), which becomes `param`."""
    message = str(e)
    match = re.match(r"[a-z_]+", message)
    return bad(message, match.group(0) if match else None)
