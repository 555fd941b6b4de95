"""OpenAI chat completions and completions: JSON in, `serve.chat` request out; events back to JSON/SSE.

Chat completions take ``tools`` (function tools), ``tool_choice`` (auto, none, required, a named
function), DeepSeek's ``thinking: {"type": "enabled"|"disabled"}`` (or a boolean) and
``reasoning_effort`` (which turns thinking on unless it says "none"). Replies carry reasoning in
``reasoning_content`` (DeepSeek's field) and calls in ``tool_calls`` with JSON-string arguments
(``finish_reason: "tool_calls"``); streamed, each call arrives whole in one delta.

Parsing is strict where a field changes the output: an unknown top-level field, or a known one
this server does not implement (penalties, `n` > 1, `echo`, ...), is a 400 naming it, like
OpenAI's "Unrecognized request argument supplied". Fields that only carry bookkeeping (`user`,
`metadata`, `store`, ...) are accepted and ignored. Extensions (vLLM's spellings): `top_k`,
`min_p`, `ignore_eos` (generate to `max_tokens` even past EOS), `return_token_ids` (token ids
of the prompt and of the output in the response).

Errors: ``{"error": {"message", "type", "param", "code"}}``, as OpenAI answers them.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ds4_torch.chat_encoding import normalize_tools
from ds4_torch.sampling import SamplingParams

from .chat import Call, ChatRequest, Done, Generation, Text, Token, ToolChoice
from .protocol import (APIError, bad, check_unknown, fit_context, get_bool, get_number, get_object, parse_stop,
                       type_name)

# Fields accepted and ignored: they do not change what is generated.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                     "safety_identifier"})
COMMON = frozenset({"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                    "seed", "stop", "n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                    "return_token_ids", "ignore_eos"})
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                        "function_call", "response_format", "thinking", "reasoning_effort"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}
MAX_TOP_LOGPROBS = 20
ROLES = ("system", "developer", "user", "assistant", "tool")

# OpenAI's effort names -> DeepSeek-V4's levels (chat_encoding.REASONING_EFFORT_PROMPTS).
EFFORT_LEVELS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}
FINISH = {"end": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


# --------------------------------------------------------------------------- errors
def error_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def error_response(e: APIError) -> Response:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


# --------------------------------------------------------------------------- shared fields
def parse_sampling(body: dict) -> SamplingParams:
    top_k = int(get_number(body, "top_k", 0, lo=-1, integer=True))
    return SamplingParams(
        temperature=float(get_number(body, "temperature", 1.0, lo=0.0, hi=2.0)),
        top_p=float(get_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)),
        top_k=0 if top_k == -1 else top_k,  # -1: vLLM's spelling of "no top-k"
        min_p=float(get_number(body, "min_p", 0.0, lo=0.0, hi=1.0)),
        seed=get_number(body, "seed", None, integer=True),
    )


@dataclass
class Options:
    """What the OpenAI response shape needs beyond the internal request."""
    model: str | None
    stream: bool
    include_usage: bool
    logprobs: int | None
    return_token_ids: bool
    ignore_eos: bool


def _check_unsupported(body: dict) -> None:
    n = get_number(body, "n", 1, integer=True)
    if n != 1:
        raise bad(f"'n' must be 1 (this server generates one choice per request), got {n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if get_number(body, name, 0.0) != 0:
            raise bad(f"'{name}' is not supported (only 0)", name, "unsupported_parameter")
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported", "logit_bias", "unsupported_parameter")
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise bad(f"'{name}' (the legacy function calling) is not supported; use 'tools'", name,
                      "unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("'response_format' only supports {\"type\": \"text\"}", "response_format", "unsupported_parameter")
    if body.get("echo"):
        raise bad("'echo' is not supported", "echo", "unsupported_parameter")
    if body.get("suffix") not in (None, ""):
        raise bad("'suffix' is not supported", "suffix", "unsupported_parameter")
    if get_number(body, "best_of", 1, integer=True) != 1:
        raise bad("'best_of' must be 1", "best_of", "unsupported_parameter")


def _parse_options(body: dict) -> Options:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {type_name(model)}", "model", "invalid_type")
    stream = get_bool(body, "stream", False)
    so = get_object(body, "stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        unknown = set(so) - {"include_usage", "continuous_usage_stats", "include_obfuscation"}
        if unknown:
            raise bad(f"unknown field in 'stream_options': {sorted(unknown)[0]}", "stream_options",
                      "unknown_parameter")
        include_usage = get_bool(so, "include_usage", False, where="stream_options.")
    _check_unsupported(body)
    return Options(model=model, stream=stream, include_usage=include_usage, logprobs=None,
                   return_token_ids=get_bool(body, "return_token_ids", False),
                   ignore_eos=get_bool(body, "ignore_eos", False))


# --------------------------------------------------------------------------- chat: request
def _text(value: Any, where: str, allow_none: bool) -> str:
    if isinstance(value, str):
        return value
    if value is None and allow_none:
        return ""
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
                          where)
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where} must be a string or an array of text parts, got {type_name(value)}", where, "invalid_type")


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of {role, content} objects", "messages",
                  "invalid_type" if not isinstance(messages, list) else "invalid_value")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object, got {type_name(m)}", where, "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", f"{where}.role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _text(m.get("content"), f"{where}.content", allow_none=role == "assistant")}
        if role == "assistant":
            for key in ("tool_calls", "reasoning_content", "reasoning"):
                if m.get(key) is not None:
                    msg[key] = m[key]
        elif m.get("tool_calls") is not None:
            raise bad(f"{where}.tool_calls: only assistant messages carry tool calls", f"{where}.tool_calls")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id",
                          "invalid_type" if call_id is not None else "missing_required_parameter")
            msg["tool_call_id"] = call_id
        out.append(msg)
    return out


def parse_tools(tools: Any, param: str = "tools") -> list[dict]:
    """OpenAI chat tools, validated; returned as given."""
    if tools is None:
        return []
    try:
        normalize_tools(tools)
    except ValueError as e:
        raise bad(str(e), param) from None
    return list(tools)


def parse_tool_choice(value: Any, param: str = "tool_choice") -> ToolChoice:
    """"auto", "none", "required" or {"type": "function", "function": {"name": ...}}."""
    if value is None:
        return ToolChoice()
    if value in ("auto", "none", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str):
        return ToolChoice("function", value["function"]["name"])
    raise bad(f"'{param}' must be \"auto\", \"none\", \"required\" or "
              f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", param)


def parse_effort(value: Any, param: str) -> str | None:
    """An OpenAI effort name -> a DeepSeek-V4 level; None for "none" (no thinking)."""
    if value is None or value == "none":
        return None
    if value not in EFFORT_LEVELS:
        raise bad(f"'{param}' must be one of none, {', '.join(EFFORT_LEVELS)}; got {value!r}", param)
    return EFFORT_LEVELS[value]


def _thinking(body: dict) -> bool | None:
    """DeepSeek's {"type": "enabled"|"disabled"}, or a plain boolean; None when not given."""
    v = body.get("thinking")
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, dict) and v.get("type") in ("enabled", "disabled") and set(v) <= {"type"}:
        return v["type"] == "enabled"
    raise bad("'thinking' must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"} (or a boolean)", "thinking",
              "invalid_type")


