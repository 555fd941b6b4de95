"""OpenAI chat completions and completions: JSON in, `serve.http.chat` request out; events back to JSON/SSE.

Chat completions take ``tools`` (function tools; ``strict: true`` constrains every call of the
function, forced or not, to its schema: see `serve.http.chat.strict_tool_grammar`), ``tool_choice``
(auto, none, required, a named function), DeepSeek's ``thinking: {"type": "enabled"|"disabled"}`` (or a boolean), ``reasoning_effort`` (which turns
thinking on unless it says "none") and ``response_format`` (text, json_object, json_schema:
the content is constrained to the schema, after the reasoning in thinking mode). Replies carry
reasoning in ``reasoning_content`` (DeepSeek's field) and calls in ``tool_calls`` with
JSON-string arguments (``finish_reason: "tool_calls"``); streamed, each call arrives whole in
one delta.

Both endpoints sample with `temperature`, `top_p`, `seed`, `stop`, `presence_penalty`,
`frequency_penalty`, `logit_bias` and `n` choices (sharing the prompt's prefill; choice i is
seeded `seed + i`). Completions also take `best_of` (the `n` of `best_of` choices with the
highest cumulative logprob), `echo` (the prompt first, with its logprobs when `logprobs` is
set; `max_tokens` 0 then scores the prompt alone) and a list of prompts (strings or token-id
lists: `n` choices each, in order). Extensions (vLLM's spellings): `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos` (generate to `max_tokens`
even past EOS), `return_token_ids` (token ids of the prompt and of the output in the response).

Fields this server does not know are ignored and logged once; the few whose absence would
change what the client gets (`suffix`, the legacy `functions`, audio, images) are 400s naming
them: see `serve.http.request_policy`. Hosted tools (`web_search`, ...) are left out of the prompt.

Errors: ``{"error": {"message", "type", "param", "code"}}``, as OpenAI answers them.
"""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ds4_torch.chat_encoding import normalize_tools
from ds4_torch.sampling import SamplingParams

from .chat import (Call, ChatRequest, Choices, Done, Generation, PromptLogprobs, Text, Token, ToolChoice,
                   json_grammar, strict_tool_grammar)
from .protocol import (APIError, bad, check_fits, fit_context, get_bool, get_list, get_number, get_object,
                       get_str, type_name, value_error)
from .request_policy import (LIMITS, UNREADABLE_INPUT, check_count, check_tools_size, drop_hosted_tools,
                             ignore_unknown, is_hosted_tool, note_ignored, parse_stop, refuse_unreadable)

# Fields accepted and ignored: they do not change what is generated.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                     "safety_identifier"})
SAMPLING_FIELDS = frozenset({"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                             "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                             "stop_token_ids"})
COMMON = SAMPLING_FIELDS | {"model", "stream", "stream_options", "max_tokens", "stop", "n", "logprobs",
                            "return_token_ids", "ignore_eos"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "response_format", "thinking", "reasoning_effort"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of"}
MESSAGE_FIELDS = {"role", "content", "tool_calls", "reasoning_content", "reasoning", "tool_call_id"}
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = LIMITS["choices"]  # n and best_of
MAX_SEED = 2**63 - 1        # a signed 64-bit seed (what torch's generators take)
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
def parse_sampling(body: dict, vocab_size: int | None = None) -> SamplingParams:
    """The sampling settings of `body` (OpenAI's and vLLM's names), each checked and named when
    wrong; `vocab_size`: token ids in `logit_bias` and `stop_token_ids` must be inside it."""
    top_k = int(get_number(body, "top_k", 0, lo=-1, integer=True))
    bias = get_object(body, "logit_bias")
    if bias is not None and len(bias) > LIMITS["logit_bias_entries"]:
        raise bad(f"'logit_bias' holds {len(bias)} entries; this server takes at most {LIMITS['logit_bias_entries']}",
                  "logit_bias")
    stops = get_list(body, "stop_token_ids")
    if stops is not None:
        check_count(stops, "logit_bias_entries", "stop_token_ids")
    try:
        params = SamplingParams(
            temperature=float(get_number(body, "temperature", 1.0, lo=0.0, hi=2.0)),
            top_p=float(get_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)),
            top_k=0 if top_k == -1 else top_k,  # -1: vLLM's spelling of "no top-k"
            min_p=float(get_number(body, "min_p", 0.0, lo=0.0, hi=1.0)),
            seed=get_number(body, "seed", None, lo=-MAX_SEED - 1, hi=MAX_SEED, integer=True),
            presence_penalty=float(get_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0)),
            frequency_penalty=float(get_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0)),
            repetition_penalty=float(get_number(body, "repetition_penalty", 1.0, lo=0.0, lo_open=True)),
            logit_bias=bias or (),
            min_tokens=get_number(body, "min_tokens", 0, lo=0, integer=True),
            stop_token_ids=stops or (),
        )
        params.check(vocab_size=vocab_size)
    except ValueError as e:  # what only SamplingParams checks: logit_bias and stop_token_ids entries
        raise value_error(e) from None
    return params


