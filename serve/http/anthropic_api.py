"""Anthropic Messages: POST /v1/messages and /v1/messages/count_tokens.

Request: ``system`` (a string or text blocks), ``messages`` with text, ``tool_use``,
``tool_result`` and ``thinking`` blocks, ``tools`` (custom tools: name, description,
input_schema, ``strict``: every call's input follows the schema, as in chat completions), ``tool_choice`` (auto, any, tool, none), ``thinking`` (enabled / disabled),
``output_config.effort``, ``output_config.format`` (``{"type": "json_schema", "schema": ...}``: the
reply's text is JSON valid against the schema, written under the same grammar as chat's
``response_format``; a schema feature that cannot be enforced is a 400 naming it), ``stop_sequences``, ``max_tokens``, ``stream``, and ``temperature``, ``top_p``,
``top_k`` (which Anthropic's SDK now sends through ``extra_body``). Consecutive
messages of one role are merged, as Anthropic does. A ``system`` message inside ``messages``
(Claude Code sends them) is rendered where it stands (see `ds4_torch.chat_encoding`). A ``system``
block of client metadata (Claude Code's ``x-anthropic-billing-header: ...``) is left out of the prompt,
logged once at debug level: it is no instruction and differs per task. Server
tools (web search, ...) are left out of the prompt; unknown fields and block types are ignored
and logged; images, non-text documents and a final assistant message (prefill) are answered
400 (`serve.http.request_policy` has the rules).

Reply: ``thinking`` (its signature carries the text, so a block sent back with ``display:
"omitted"`` still replays exactly), ``text`` and ``tool_use`` blocks in the order they were generated; ``stop_reason``
end_turn, max_tokens, stop_sequence or tool_use; ``usage`` with ``input_tokens`` (not read from
the cache), ``cache_read_input_tokens`` and ``output_tokens``. Streamed: message_start, then per
block content_block_start / content_block_delta (text_delta, thinking_delta + signature_delta,
input_json_delta with the whole arguments) / content_block_stop, then message_delta and
message_stop.

Errors: ``{"type": "error", "error": {"type": ..., "message": ...}}``; the message names the field.
"""
from __future__ import annotations

import base64
import json
import logging
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ds4_torch.sampling import SamplingParams

from .chat import Call, ChatRequest, Done, Generation, Text, ToolChoice, chat_prompt, json_grammar, strict_tool_grammar
from .openai_api import parse_effort
from .protocol import APIError, bad, get_bool, get_list, get_number, get_object, get_str, type_name
from .request_policy import (UNREADABLE_INPUT, check_count, check_tools_size, drop_hosted_tools, ignore_unknown,
                             note_ignored, parse_stop, refuse_unreadable)

FIELDS = {"model", "messages", "max_tokens", "system", "tools", "tool_choice", "thinking", "stop_sequences",
          "temperature", "top_p", "top_k", "stream", "output_config"}
MESSAGE_FIELDS = {"role", "content"}
TOOL_FIELDS = {"type", "name", "description", "input_schema", "strict"}
# What each block type may carry; other keys (cache_control, citations, ...) are ignored.
BLOCK_FIELDS = {"text": {"type", "text"}, "tool_result": {"type", "tool_use_id", "content", "is_error"},
                "tool_use": {"type", "id", "name", "input"}, "thinking": {"type", "thinking", "signature"},
                "document": {"type", "source", "title", "context"}, "search_result": {"type", "source", "title",
                                                                                     "content"}}
# Blocks of the server's own tools and reasoning it cannot read back: nothing to render.
IGNORED_BLOCKS = {"redacted_thinking", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                  "code_execution_tool_result", "bash_code_execution_tool_result",
                  "text_editor_code_execution_tool_result", "mcp_tool_use", "mcp_tool_result",
                  "container_upload", "tool_reference"}
# Bookkeeping and placement hints: they do not change what is generated.
IGNORED = {"metadata", "service_tier", "container", "context_management", "cache_control", "diagnostics",
           "inference_geo", "speed", "user_profile_id", "workspace_id"}