def parse_chat(body: dict, max_top_logprobs: int = MAX_TOP_LOGPROBS) -> tuple[ChatRequest, Options]:
    check_unknown(body, CHAT_FIELDS, IGNORED)
    opts = _parse_options(body)
    sampling = parse_sampling(body)
    messages = _messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"))
    effort = parse_effort(body.get("reasoning_effort"), "reasoning_effort")
    thinking = _thinking(body)
    if thinking is None:
        thinking = effort is not None
    if get_bool(body, "logprobs", False):
        opts.logprobs = int(get_number(body, "top_logprobs", 0, lo=0, hi=max_top_logprobs, integer=True))
    elif body.get("top_logprobs") is not None:
        get_number(body, "top_logprobs", 0, lo=0, hi=max_top_logprobs, integer=True)
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    creq = ChatRequest(messages=messages, tools=tools, tool_choice=choice, thinking=thinking,
                       reasoning_effort=effort if thinking else None, sampling=sampling,
                       max_tokens=get_number(body, param, None, lo=1, integer=True), max_tokens_param=param,
                       stop=parse_stop(body), logprobs=opts.logprobs, ignore_eos=opts.ignore_eos)
    return creq, opts


# --------------------------------------------------------------------------- completions: request
def parse_completion(body: dict, state) -> tuple[Generation, Options]:
    check_unknown(body, COMPLETION_FIELDS, IGNORED)
    opts = _parse_options(body)
    sampling = parse_sampling(body)
    vocab_size = state.model.config.vocab_size
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = state.tokenizer.encode(prompt)
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
    opts.logprobs = get_number(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    max_tokens = get_number(body, "max_tokens", 16, lo=1, integer=True)  # OpenAI's default for completions
    max_tokens = fit_context(len(ids), max_tokens, state.config.ctx, prompt_param="prompt", max_param="max_tokens")
    gen = Generation.completion(state, ids, max_tokens, sampling=sampling, stop=parse_stop(body),
                                logprobs=opts.logprobs, ignore_eos=opts.ignore_eos)
    return gen, opts


# --------------------------------------------------------------------------- responses
def usage(gen: Generation) -> dict:
    u = gen.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class _View:
    """Shared by chat and completions: ids, logprobs, the SSE framing."""

    object_name = ""

    def __init__(self, state, opts: Options, gen: Generation, id_prefix: str):
        self.s, self.o, self.gen = state, opts, gen
        self.id = id_prefix + gen.request.id if gen.request else id_prefix
        self.created = int(time.time())
        self.tokens: list = []  # TokenOut of every sampled token

    def _object(self, choices: list[dict], chunk: bool) -> dict:
        return {"id": self.id, "object": self.object_name + (".chunk" if chunk and self.object_name.startswith("chat")
                                                             else ""),
                "created": self.created, "model": self.s.config.model_name, "system_fingerprint": None,
                "choices": choices}

    def _chunk(self, choice: dict) -> bytes:
        obj = self._object([choice], chunk=True)
        if self.o.include_usage:
            obj["usage"] = None
        return _sse(obj)

    def _final(self, choice: dict) -> bytes:
        data = self._chunk(choice)
        if self.o.include_usage:
            last = self._object([], chunk=True)
            last["usage"] = usage(self.gen)
            data += _sse(last)
        return data + b"data: [DONE]\n\n"

    def error(self, e: APIError) -> bytes:
        return b"event: error\ndata: " + json.dumps(error_body(e)).encode() + b"\n\n"

    def _ids(self, choice: dict, outs: list) -> None:
        if self.o.return_token_ids:
            choice["token_ids"] = [o.token_id for o in outs]


class ChatView(_View):
    object_name = "chat.completion"

    def __init__(self, state, opts: Options, gen: Generation):
        super().__init__(state, opts, gen, "chatcmpl-")

    def _logprobs(self, outs: list) -> dict | None:
        if self.o.logprobs is None or not outs:
            return None
        tt = self.s.token_text
        return {"content": [{
            "token": tt.text(o.token_id), "logprob": o.logprob, "bytes": tt.bytes(o.token_id),
            "top_logprobs": [{"token": tt.text(t), "logprob": lp, "bytes": tt.bytes(t)} for t, lp in o.top or ()],
        } for o in outs]}

    def start(self) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        obj = self._object([choice], chunk=True)
        if self.o.return_token_ids:
            obj["prompt_token_ids"] = self.gen.prompt_ids
        if self.o.include_usage:
            obj["usage"] = None
        return _sse(obj)

    def feed(self, events: list) -> bytes:
        """SSE for `events` (one chunk per sampled token and what it released)."""
        out: list[bytes] = []
        group: dict | None = None  # {"outs": [...], "delta": {...}}

        def flush():
            if group is None:
                return
            delta, outs = group["delta"], group["outs"]
            if not delta and self.o.logprobs is None and not self.o.return_token_ids:
                return
            choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(outs), "finish_reason": None}
            self._ids(choice, outs)
            out.append(self._chunk(choice))

        for ev in events:
            if isinstance(ev, Token):
                self.tokens.append(ev.out)
                flush()
                group = {"outs": [ev.out], "delta": {}}
            elif isinstance(ev, (Text, Call)):
                group = group or {"outs": [], "delta": {}}
                delta = group["delta"]
                if isinstance(ev, Text):
                    key = "reasoning_content" if ev.channel == "reasoning" else "content"
                    delta[key] = delta.get(key, "") + ev.text
                else:
                    delta.setdefault("tool_calls", []).append({
                        "index": ev.index, "id": ev.id, "type": "function",
                        "function": {"name": ev.name, "arguments": ev.arguments}})
            elif isinstance(ev, Done):
                flush()
                group = None
                out.append(self._final({"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": FINISH[ev.finish]}))
        flush()
        return b"".join(out)

    def body(self) -> dict:
        gen = self.gen
        message: dict[str, Any] = {"role": "assistant", "content": gen.content}
        if gen.reasoning:
            message["reasoning_content"] = gen.reasoning
        if gen.calls:
            message["content"] = gen.content or None
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in gen.calls]
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(self.tokens),
                  "finish_reason": FINISH[gen.done.finish]}
        self._ids(choice, self.tokens)
        obj = self._object([choice], chunk=False)
        obj["usage"] = usage(gen)
        if self.o.return_token_ids:
            obj["prompt_token_ids"] = gen.prompt_ids
        return obj


