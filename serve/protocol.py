"""OpenAI-compatible request parsing and validation, and the error shape.

Every problem with a request becomes an `APIError`, answered as OpenAI does::

    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}

Parsing is strict where a field changes the output: an unknown top-level field, or a known one
this server does not implement (tools, penalties, `n` > 1, `echo`, ...), is a 400 naming it,
like OpenAI's "Unrecognized request argument supplied". Fields that only carry bookkeeping
(`user`, `metadata`, `store`, ...) are accepted and ignored. Extensions (vLLM's spellings):
`top_k`, `min_p`, `ignore_eos` (generate to `max_tokens` even past EOS), `return_token_ids`
(token ids of the prompt and of the output in the response).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ds4_torch.sampling import SamplingParams

# Fields accepted and ignored: they do not change what is generated.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                     "safety_identifier"})

COMMON = frozenset({"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                    "seed", "stop", "n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                    "return_token_ids", "ignore_eos"})
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                        "function_call", "response_format", "thinking"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """An HTTP error answered in OpenAI's error JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# --------------------------------------------------------------------------- primitives
def parse_json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"malformed JSON in the request body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(v), type(v).__name__)


def get_number(body: dict, name: str, default, lo=None, hi=None, lo_open=False, integer=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        kind = "an integer" if integer else "a number"
        raise bad(f"'{name}' must be {kind}, got {_type_name(v)} {json.dumps(v)[:40]}", name, "invalid_type")
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{name}' must be finite, got {v}", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {_type_name(v)}", name, "invalid_type")
    return v


def check_unknown(body: dict, allowed: frozenset) -> None:
    for key in body:
        if key not in allowed and key not in IGNORED:
            raise bad(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")


def check_unsupported(body: dict) -> None:
    """Known fields whose non-default values we do not implement."""
    n = get_number(body, "n", 1, integer=True)
    if n != 1:
        raise bad(f"'n' must be 1 (this server generates one choice per request), got {n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if get_number(body, name, 0.0) != 0:
            raise bad(f"'{name}' is not supported (only 0)", name, "unsupported_parameter")
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported", "logit_bias", "unsupported_parameter")
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad(f"'{name}' (tool calling) is not supported", name, "unsupported_parameter")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise bad(f"'{name}' is not supported", name, "unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("'response_format' only supports {\"type\": \"text\"}", "response_format", "unsupported_parameter")
    if body.get("echo"):
        raise bad("'echo' is not supported", "echo", "unsupported_parameter")
    if body.get("suffix") not in (None, ""):
        raise bad("'suffix' is not supported", "suffix", "unsupported_parameter")
    if get_number(body, "best_of", 1, integer=True) != 1:
        raise bad("'best_of' must be 1", "best_of", "unsupported_parameter")


def parse_stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop' must be a string or an array of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP:
        raise bad(f"'stop' takes at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise bad("'stop' sequences must not be empty", "stop")
    return stops


# --------------------------------------------------------------------------- parsed requests
@dataclass
class ParsedRequest:
    kind: str                      # "chat" | "completion"
    model: str | None
    prompt_ids: list[int]
    max_tokens: int | None         # None: whatever the context leaves
    max_tokens_param: str
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None           # None: no logprobs; k: the chosen token's and the k best
    return_token_ids: bool = False
    ignore_eos: bool = False
    prompt_param: str = "prompt"
    extra: dict = field(default_factory=dict)


def _parse_common(body: dict, kind: str) -> dict:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {_type_name(model)}", "model", "invalid_type")
    stream = get_bool(body, "stream", False)
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        unknown = set(so) - {"include_usage", "continuous_usage_stats", "include_obfuscation"}
        if unknown:
            raise bad(f"unknown field in 'stream_options': {sorted(unknown)[0]}", "stream_options",
                      "unknown_parameter")
        include_usage = get_bool(so, "include_usage", False)
    top_k = int(get_number(body, "top_k", 0, lo=-1, integer=True))
    sampling = SamplingParams(
        temperature=float(get_number(body, "temperature", 1.0, lo=0.0, hi=2.0)),
        top_p=float(get_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)),
        top_k=0 if top_k == -1 else top_k,  # -1: vLLM's spelling of "no top-k"
        min_p=float(get_number(body, "min_p", 0.0, lo=0.0, hi=1.0)),
        seed=get_number(body, "seed", None, integer=True),
    )
    check_unsupported(body)
    return dict(model=model, stream=stream, include_usage=include_usage, sampling=sampling,
                stop=parse_stop(body), return_token_ids=get_bool(body, "return_token_ids", False),
                ignore_eos=get_bool(body, "ignore_eos", False))


def _message_text(i: int, m: dict) -> str:
    content = m.get("content")
    if isinstance(content, str):
        return content
    if content is None and m.get("role") == "assistant":
        return ""
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                          f"are supported", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content must be a string or an array of text parts, got {_type_name(content)}",
              f"messages[{i}].content", "invalid_type")


def parse_chat(body: dict, tokenizer) -> ParsedRequest:
    check_unknown(body, CHAT_FIELDS)
    common = _parse_common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of {role, content} objects", "messages",
                  "invalid_type" if not isinstance(messages, list) else "invalid_value")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object, got {_type_name(m)}", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise bad(f"messages[{i}].role must be one of system, developer, user, assistant; got {role!r}",
                      f"messages[{i}].role")
        plain.append({"role": role, "content": _message_text(i, m)})
    thinking = body.get("thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad("'thinking' must be a boolean", "thinking", "invalid_type")
    try:
        ids = tokenizer.encode_chat(plain, add_generation_prompt=True, thinking=thinking)
    except ValueError as e:
        raise bad(str(e), "messages") from None

    logprobs = None
    if get_bool(body, "logprobs", False):
        logprobs = int(get_number(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS, integer=True))
    elif body.get("top_logprobs") is not None:
        get_number(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = get_number(body, param, None, lo=1, integer=True)
    return ParsedRequest(kind="chat", prompt_ids=ids, max_tokens=max_tokens, max_tokens_param=param,
                         logprobs=logprobs, prompt_param="messages", **common)


def parse_completion(body: dict, tokenizer, vocab_size: int) -> ParsedRequest:
    check_unknown(body, COMPLETION_FIELDS)
    common = _parse_common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad_ids = [t for t in prompt if not 0 <= t < vocab_size]
        if bad_ids:
            raise bad(f"'prompt' token id {bad_ids[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("'prompt' must be one prompt: batches of prompts are not supported", "prompt",
                  "unsupported_parameter")
    else:
        raise bad("'prompt' must be a string or a non-empty array of token ids", "prompt",
                  "invalid_type" if prompt is not None else "missing_required_parameter")
    if not ids:
        raise bad("'prompt' encodes to no tokens", "prompt")
    logprobs = get_number(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    max_tokens = get_number(body, "max_tokens", 16, lo=1, integer=True)  # OpenAI's default for completions
    return ParsedRequest(kind="completion", prompt_ids=ids, max_tokens=max_tokens, max_tokens_param="max_tokens",
                         logprobs=logprobs, prompt_param="prompt", **common)


def fit_context(req: ParsedRequest, ctx: int) -> int:
    """The max_tokens to use; 400 `context_length_exceeded` when the request cannot fit."""
    n = len(req.prompt_ids)
    if req.max_tokens is not None and req.max_tokens > ctx:
        raise bad(f"'{req.max_tokens_param}' is {req.max_tokens}, more than this server's context length of "
                  f"{ctx} tokens", req.max_tokens_param, "context_length_exceeded")
    if n >= ctx:
        raise bad(f"This model's maximum context length is {ctx} tokens. However, your prompt is {n} tokens, "
                  f"which leaves no room for a completion", req.prompt_param, "context_length_exceeded")
    if req.max_tokens is None:
        return ctx - n
    if n + req.max_tokens > ctx:
        raise bad(f"This model's maximum context length is {ctx} tokens. However, you requested "
                  f"{n + req.max_tokens} tokens ({n} in the prompt, {req.max_tokens} for the completion). "
                  f"Please reduce the prompt or '{req.max_tokens_param}'.", req.max_tokens_param,
                  "context_length_exceeded")
    return req.max_tokens