SIGNATURE_PREFIX = "ds4-thinking:"  # our thinking-block signature: the thinking text, base64
# System blocks that are client metadata, not instructions: Claude Code's first one is
# `x-anthropic-billing-header: cc_version=2.1.197.6e2; cc_entrypoint=sdk-cli;` (the version's suffix
# differs per task; some versions add a per-request `cch=`, a subagent `cc_is_subagent=`). In the
# prompt, a few tokens in, it would end the prefix two tasks share (their ~40K-token system prompt).
CLIENT_METADATA_PREFIXES = ("x-anthropic-billing-header:",)

STOP_REASON = {"end": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}


# --------------------------------------------------------------------------- errors
def error_body(e: APIError) -> dict:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(e: APIError) -> Response:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


# --------------------------------------------------------------------------- request
def is_client_metadata(text: str) -> bool:
    """A top-level system block's text that is client metadata (`CLIENT_METADATA_PREFIXES`)."""
    return text.lstrip().lower().startswith(CLIENT_METADATA_PREFIXES)


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of content blocks, got {type_name(content)}", where,
                  "invalid_type")
    check_count(content, "content_blocks", where)
    out = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad(f"{where}[{j}] must be a content block with a 'type'", f"{where}[{j}]", "invalid_type")
        block = _readable(block, f"{where}[{j}]")
        if block is not None:
            out.append(block)
    return out


def _readable(block: dict, where: str) -> dict | None:
    """The block as one this module renders (a document or search result as its text), None for
    one that is ignored (logged once), 400 for input that cannot be read."""
    kind = block["type"]
    if kind in UNREADABLE_INPUT:
        refuse_unreadable(kind, where)
    if kind in BLOCK_FIELDS:
        ignore_unknown("anthropic", block, BLOCK_FIELDS[kind], f"{kind} blocks' ")
    if kind == "document":
        source = block.get("source")
        if not isinstance(source, dict) or source.get("type") != "text" or not isinstance(source.get("data"), str):
            refuse_unreadable(f"document ({source.get('type') if isinstance(source, dict) else 'no'} source)", where)
        return {"type": "text", "text": source["data"]}
    if kind == "search_result":
        return {"type": "text", "text": _tool_result_text(block, where)}
    if kind in BLOCK_FIELDS:
        return block
    note_ignored("anthropic", f"content blocks of type {kind!r}",
                 "" if kind in IGNORED_BLOCKS else "an unknown type")
    return None


def _text_of(block: dict, where: str, key: str = "text") -> str:
    if not isinstance(block.get(key), str):
        raise bad(f"{where}.{key} must be a string", f"{where}.{key}", "invalid_type")
    return block[key]


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or an array of text blocks", f"{where}.content", "invalid_type")
    texts = []
    for j, part in enumerate(_blocks(content, f"{where}.content")):
        if part["type"] != "text":
            raise bad(f"{where}.content[{j}]: only text blocks are supported in a tool result", f"{where}.content[{j}]",
                      "unsupported_parameter")
        texts.append(_text_of(part, f"{where}.content[{j}]"))
    return "\n\n".join(texts)  # several parts stay apart, as the encoding keeps tool-result parts


def _user(blocks: list[tuple[str, dict]]) -> list[dict]:
    out = []
    for where, b in blocks:
        kind = b["type"]
        if kind == "text":
            out.append({"role": "user", "content": _text_of(b, where)})
        elif kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad(f"{where}.tool_use_id must be a string", f"{where}.tool_use_id", "invalid_type")
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": _tool_result_text(b, where)})
        else:
            raise bad(f"{where}: content blocks of type {kind!r} are not supported in user messages "
                      f"(text and tool_result are)", where, "unsupported_parameter")
    return out


def _assistant(blocks: list[tuple[str, dict]]) -> dict:
    content, reasoning, calls = [], [], []
    for where, b in blocks:
        kind = b["type"]
        if kind == "text":
            content.append(_text_of(b, where))
        elif kind == "thinking":
            # With display "omitted" the client holds only the signature, which carries the text.
            text = _text_of(b, where, "thinking")
            sig = b.get("signature")
            if not text and isinstance(sig, str) and sig.startswith(SIGNATURE_PREFIX):
                try:
                    text = base64.b64decode(sig[len(SIGNATURE_PREFIX):], validate=True).decode("utf-8")
                except ValueError:
                    raise bad(f"{where}.signature is damaged", f"{where}.signature") from None
            reasoning.append(text)
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or not b["name"]:
                raise bad(f"{where}: a tool_use block needs a string 'id' and 'name'", where)
            if not isinstance(b.get("input"), dict):
                raise bad(f"{where}.input must be an object", f"{where}.input", "invalid_type")
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}})
        else:
            raise bad(f"{where}: content blocks of type {kind!r} are not supported in assistant messages", where,
                      "unsupported_parameter")
    m: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if reasoning:
        m["reasoning_content"] = "".join(reasoning)
    if calls:
        m["tool_calls"] = calls
    return m