class CompletionView(_View):
    object_name = "text_completion"

    def __init__(self, state, opts: Options, gen: Generation):
        super().__init__(state, opts, gen, "cmpl-")
        self.offset = 0

    def _logprobs(self, outs: list) -> dict | None:
        if self.o.logprobs is None or not outs:
            return None
        tt = self.s.token_text
        offsets = []
        for o in outs:
            offsets.append(self.offset)
            self.offset += len(o.text)
        return {"tokens": [tt.text(o.token_id) for o in outs], "token_logprobs": [o.logprob for o in outs],
                "top_logprobs": [{tt.text(t): lp for t, lp in o.top or ()} for o in outs]
                if self.o.logprobs > 0 else None,
                "text_offset": offsets}

    def start(self) -> bytes:
        obj = self._object([{"index": 0, "text": "", "logprobs": None, "finish_reason": None}], chunk=True)
        if self.o.return_token_ids:
            obj["prompt_token_ids"] = self.gen.prompt_ids
        if self.o.include_usage:
            obj["usage"] = None
        return _sse(obj)

    def feed(self, events: list) -> bytes:
        out = []
        for ev in events:
            if isinstance(ev, Token):
                self.tokens.append(ev.out)
                o = ev.out
                if o.text or self.o.logprobs is not None or self.o.return_token_ids:
                    choice = {"index": 0, "text": o.text, "logprobs": self._logprobs([o]), "finish_reason": None}
                    self._ids(choice, [o])
                    out.append(self._chunk(choice))
            elif isinstance(ev, Done):
                out.append(self._final({"index": 0, "text": "", "logprobs": None, "finish_reason": FINISH[ev.finish]}))
        return b"".join(out)

    def body(self) -> dict:
        self.offset = 0
        choice = {"index": 0, "text": self.gen.content, "logprobs": self._logprobs(self.tokens),
                  "finish_reason": FINISH[self.gen.done.finish]}
        self._ids(choice, self.tokens)
        obj = self._object([choice], chunk=False)
        obj["usage"] = usage(self.gen)
        if self.o.return_token_ids:
            obj["prompt_token_ids"] = self.gen.prompt_ids
        return obj


# --------------------------------------------------------------------------- endpoints
async def chat_completions(state, request: Request) -> Response:
    body = await state.read_json(request)
    creq, opts = parse_chat(body)
    state.check_model(opts.model)
    gen = Generation.chat(state, creq, call_id_prefix="call_")
    return await state.respond(request, gen, lambda: ChatView(state, opts, gen), opts.stream)


async def completions(state, request: Request) -> Response:
    body = await state.read_json(request)
    gen, opts = parse_completion(body, state)
    state.check_model(opts.model)
    return await state.respond(request, gen, lambda: CompletionView(state, opts, gen), opts.stream)
