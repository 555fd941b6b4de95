"""What every API module shares: the one error type and the checks of request fields.

`APIError` carries an HTTP status, a message and the offending field (`param`); it knows no
API. Each API module (`openai_api`, `anthropic_api`, `responses_api`) shapes it into its own
error JSON, so an error is raised once, wherever it is found (parsing, rendering, the engine),
and answered in the shape of the API that received the request.

The field checks below raise `APIError`s whose message names the field; the API modules build
their request parsing from them.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable


class APIError(Exception):
    """An HTTP error: status, message, the request field at fault (`param`), a machine-readable
    `code`, an error `type` (OpenAI's vocabulary; the Anthropic module maps it) and headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


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
    where = unencodable_text(body)
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
    encoded as UTF-8, or None. Iterative: any nesting depth the JSON parser took."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return path or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                sub = f"{path}.{k}" if path else str(k)
                if not _encodable(k):
                    return (path or "body") + ".<key>"
                stack.append((item, sub))
        elif isinstance(v, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(v))
    return None


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


def check_unknown(body: dict, allowed: Iterable[str], ignored: Iterable[str] = (), where: str = "") -> None:
    """A field outside `allowed` and `ignored` is a 400 naming it (OpenAI's wording)."""
    allowed, ignored = set(allowed), set(ignored)
    for key in body:
        if key not in allowed and key not in ignored:
            raise bad(f"Unrecognized request argument supplied: {where}{key}", where + key, "unknown_parameter")


def parse_stop(body: dict, name: str = "stop", limit: int | None = 4) -> list[str]:
    v = body.get(name)
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad(f"'{name}' must be a string or an array of strings", name, "invalid_type")
    if limit is not None and len(stops) > limit:
        raise bad(f"'{name}' takes at most {limit} sequences, got {len(stops)}", name)
    if any(s == "" for s in stops):
        raise bad(f"'{name}' sequences must not be empty", name)
    return stops


def fit_context(n_prompt: int, max_tokens: int | None, ctx: int, *, prompt_param: str, max_param: str) -> int:
    """The number of tokens to generate; 400 `context_length_exceeded` when the request cannot fit.
    `max_tokens` None: whatever the context leaves."""
    if max_tokens is not None and max_tokens > ctx:
        raise bad(f"'{max_param}' is {max_tokens}, more than this server's context length of {ctx} tokens",
                  max_param, "context_length_exceeded")
    if n_prompt >= ctx:
        raise bad(f"This model's maximum context length is {ctx} tokens. However, your prompt is {n_prompt} tokens, "
                  f"which leaves no room for a completion", prompt_param, "context_length_exceeded")
    if max_tokens is None:
        return ctx - n_prompt
    if n_prompt + max_tokens > ctx:
        raise bad(f"This model's maximum context length is {ctx} tokens. However, you requested "
                  f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
                  f"Please reduce the prompt or '{max_param}'.", max_param, "context_length_exceeded")
    return max_tokens


def value_error(e: ValueError) -> APIError:
    """A ValueError of the library's checks (`ds4_torch.sampling`, the engine's, structured
    outputs) as a 400. Their messages start with the field's name ("logit_bias holds ...",
    "min_tokens (5) must be ..."), which becomes `param`."""
    message = str(e)
    match = re.match(r"[a-z_]+", message)
    return bad(message, match.group(0) if match else None)