def _hint(b: Any) -> bool:
    """A block carrying a cache_control breakpoint (any object: its type and ttl change nothing here)."""
    return isinstance(b, dict) and isinstance(b.get("cache_control"), dict)


def _messages(body: dict, hints: list[int] | None = None) -> list[dict]:
    """The messages; `hints` gets the message count after each cache_control breakpoint."""
    hints = [] if hints is None else hints
    out: list[dict] = []
    system = body.get("system")
    if isinstance(system, str):
        if system:
            out.append({"role": "system", "content": system})
    elif isinstance(system, list):
        for j, b in enumerate(system):
            if not isinstance(b, dict) or b.get("type") != "text":
                raise bad(f"system[{j}] must be a text block", f"system[{j}]", "invalid_type")
            text = _text_of(b, f"system[{j}]")
            if is_client_metadata(text):
                note_ignored("anthropic", "system blocks of client metadata (x-anthropic-billing-header)",
                             "not an instruction, and it differs per task: left out of the prompt", logging.DEBUG)
                continue
            out.append({"role": "system", "content": text})
            if _hint(b):
                hints.append(len(out))
    elif system is not None:
        raise bad(f"'system' must be a string or an array of text blocks, got {type_name(system)}", "system",
                  "invalid_type")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of {role, content} objects", "messages",
                  "invalid_type" if not isinstance(messages, list) else "invalid_value")
    check_count(messages, "messages", "messages")
    # Consecutive messages of one role form one turn (Anthropic merges them too).
    runs: list[tuple[str, list[tuple[str, dict]]]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object, got {type_name(m)}", where, "invalid_type")
        ignore_unknown("anthropic", m, MESSAGE_FIELDS, "messages[].")
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad(f"{where}.role must be 'user', 'assistant' or 'system'; got {role!r}", f"{where}.role")
        blocks = [(f"{where}.content[{j}]" if isinstance(m.get("content"), list) else f"{where}.content", b)
                  for j, b in enumerate(_blocks(m.get("content"), f"{where}.content"))]
        if runs and runs[-1][0] == role:
            runs[-1][1].extend(blocks)
        else:
            runs.append((role, blocks))
    talk = [(i, role) for i, (role, _) in enumerate(runs) if role != "system"]
    if not talk or talk[0][1] != "user":
        raise bad("messages[0] must be a user message", "messages[0].role")
    if talk[-1][1] == "assistant":
        raise bad("the last message must be a user message (continuing an assistant message is not supported)",
                  f"messages[{len(messages) - 1}].role", "unsupported_parameter")
    for role, blocks in runs:
        if role == "user":
            for block in blocks:
                out += _user([block])
                if _hint(block[1]):
                    hints.append(len(out))
        elif role == "system":
            for where, b in blocks:
                if b["type"] != "text":
                    raise bad(f"{where}: a system message holds text blocks only", where, "unsupported_parameter")
                out.append({"role": "system", "content": _text_of(b, where)})
                if _hint(b):
                    hints.append(len(out))
        else:
            out.append(_assistant(blocks))
            if any(_hint(b) for _, b in blocks):  # a breakpoint inside a turn: its end
                hints.append(len(out))
    return out


def _tools(body: dict) -> list[dict]:
    tools = get_list(body, "tools") or []
    check_tools_size(tools)
    out = []
    for k, t in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(t, dict):
            raise bad(f"{where} must be an object", where, "invalid_type")
        if not drop_hosted_tools("anthropic", [t]):
            continue  # a server tool (web search, ...): this server cannot run it
        ignore_unknown("anthropic", t, TOOL_FIELDS, "tools[].")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
        if not isinstance(t.get("input_schema"), dict):
            raise bad(f"{where}.input_schema must be an object", f"{where}.input_schema", "invalid_type")
        fn = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = get_str(t, "description", where=f"{where}.")
        fn["parameters"] = t["input_schema"]
        if get_bool(t, "strict", False, where=f"{where}."):  # Anthropic's strict tool use
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict, dropped: set[str]) -> ToolChoice:
    """`dropped`: the names of the server tools left out (a choice naming one falls back to auto)."""
    tc = get_object(body, "tool_choice")
    if tc is None:
        return ToolChoice()
    kind = get_str(tc, "type", where="tool_choice.", choices=("auto", "any", "tool", "none"))
    if kind == "tool":
        name = get_str(tc, "name", where="tool_choice.")
        if not name:
            raise bad("'tool_choice.name' is required when tool_choice.type is \"tool\"", "tool_choice.name")
        if name in dropped:
            note_ignored("anthropic", f"a tool_choice naming the server tool {name!r}", "left out; choice auto")
            return ToolChoice()
        return ToolChoice("function", name)
    return ToolChoice({"any": "required", None: "auto"}.get(kind, kind))