@dataclass
class Options:
    """What the OpenAI response shape needs beyond the internal request."""
    model: str | None
    stream: bool
    include_usage: bool
    logprobs: int | None
    return_token_ids: bool
    ignore_eos: bool
    n: int = 1
    best_of: int = 1
    echo: bool = False


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
        ignore_unknown("chat", so, {"include_usage", "continuous_usage_stats", "include_obfuscation"},
                       "stream_options.")
        include_usage = get_bool(so, "include_usage", False, where="stream_options.")
    n = get_number(body, "n", 1, lo=1, hi=MAX_CHOICES, integer=True)
    return Options(model=model, stream=stream, include_usage=include_usage, logprobs=None,
                   return_token_ids=get_bool(body, "return_token_ids", False),
                   ignore_eos=get_bool(body, "ignore_eos", False), n=n, best_of=n)


# --------------------------------------------------------------------------- chat: request
def _text(value: Any, where: str, allow_none: bool) -> str:
    if isinstance(value, str):
        return value
    if value is None and allow_none:
        return ""
    if isinstance(value, list):
        check_count(value, "content_blocks", where)
        texts = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in UNREADABLE_INPUT:
                refuse_unreadable(kind, f"{where}[{j}]")
            if kind in ("text", "refusal") and isinstance(part.get(kind), str):
                texts.append(part[kind])
            elif isinstance(kind, str):
                note_ignored("chat", f"content parts of type {kind!r}")
            else:
                raise bad(f"{where}[{j}] must be a content part with a 'type' ({{\"type\": \"text\", \"text\": ...}})",
                          f"{where}[{j}]", "invalid_type")
        return "".join(texts)
    raise bad(f"{where} must be a string or an array of text parts, got {type_name(value)}", where, "invalid_type")


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of {role, content} objects", "messages",
                  "invalid_type" if not isinstance(messages, list) else "invalid_value")
    check_count(messages, "messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object, got {type_name(m)}", where, "invalid_type")
        ignore_unknown("chat", m, MESSAGE_FIELDS, "messages[].")
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
    """OpenAI chat tools, validated; returned as given, without the hosted ones (`web_search`,
    ...), which the server cannot run."""
    if tools is None:
        return []
    if isinstance(tools, list):
        check_tools_size(tools, param)
        tools = drop_hosted_tools("chat", tools)
        for t in tools:
            if isinstance(t, dict):
                ignore_unknown("chat", t, {"type", "function"}, "tools[].")
                if isinstance(t.get("function"), dict):
                    ignore_unknown("chat", t["function"], {"name", "description", "parameters", "strict"},
                                   "tools[].function.")
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
    if isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] not in ("function", "custom") \
            and is_hosted_tool("responses", value):
        note_ignored("chat", f"a tool_choice naming the {value['type']!r} tool", "that tool is left out; choice auto")
        return ToolChoice()
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