def _thinking(body: dict) -> tuple[bool, bool]:
    """(thinking on, thinking text shown in the reply)."""
    th = get_object(body, "thinking")
    if th is None:
        return False, True
    kind = get_str(th, "type", where="thinking.", choices=("enabled", "disabled", "adaptive", "between_tools"))
    if kind == "enabled":
        get_number(th, "budget_tokens", None, lo=1, integer=True, where="thinking.")
    # "updates" (interactive Claude Code 2.1 sends it) shows the thinking as it goes, as "summarized" does here.
    shown = get_str(th, "display", "summarized", where="thinking.",
                    choices=("summarized", "omitted", "updates")) != "omitted"
    return kind != "disabled", shown


def _output_config(body: dict) -> tuple[str | None, dict | None]:
    """(`output_config.effort`, the JSON schema of `output_config.format`: {"type": "json_schema",
    "schema": {...}}, or None)."""
    oc = get_object(body, "output_config") or {}
    ignore_unknown("anthropic", oc, {"effort", "format"}, "output_config.")
    effort = parse_effort(get_str(oc, "effort", where="output_config."), "output_config.effort")
    fmt = get_object(oc, "format", where="output_config.")
    if fmt is None:
        return effort, None
    kind = get_str(fmt, "type", where="output_config.format.", choices=("json_schema",))
    if kind is None:
        raise bad("'output_config.format.type' is required (\"json_schema\")", "output_config.format.type",
                  "missing_required_parameter")
    ignore_unknown("anthropic", fmt, {"type", "schema"}, "output_config.format.")
    schema = get_object(fmt, "schema", where="output_config.format.")
    if schema is None:
        raise bad("'output_config.format.schema' is required with type json_schema", "output_config.format.schema",
                  "missing_required_parameter")
    return effort, schema


def parse_request(body: dict, counting: bool = False, state=None) -> tuple[ChatRequest, str | None, bool, bool]:
    """(internal request, model, stream, thinking text shown). `state` (the server's) compiles the
    grammar of `output_config.format`; without it (counting tokens) the schema is not compiled."""
    ignore_unknown("anthropic", body, FIELDS | IGNORED)
    model = get_str(body, "model")
    if model is None:
        raise bad("'model' is required", "model", "missing_required_parameter")
    max_tokens = None
    if not counting:
        if body.get("max_tokens") is None:
            raise bad("'max_tokens' is required", "max_tokens", "missing_required_parameter")
        max_tokens = get_number(body, "max_tokens", None, lo=1, integer=True)
    sampling = SamplingParams(
        temperature=float(get_number(body, "temperature", 1.0, lo=0.0, hi=1.0)),
        top_p=float(get_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)),
        top_k=int(get_number(body, "top_k", 0, lo=0, integer=True)),
    )
    thinking, shown = _thinking(body)
    effort, output_schema = _output_config(body)
    tools = _tools(body)
    dropped = {t.get("name") for t in get_list(body, "tools") or [] if isinstance(t, dict)} - \
        {t["function"]["name"] for t in tools}
    hints: list[int] = []
    tc = get_object(body, "tool_choice") or {}
    parallel = not get_bool(tc, "disable_parallel_tool_use", False, where="tool_choice.")
    creq = ChatRequest(messages=_messages(body, hints), tools=tools, cache_hints=tuple(hints), tool_choice=_tool_choice(body, dropped),
                       parallel_tool_calls=parallel,
                       thinking=thinking, reasoning_effort=effort if thinking else None, sampling=sampling,
                       max_tokens=max_tokens, stop=parse_stop(body, "stop_sequences"),
                       tool_params_path="tools[{i}].input_schema")
    if output_schema is not None and state is not None:  # the reply is JSON the schema accepts (a text block)
        creq.grammar = json_grammar(state, output_schema, "output_config.format.schema")
    return creq, model, get_bool(body, "stream", False), shown


# --------------------------------------------------------------------------- reply
def _signature(thinking: str) -> str:
    return SIGNATURE_PREFIX + base64.b64encode(thinking.encode("utf-8")).decode()


class MessageView:
    """Anthropic's message object and event stream, built from one generation's events.
    `shown` False (thinking display "omitted"): thinking blocks carry only their signature."""

    def __init__(self, state, gen: Generation, model: str, shown: bool = True):
        self.gen, self.shown = gen, shown
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model
        self.blocks: list[dict] = []
        self._open: str | None = None  # kind of the last block while it is open
        self._thinking = ""  # the open thinking block's text (also when it is not shown)

    def _usage(self) -> dict:
        u = self.gen.usage
        return {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": u.cached_tokens, "output_tokens": u.completion_tokens}

    def start(self) -> bytes:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": {**self._usage(), "output_tokens": 0}}
        return _event("message_start", {"type": "message_start", "message": message})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        data = b""
        index = len(self.blocks) - 1
        if self._open == "thinking":
            block = self.blocks[index]
            block["signature"] = _signature(self._thinking)
            self._thinking = ""
            data += _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "signature_delta",
                                                             "signature": block["signature"]}})
        self._open = None
        return data + _event("content_block_stop", {"type": "content_block_stop", "index": index})

    def _begin(self, block: dict) -> bytes:
        data = self._close()
        self.blocks.append(block)
        self._open = block["type"]
        start = dict(block, input={}) if block["type"] == "tool_use" else block
        return data + _event("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                     "content_block": dict(start)})

    def feed(self, events: list) -> bytes:
        out = []
        for ev in events:
            if isinstance(ev, Text):
                kind, key, delta = ("thinking", "thinking", "thinking_delta") if ev.channel == "reasoning" \
                    else ("text", "text", "text_delta")
                if self._open != kind:
                    out.append(self._begin({"type": kind, key: ""} if kind == "text" else
                                           {"type": kind, key: "", "signature": ""}))
                if kind == "thinking":
                    self._thinking += ev.text
                    if not self.shown:
                        continue
                self.blocks[-1][key] += ev.text
                out.append(_event("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                          "delta": {"type": delta, key: ev.text}}))
            elif isinstance(ev, Call):
                out.append(self._begin({"type": "tool_use", "id": ev.id, "name": ev.name,
                                        "input": json.loads(ev.arguments)}))
                out.append(_event("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                          "delta": {"type": "input_json_delta",
                                                                    "partial_json": ev.arguments}}))
                out.append(self._close())
            elif isinstance(ev, Done):
                out.append(self._close())
                out.append(_event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": STOP_REASON[ev.finish], "stop_sequence": ev.stop_sequence},
                    "usage": self._usage()}))
                out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def error(self, e: APIError) -> bytes:
        return _event("error", error_body(e))

    def body(self) -> dict:
        self._close()
        done = self.gen.done
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.blocks,
                "stop_reason": STOP_REASON[done.finish], "stop_sequence": done.stop_sequence, "usage": self._usage()}


# --------------------------------------------------------------------------- endpoints
async def messages(state, request: Request) -> Response:
    body = await state.read_json(request)
    creq, model, stream, shown = parse_request(body, state=state)
    state.check_model(model)
    creq.grammar = strict_tool_grammar(state, creq)  # strict tools' calls, a forced call, else the format's
    gen = Generation.chat(state, creq, call_id_prefix="toolu_")
    return await state.respond(request, gen, lambda: MessageView(state, gen, model, shown), stream)


async def count_tokens(state, request: Request) -> Response:
    body = await state.read_json(request)
    creq, model, _, _ = parse_request(body, counting=True)
    state.check_model(model)
    return JSONResponse({"input_tokens": len(chat_prompt(state, creq, counting=True))})