def parse_response_format(state, value: Any, param: str = "response_format"):
    """Chat's `response_format` -> a grammar (None for text): {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad(f"'{param}' must be an object, got {type_name(value)}", param, "invalid_type")
    kind = get_str(value, "type", where=f"{param}.", choices=("text", "json_object", "json_schema"))
    if kind is None:
        raise bad(f"'{param}.type' is required", f"{param}.type", "missing_required_parameter")
    ignore_unknown("chat", value, {"type"} | ({"json_schema"} if kind == "json_schema" else set()), f"{param}.")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar(state, None, param)
    where = f"{param}.json_schema"
    spec = get_object(value, "json_schema", where=f"{param}.")
    if spec is None:
        raise bad(f"'{where}' is required with type json_schema", where, "missing_required_parameter")
    ignore_unknown("chat", spec, {"name", "schema", "strict", "description"}, f"{where}.")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad(f"'{where}.name' must be a non-empty string", f"{where}.name",
                  "missing_required_parameter" if "name" not in spec else "invalid_value")
    get_bool(spec, "strict", False, where=f"{where}.")
    get_str(spec, "description", where=f"{where}.")
    return json_grammar(state, spec.get("schema", {}), f"{where}.schema")


def parse_chat(body: dict, max_top_logprobs: int = MAX_TOP_LOGPROBS, state=None) -> tuple[ChatRequest, Options]:
    """The chat request of `body`; `state` (the server's) compiles grammars and checks token ids
    against the vocabulary (without it, e.g. for /tokenize, only the messages matter)."""
    ignore_unknown("chat", body, CHAT_FIELDS | IGNORED)
    opts = _parse_options(body)
    sampling = parse_sampling(body, state.model.config.vocab_size if state is not None else None)
    messages = _messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"))
    grammar = parse_response_format(state, body.get("response_format")) if state is not None else None
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
                       stop=parse_stop(body), logprobs=opts.logprobs, ignore_eos=opts.ignore_eos, grammar=grammar,
                       parallel_tool_calls=get_bool(body, "parallel_tool_calls", True))
    if state is not None:
        creq.grammar = strict_tool_grammar(state, creq)  # strict tools: a forced call, or auto's text-or-calls
    return creq, opts


# --------------------------------------------------------------------------- completions: request
def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def parse_prompts(body: dict, state) -> list[tuple[list[int], str]]:
    """The prompts of a completions request, each as (token ids, text): a string, a list of token
    ids, or a list of either (OpenAI's batch: the choices of each, in order)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) >= max(state.config.ctx, state.config.max_queue):
        # More token ids than the context holds, or more prompts than the queue: known from the
        # length, before any per-element work.
        check_fits(len(prompt), state.config.ctx, "prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts, params = [prompt], ["prompt"]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts, params = prompt, [f"prompt[{i}]" for i in range(len(prompt))]
    else:
        raise bad("'prompt' must be a string, a non-empty array of token ids, or an array of either", "prompt",
                  "invalid_type" if prompt is not None else "missing_required_parameter")
    vocab_size = state.model.config.vocab_size
    out = []
    for p, param in zip(prompts, params):
        # Too long for the context is known from the length alone, before any per-token cost.
        check_fits(len(p) // state.tokenizer.max_token_chars if isinstance(p, str) else len(p), state.config.ctx,
                   param)
        if isinstance(p, str):
            ids, text = state.tokenizer.encode(p), p
        elif _is_ids(p):
            bad_ids = [t for t in p if not 0 <= t < vocab_size]
            if bad_ids:
                raise bad(f"'{param}' token id {bad_ids[0]} is outside the vocabulary [0, {vocab_size})", param)
            ids, text = list(p), state.tokenizer.decode(p)
        else:
            raise bad(f"'{param}' must be a string or a non-empty array of token ids", param, "invalid_type")
        if not ids:
            raise bad(f"'{param}' encodes to no tokens", param)
        out.append((ids, text))
    return out


def parse_completion(body: dict, state) -> tuple[Choices, Options, list[str]]:
    """The generations of a completions request, its options, and each prompt's text (for echo)."""
    ignore_unknown("completions", body, COMPLETION_FIELDS | IGNORED)
    opts = _parse_options(body)
    sampling = parse_sampling(body, state.model.config.vocab_size)
    prompts = parse_prompts(body, state)
    opts.echo = get_bool(body, "echo", False)
    opts.logprobs = get_number(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    opts.best_of = get_number(body, "best_of", opts.n, lo=1, hi=MAX_CHOICES, integer=True)
    if opts.best_of < opts.n:
        raise bad(f"'best_of' ({opts.best_of}) must be >= 'n' ({opts.n})", "best_of")
    if opts.best_of > opts.n and opts.stream:
        raise bad("'best_of' cannot be used with 'stream' (the best choices are known at the end)", "best_of")
    if len(prompts) * opts.best_of > state.config.max_queue:
        raise bad(f"{len(prompts)} prompts x {opts.best_of} choices is more than this server's queue of "
                  f"{state.config.max_queue} requests", "prompt")
    max_tokens = get_number(body, "max_tokens", 16, lo=0, integer=True)  # OpenAI's default for completions
    if max_tokens == 0 and not opts.echo:
        raise bad("'max_tokens' must be >= 1 (0 only with 'echo': the prompt alone)", "max_tokens")
    # best_of ranks by cumulative logprob: computed whenever it ranks, shown only when asked for.
    logprobs = opts.logprobs if opts.logprobs is not None or opts.best_of == opts.n else 0
    stop = parse_stop(body)
    groups = []
    for i, (ids, _) in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        budget = fit_context(len(ids), max_tokens, state.config.ctx, prompt_param=param)
        groups.append([Generation.completion(
            state, ids, budget, sampling=sampling.for_choice(j), stop=stop, logprobs=logprobs,
            ignore_eos=opts.ignore_eos,
            # The prompt's logprobs come once per prompt: its first choice computes them.
            prompt_logprobs=opts.logprobs if opts.echo and j == 0 else None) for j in range(opts.best_of)])
    return Choices(groups), opts, [text for _, text in prompts]


# --------------------------------------------------------------------------- responses
def usage(gen) -> dict:
    u = gen.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class _View:
    """Shared by chat and completions: ids, the SSE framing, per-choice sampled tokens."""

    object_name = ""

    def __init__(self, state, opts: Options, gen: Choices, id_prefix: str):
        self.s, self.o, self.gen = state, opts, gen
        self.id = id_prefix + gen.request.id if gen.request else id_prefix
        self.created = int(time.time())
        self.tokens: dict[int, list] = {g.choice: [] for g in gen.gens}  # TokenOut of every sampled token
        self.closed = False

    def _object(self, choices: list[dict], chunk: bool) -> dict:
        return {"id": self.id, "object": self.object_name + (".chunk" if chunk and self.object_name.startswith("chat")
                                                             else ""),
                "created": self.created, "model": self.o.model or self.s.config.model_name, "system_fingerprint": None,
                "choices": choices}

    def _chunk(self, choice: dict) -> bytes:
        obj = self._object([choice], chunk=True)
        if self.o.include_usage:
            obj["usage"] = None
        return _sse(obj)

    def _close(self) -> bytes:
        """Once every choice is done: the usage chunk (when asked for) and [DONE]."""
        if self.closed or not all(g.done is not None for g in self.gen.gens):
            return b""
        self.closed = True
        data = b""
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

    def _prompt_ids(self, obj: dict) -> None:
        if self.o.return_token_ids:
            obj["prompt_token_ids"] = self.gen.gens[0].prompt_ids


class ChatView(_View):
    object_name = "chat.completion"

    def __init__(self, state, opts: Options, gen: Choices):
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
        out = []
        for g in self.gen.gens:
            choice = {"index": g.choice, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            obj = self._object([choice], chunk=True)
            if g.choice == 0:
                self._prompt_ids(obj)
            if self.o.include_usage:
                obj["usage"] = None
            out.append(_sse(obj))
        return b"".join(out)

    def feed(self, events: list) -> bytes:
        """SSE for `events` (one chunk per sampled token and what it released, per choice)."""
        out: list[bytes] = []
        group: dict | None = None  # {"choice": i, "outs": [...], "delta": {...}}

        def flush():
            if group is None:
                return
            delta, outs = group["delta"], group["outs"]
            if not delta and self.o.logprobs is None and not self.o.return_token_ids:
                return
            choice = {"index": group["choice"], "delta": delta, "logprobs": self._logprobs(outs),
                      "finish_reason": None}
            self._ids(choice, outs)
            out.append(self._chunk(choice))

        for ev in events:
            if isinstance(ev, Token):
                self.tokens[ev.choice].append(ev.out)
                flush()
                group = {"choice": ev.choice, "outs": [ev.out], "delta": {}}
            elif isinstance(ev, (Text, Call)):
                if group is None or group["choice"] != ev.choice:
                    flush()
                    group = {"choice": ev.choice, "outs": [], "delta": {}}
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
                out.append(self._chunk({"index": ev.choice, "delta": {}, "logprobs": None,
                                        "finish_reason": FINISH[ev.finish]}))
        flush()
        out.append(self._close())
        return b"".join(out)

    def _choice(self, gen: Generation) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": gen.content}
        if gen.reasoning:
            message["reasoning_content"] = gen.reasoning
        if gen.calls:
            message["content"] = gen.content or None
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in gen.calls]
        tokens = self.tokens[gen.choice]
        choice = {"index": gen.choice, "message": message, "logprobs": self._logprobs(tokens),
                  "finish_reason": FINISH[gen.done.finish]}
        self._ids(choice, tokens)
        return choice

    def body(self) -> dict:
        obj = self._object([self._choice(g) for g in self.gen.gens], chunk=False)
        obj["usage"] = usage(self.gen)
        self._prompt_ids(obj)
        return obj


def _cumulative_logprob(gen: Generation) -> float:
    return sum(r.cumulative_logprob for r in gen.requests)


class CompletionView(_View):
    """Legacy completions: per choice the text (after the prompt with `echo`) and OpenAI's
    legacy logprobs (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`): with `echo`
    the prompt's tokens first, the first of them with null logprobs (nothing predicts it)."""

    object_name = "text_completion"

    def __init__(self, state, opts: Options, gen: Choices, prompt_texts: list[str]):
        super().__init__(state, opts, gen, "cmpl-")
        self.prompt_texts = prompt_texts
        self.prompt_of = {g.choice: p for p, group in enumerate(gen.groups) for g in group}
        self.prompt_outs: dict[int, list] = {}     # prompt -> [TokenOut], from its first choice
        self.offset: dict[int, int] = {}           # choice -> text offset of its next token (once started)
        self.pending: tuple | None = None          # (choice, TokenOut, texts) of the token being streamed

    def _top(self, o) -> dict | None:
        if o.logprob is None:  # the prompt's first token
            return None
        tt = self.s.token_text
        top = {tt.text(t): lp for t, lp in o.top or ()}
        top.setdefault(tt.text(o.token_id), o.logprob)  # OpenAI: the chosen token always, so up to k + 1
        return top

    def _logprobs(self, outs: list, start: int) -> dict | None:
        """Legacy logprobs of `outs`, the first at text offset `start`."""
        if self.o.logprobs is None or not outs:
            return None
        tt = self.s.token_text
        return {"tokens": [tt.text(o.token_id) for o in outs], "token_logprobs": [o.logprob for o in outs],
                "top_logprobs": [self._top(o) for o in outs] if self.o.logprobs > 0 else None,
                "text_offset": list(itertools.accumulate((len(o.text) for o in outs[:-1]), initial=start))}

    @staticmethod
    def _merge(a: dict | None, b: dict | None) -> dict | None:
        if a is None or b is None:
            return a or b
        return {k: None if a[k] is None else a[k] + b[k] for k in a}

    def _echo(self, choice: int) -> tuple[str, dict | None]:
        """The prompt part of a choice: its text (with `echo`) and its logprobs."""
        if not self.o.echo:
            return "", None
        p = self.prompt_of[choice]
        return self.prompt_texts[p], self._logprobs(self.prompt_outs.get(p, []), 0)

    def _begin(self, choice: int, out: list) -> None:
        """A choice's first event: with echo, its prompt goes out first."""
        if choice in self.offset:
            return
        text, lp = self._echo(choice)
        self.offset[choice] = len(text)
        if text:
            out.append(self._chunk({"index": choice, "text": text, "logprobs": lp, "finish_reason": None}))

    def start(self) -> bytes:
        obj = self._object([{"index": 0, "text": "", "logprobs": None, "finish_reason": None}], chunk=True)
        self._prompt_ids(obj)
        if self.o.include_usage:
            obj["usage"] = None
        return _sse(obj)

    def feed(self, events: list) -> bytes:
        out: list[bytes] = []
        for ev in events:
            if isinstance(ev, PromptLogprobs):
                self.prompt_outs[self.prompt_of[ev.choice]] = ev.outs
            elif isinstance(ev, Token):
                self._flush(out)
                self._begin(ev.choice, out)
                self.tokens[ev.choice].append(ev.out)
                self.pending = (ev.choice, ev.out, [])
            elif isinstance(ev, Text):  # the token's text, markup kept out
                if self.pending is None or self.pending[0] != ev.choice:
                    self._flush(out)
                    self._begin(ev.choice, out)
                    self.pending = (ev.choice, None, [])
                self.pending[2].append(ev.text)
            elif isinstance(ev, Done):
                self._flush(out)
                self._begin(ev.choice, out)
                out.append(self._chunk({"index": ev.choice, "text": "", "logprobs": None,
                                        "finish_reason": FINISH[ev.finish]}))
        self._flush(out)
        out.append(self._close())
        return b"".join(out)

    def _flush(self, out: list) -> None:
        """The chunk of the last token: its text (what it released, without markup), logprobs, id."""
        if self.pending is None:
            return
        index, o, texts = self.pending
        self.pending = None
        text = "".join(texts)
        if text or (o is not None and (self.o.logprobs is not None or self.o.return_token_ids)):
            choice = {"index": index, "text": text,
                      "logprobs": self._logprobs([o], self.offset[index]) if o is not None else None,
                      "finish_reason": None}
            if o is not None:
                self._ids(choice, [o])
            out.append(self._chunk(choice))
        self.offset[index] += len(text)

    def _choice(self, index: int, gen: Generation) -> dict:
        prefix, prompt_lp = self._echo(gen.choice)
        tokens = self.tokens[gen.choice]
        choice = {"index": index, "text": prefix + gen.content,
                  "logprobs": self._merge(prompt_lp, self._logprobs(tokens, len(prefix))),
                  "finish_reason": FINISH[gen.done.finish]}
        self._ids(choice, tokens)
        if self.o.return_token_ids and len(self.gen.groups) > 1:
            choice["prompt_token_ids"] = gen.prompt_ids
        return choice

    def body(self) -> dict:
        choices = []
        for group in self.gen.groups:
            # best_of: the n choices with the highest cumulative logprob (stable: ties keep their order)
            chosen = group if len(group) == self.o.n else \
                sorted(group, key=_cumulative_logprob, reverse=True)[:self.o.n]
            for g in chosen:
                choices.append(self._choice(len(choices), g))
        obj = self._object(choices, chunk=False)
        obj["usage"] = usage(self.gen)
        if len(self.gen.groups) == 1:
            self._prompt_ids(obj)
        return obj


# --------------------------------------------------------------------------- endpoints
async def chat_completions(state, request: Request) -> Response:
    body = await state.read_json(request)
    creq, opts = parse_chat(body, state=state)
    state.check_model(opts.model)
    if opts.n > state.config.max_queue:  # never fits, however idle the server: not a 429
        raise bad(f"'n' ({opts.n}) is more than this server's queue of {state.config.max_queue} requests", "n")
    gen = Choices([Generation.chats(state, creq, opts.n, call_id_prefix="call_")])
    return await state.respond(request, gen, lambda: ChatView(state, opts, gen), opts.stream)


async def completions(state, request: Request) -> Response:
    body = await state.read_json(request)
    gen, opts, texts = parse_completion(body, state)
    state.check_model(opts.model)
    return await state.respond(request, gen, lambda: CompletionView(state, opts, gen, texts), opts.stream)
