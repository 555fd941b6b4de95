"""OpenAI Responses: POST /v1/responses, stateless.

Request: ``input`` (a string, or items: messages with text parts, ``function_call``,
``function_call_output`` and ``reasoning`` items), ``instructions`` (the system prompt), function
``tools``, ``tool_choice``, ``reasoning.effort`` (turns thinking on unless "none"),
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``text.format`` (``json_object``,
or ``json_schema`` with ``name`` and ``schema``: the message text is constrained to the schema,
after the reasoning in thinking mode); a function tool with ``strict: true`` gets every call's
arguments constrained to its schema (forced or auto; ``strict`` is honoured only when given: the
API's default of true would put a grammar on, and 400 the schemas of, clients that never asked). Nothing is stored:
``previous_response_id``, ``conversation`` and item references are answered 400; a client sends
the whole conversation each time (as Codex does with ``store: false``). A system or developer
message after the conversation started is rendered where it stands (see
`ds4_torch.chat_encoding`).

Codex's tools: a ``namespace`` tool (each MCP server, the multi-agent tools) offers the function
tools inside it to the model, each under its own name, or as ``{namespace}__{name}`` (Codex's
flat spelling) where two offered tools share a name; the model's call comes back as a
``function_call`` item with ``name`` and ``namespace`` apart, which is how Codex dispatches it.
A ``custom`` (freeform) tool is offered as a function taking one string, ``input``; its calls
come back as ``custom_tool_call`` items. Hosted tools (``web_search``, ``file_search``, ...) are
left out of the prompt. Unknown fields, items and part types are ignored and logged;
`serve.http.request_policy` has the rules.

Reply: ``reasoning`` items (the reasoning in ``content`` as ``reasoning_text``, and, when
``include`` asks for ``reasoning.encrypted_content``, the same text in that field, which this
server reads back), a ``message`` item with ``output_text``, ``function_call`` items; ``status``
completed or incomplete (``max_output_tokens``). Streamed: response.created, response.in_progress,
per item response.output_item.added ... response.output_item.done with the text, reasoning-text
or function-call-argument events between, then response.completed.

Errors: OpenAI's ``{"error": {...}}``; mid-stream an ``error`` event.
"""
from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ds4_torch.sampling import SamplingParams

from .chat import Call, ChatRequest, Done, Generation, Text, json_grammar, strict_tool_grammar
from .openai_api import parse_effort, parse_tool_choice
from .protocol import APIError, bad, get_bool, get_list, get_number, get_object, get_str, type_name
from .request_policy import (UNREADABLE_INPUT, check_count, check_tools_size, drop_hosted_tools, ignore_unknown,
                             is_hosted_tool, note_ignored, refuse_unreadable)

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "reasoning",
          "max_output_tokens", "temperature",
          "top_p", "stream", "include", "text", "truncation", "stream_options", "max_tool_calls"}
IGNORED = {"store", "metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier"}
ENCRYPTED_PREFIX = "ds4-reasoning:"  # our encrypted_content: the reasoning text, base64
# Input items with nothing to render: calls of tools the server did not run, OpenAI-side state.
IGNORED_ITEMS = {"web_search_call", "file_search_call", "computer_call", "computer_call_output", "image_generation_call",
                 "code_interpreter_call", "local_shell_call", "local_shell_call_output", "mcp_call", "mcp_list_tools",
                 "mcp_approval_request", "mcp_approval_response", "compaction", "compaction_summary",
                 "tool_search_call", "tool_search_output", "additional_tools"}
FREEFORM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


@dataclass(frozen=True)
class OfferedTool:
    """A tool as the model sees it (`name`) and as the client knows it (`namespace`, `client_name`)."""
    name: str
    client_name: str
    namespace: str | None = None
    freeform: bool = False


def flat_name(namespace: str, name: str) -> str:
    """Codex's flat spelling of a namespaced tool: `mcp__weather` + `get_weather` ->
    `mcp__weather__get_weather` (underscores trimmed at the seam)."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


class ToolNames:
    """The names tools are offered under, and back: a namespaced tool goes by its own name unless
    another offered tool has it too (then by its flat name, which is always understood)."""

    def __init__(self, tools: list[OfferedTool]):
        self.tools = tools
        self.by_name = {t.name: t for t in tools}
        for t in tools:
            if t.namespace is not None:
                self.by_name.setdefault(flat_name(t.namespace, t.client_name), t)

    def offered(self, namespace: str | None, name: str) -> str:
        """The name the model sees for the client's (namespace, name); a tool no longer offered
        keeps its flat name."""
        for t in self.tools:
            if t.namespace == namespace and t.client_name == name:
                return t.name
        return flat_name(namespace, name) if namespace else name

    def lookup(self, name: str) -> OfferedTool | None:
        return self.by_name.get(name)


def _sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + \
        json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


# --------------------------------------------------------------------------- request
def _parts_text(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of content parts, got {type_name(content)}", where,
                  "invalid_type")
    check_count(content, "content_blocks", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in UNREADABLE_INPUT:
            refuse_unreadable(kind, f"{where}[{j}]")
        if kind in kinds + ("refusal",) and isinstance(part.get("text", part.get("refusal")), str):
            texts.append(part.get("text", part.get("refusal")))
        elif isinstance(kind, str):
            note_ignored("responses", f"content parts of type {kind!r}")
        else:
            raise bad(f"{where}[{j}] must be a content part with a 'type' ({', '.join(kinds)})", f"{where}[{j}]",
                      "invalid_type")
    return "".join(texts)


def _reasoning_text(item: dict, where: str) -> str | None:
    content = item.get("content")
    if content:
        return _parts_text(content, f"{where}.content", ("reasoning_text",))
    enc = item.get("encrypted_content")
    if isinstance(enc, str) and enc.startswith(ENCRYPTED_PREFIX):
        try:
            return base64.b64decode(enc[len(ENCRYPTED_PREFIX):], validate=True).decode("utf-8")
        except ValueError:
            raise bad(f"{where}.encrypted_content is damaged", f"{where}.encrypted_content") from None
    return None  # a summary only (or another server's encryption): nothing to render


def _input(body: dict, names: ToolNames) -> list[dict]:
    messages: list[dict] = []
    instructions = get_str(body, "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("'input' must be a string or a non-empty array of items", "input",
                  "invalid_type" if not isinstance(items, list) else "invalid_value")
    check_count(items, "messages", "input")
    assistant: dict | None = None  # the assistant turn being assembled from consecutive items

    def turn() -> dict:
        nonlocal assistant
        if assistant is None:
            assistant = {"role": "assistant", "content": ""}
            messages.append(assistant)
        return assistant

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object, got {type_name(item)}", where, "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{where}.role must be user, system, developer or assistant; got {role!r}", f"{where}.role")
            if role == "assistant":
                turn()["content"] += _parts_text(item.get("content"), f"{where}.content", ("output_text", "text"))
                continue
            assistant = None
            text = _parts_text(item.get("content"), f"{where}.content", ("input_text", "text"))
            messages.append({"role": "user" if role == "user" else "system", "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            value = "arguments" if kind == "function_call" else "input"
            for key in ("call_id", "name", value):
                if not isinstance(item.get(key), str):
                    raise bad(f"{where}.{key} must be a string", f"{where}.{key}", "invalid_type")
            namespace = get_str(item, "namespace", where=f"{where}.")
            arguments = item[value] if kind == "function_call" else {"input": item[value]}
            turn().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": names.offered(namespace, item["name"]), "arguments": arguments}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            # Without a call_id it answers no call of ours: Codex adds its own tools' outputs this way
            # (its goal's objective). It reads as a tool result all the same.
            if item.get("call_id") is not None and not isinstance(item.get("call_id"), str):
                raise bad(f"{where}.call_id must be a string", f"{where}.call_id", "invalid_type")
            assistant = None
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _parts_text(item.get("output"), f"{where}.output", ("input_text", "text"))})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text is not None:
                m = turn()
                m["reasoning_content"] = m.get("reasoning_content", "") + text
        elif kind == "item_reference" or not isinstance(kind, str):
            raise bad(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output, "
                      f"custom_tool_call(_output) and reasoning are; this server stores nothing, so item references "
                      f"cannot resolve)", f"{where}.type", "unsupported_parameter")
        else:
            note_ignored("responses", f"input items of type {kind!r}",
                         "" if kind in IGNORED_ITEMS else "an unknown type")
    return messages


FUNCTION_FIELDS = {"type", "name", "description", "parameters", "strict"}


def _function(t: dict, where: str, namespace: str | None = None) -> tuple[dict, OfferedTool]:
    """A function or custom tool -> (its function for the prompt, under its client name for now)."""
    if not isinstance(t.get("name"), str) or not t["name"]:
        raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
    freeform = t.get("type") == "custom"
    ignore_unknown("responses", t, FUNCTION_FIELDS | ({"format"} if freeform else set()),
                   "custom tools' " if freeform else "tools[].")
    fn = {"name": t["name"]}
    if t.get("description") is not None:
        fn["description"] = get_str(t, "description", where=f"{where}.")
    if freeform:  # strict: a grammar writes the one string it takes, so every call carries it
        fn["parameters"], fn["strict"] = FREEFORM_PARAMETERS, True
    else:
        params = get_object(t, "parameters", where=f"{where}.")
        if params is not None:
            fn["parameters"] = params
        if get_bool(t, "strict", False, where=f"{where}."):
            fn["strict"] = True
    return fn, OfferedTool(t["name"], t["name"], namespace, freeform)


def _tools(body: dict) -> tuple[list[dict], ToolNames]:
    """The tools offered to the model (a namespace's tools flattened in its place), and their names."""
    tools = get_list(body, "tools") or []
    check_tools_size(tools)
    fns: list[tuple[dict, OfferedTool]] = []
    for k, t in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(t, dict):
            raise bad(f"{where} must be an object", where, "invalid_type")
        if not drop_hosted_tools("responses", [t]):
            continue
        if t.get("type") == "namespace":
            ignore_unknown("responses", t, {"type", "name", "description", "tools"}, "namespace tools' ")
            namespace = get_str(t, "name", where=f"{where}.")
            if not namespace:
                raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
            inner = get_list(t, "tools", where=f"{where}.") or []
            for j, sub in enumerate(inner):
                if not isinstance(sub, dict):
                    raise bad(f"{where}.tools[{j}] must be an object", f"{where}.tools[{j}]", "invalid_type")
                if sub.get("type") not in ("function", "custom"):
                    note_ignored("responses", f"tools of type {sub.get('type')!r} inside a namespace")
                    continue
                fns.append(_function(sub, f"{where}.tools[{j}]", namespace))
        else:
            fns.append(_function(t, where))
    # A namespaced tool whose name another offered tool has too goes by its flat name.
    counts: dict[str, int] = {}
    for _, o in fns:
        counts[o.client_name] = counts.get(o.client_name, 0) + 1
    offered, out = [], []
    for fn, o in fns:
        if o.namespace is not None and counts[o.client_name] > 1:
            o = OfferedTool(flat_name(o.namespace, o.client_name), o.client_name, o.namespace, o.freeform)
        offered.append(o)
        out.append({"type": "function", "function": {**fn, "name": o.name}})
    return out, ToolNames(offered)


def _tool_choice(body: dict, names: ToolNames):
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") in ("function", "custom") and "function" not in tc:
        # Responses spells it flat, with the namespace apart.
        namespace = tc.get("namespace") if isinstance(tc.get("namespace"), str) else None
        name = names.offered(namespace, tc["name"]) if isinstance(tc.get("name"), str) else tc.get("name")
        tc = {"type": "function", "function": {"name": name}}
    elif isinstance(tc, dict) and (tc.get("type") == "allowed_tools" or is_hosted_tool("responses", tc)):
        note_ignored("responses", f"a tool_choice of type {tc.get('type')!r}", "choice auto")
        return parse_tool_choice("auto")
    return parse_tool_choice(tc)


def parse_text_format(state, fmt: dict | None):
    """`text.format` -> a grammar (None for text): {"type": "json_object"} or {"type":
    "json_schema", "name", "schema", "strict", "description"}."""
    if fmt is None:
        return None
    kind = get_str(fmt, "type", where="text.format.", choices=("text", "json_object", "json_schema"))
    if kind is None:
        raise bad("'text.format.type' is required", "text.format.type", "missing_required_parameter")
    fields = {"type"} | ({"name", "schema", "strict", "description"} if kind == "json_schema" else set())
    ignore_unknown("responses", fmt, fields, "text.format.")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar(state, None, "text.format")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise bad("'text.format.name' must be a non-empty string", "text.format.name",
                  "missing_required_parameter" if "name" not in fmt else "invalid_value")
    get_bool(fmt, "strict", False, where="text.format.")
    get_str(fmt, "description", where="text.format.")
    if "schema" not in fmt:
        raise bad("'text.format.schema' is required with type json_schema", "text.format.schema",
                  "missing_required_parameter")
    return json_grammar(state, fmt["schema"], "text.format.schema")


def parse_request(body: dict, state) -> tuple[ChatRequest, dict]:
    ignore_unknown("responses", body, FIELDS | IGNORED)
    text = get_object(body, "text") or {}
    ignore_unknown("responses", text, {"format", "verbosity"}, "text.")
    fmt = get_object(text, "format", where="text.")
    grammar = parse_text_format(state, fmt)
    reasoning = get_object(body, "reasoning") or {}
    effort = parse_effort(reasoning.get("effort"), "reasoning.effort")
    include = get_list(body, "include") or []
    model = get_str(body, "model")
    sampling = SamplingParams(temperature=float(get_number(body, "temperature", 1.0, lo=0.0, hi=2.0)),
                              top_p=float(get_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)))
    tools, names = _tools(body)
    creq = ChatRequest(messages=_input(body, names), tools=tools, tool_choice=_tool_choice(body, names),
                       thinking=effort is not None, reasoning_effort=effort, sampling=sampling,
                       max_tokens=get_number(body, "max_output_tokens", None, lo=1, integer=True),
                       messages_param="input", max_tokens_param="max_output_tokens", grammar=grammar,
                       tool_params_path="tools[{i}].parameters",
                       parallel_tool_calls=get_bool(body, "parallel_tool_calls", True))
    creq.grammar = strict_tool_grammar(state, creq)  # strict tools: a forced call, or auto's text-or-calls
    echo = {"model": model, "instructions": body.get("instructions"), "stream": get_bool(body, "stream", False),
            "encrypted": "reasoning.encrypted_content" in include, "reasoning": reasoning,
            "max_output_tokens": body.get("max_output_tokens"), "tools": get_list(body, "tools") or [],
            "tool_choice": body.get("tool_choice", "auto"), "temperature": sampling.temperature,
            "parallel_tool_calls": creq.parallel_tool_calls,
            "top_p": sampling.top_p, "metadata": body.get("metadata") or {},
            "text_format": fmt or {"type": "text"}, "names": names}
    return creq, echo


# --------------------------------------------------------------------------- reply
class ResponseView:
    """The response object and its event stream, built from one generation's events."""

    def __init__(self, state, gen: Generation, echo: dict):
        self.s, self.gen, self.echo = state, gen, echo
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.items: list[dict] = []
        self._open: str | None = None  # type of the last item while it is open
        self.seq = 0

    def _event(self, **event) -> bytes:
        event["sequence_number"] = self.seq
        self.seq += 1
        return _sse(event)

    def _usage(self) -> dict:
        u = self.gen.usage
        return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                "total_tokens": u.prompt_tokens + u.completion_tokens}

    def _response(self, status: str) -> dict:
        e = self.echo
        done = self.gen.done
        incomplete = status == "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": e["instructions"], "max_output_tokens": e["max_output_tokens"],
                "model": e["model"] or self.s.config.model_name,
                "output": self.items if done else [], "parallel_tool_calls": e["parallel_tool_calls"],
                "previous_response_id": None,
                "reasoning": {"effort": e["reasoning"].get("effort"), "summary": None}, "store": False,
                "temperature": e["temperature"], "text": {"format": e["text_format"]}, "tool_choice": e["tool_choice"],
                "tools": e["tools"], "top_p": e["top_p"], "truncation": "disabled",
                "usage": self._usage() if done else None, "metadata": e["metadata"]}

    def _status(self) -> str:
        return "incomplete" if self.gen.done.finish == "length" else "completed"

    def start(self) -> bytes:
        return self._event(type="response.created", response=self._response("in_progress")) + \
            self._event(type="response.in_progress", response=self._response("in_progress"))

    # -- items
    def _index(self) -> int:
        return len(self.items) - 1

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        item, index, self._open = self.items[-1], self._index(), None
        item["status"] = "completed"
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            if self.echo["encrypted"]:
                item["encrypted_content"] = ENCRYPTED_PREFIX + base64.b64encode(text.encode("utf-8")).decode()
            data = self._event(type="response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text)
        else:
            part = item["content"][0]
            data = self._event(type="response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"], logprobs=[])
            data += self._event(type="response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part)
        return data + self._event(type="response.output_item.done", output_index=index, item=item)

    def _begin(self, item: dict) -> bytes:
        data = self._close()
        self.items.append(item)
        index = self._index()
        self._open = item["type"]
        shown = json.loads(json.dumps(item))
        if item["type"] == "message":
            shown["content"] = []
            data += self._event(type="response.output_item.added", output_index=index, item=shown)
            return data + self._event(type="response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                             "logprobs": []})
        shown["content"][0]["text"] = ""
        return data + self._event(type="response.output_item.added", output_index=index, item=shown)

    def feed(self, events: list) -> bytes:
        out = []
        for ev in events:
            if isinstance(ev, Text) and ev.channel == "reasoning":
                if self._open != "reasoning":
                    out.append(self._begin({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [],
                                            "content": [{"type": "reasoning_text", "text": ""}],
                                            "status": "in_progress"}))
                self.items[-1]["content"][0]["text"] += ev.text
                out.append(self._event(type="response.reasoning_text.delta", item_id=self.items[-1]["id"],
                                       output_index=self._index(), content_index=0, delta=ev.text))
            elif isinstance(ev, Text):
                if self._open != "message":
                    out.append(self._begin({"type": "message", "id": "msg_" + uuid.uuid4().hex[:24],
                                            "status": "in_progress", "role": "assistant",
                                            "content": [{"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []}]}))
                self.items[-1]["content"][0]["text"] += ev.text
                out.append(self._event(type="response.output_text.delta", item_id=self.items[-1]["id"],
                                       output_index=self._index(), content_index=0, delta=ev.text, logprobs=[]))
            elif isinstance(ev, Call):
                out.append(self._close())
                out.append(self._call(ev))
            elif isinstance(ev, Done):
                out.append(self._close())
                status = self._status()
                out.append(self._event(type=f"response.{status}", response=self._response(status)))
        return b"".join(out)

    def _call(self, ev: Call) -> bytes:
        """A call as the client dispatches it: a `function_call` (with its `namespace` apart) or,
        for a freeform tool, a `custom_tool_call` whose `input` is the text."""
        tool = self.echo["names"].lookup(ev.name)
        if tool is not None and tool.freeform:
            value_key, value = "input", json.loads(ev.arguments).get("input", "")
            if not isinstance(value, str):
                value = json.dumps(value, ensure_ascii=False)
            item = {"type": "custom_tool_call", "id": "ctc_" + uuid.uuid4().hex[:24], "call_id": ev.id,
                    "name": tool.client_name, "input": "", "status": "in_progress"}
            kinds = ("response.custom_tool_call_input.delta", "response.custom_tool_call_input.done")
        else:
            value_key, value = "arguments", ev.arguments
            item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": ev.id,
                    "name": tool.client_name if tool else ev.name, "arguments": "", "status": "in_progress"}
            if tool is not None and tool.namespace is not None:
                item["namespace"] = tool.namespace
            kinds = ("response.function_call_arguments.delta", "response.function_call_arguments.done")
        self.items.append(item)
        index = self._index()
        data = self._event(type="response.output_item.added", output_index=index, item=dict(item))
        item[value_key] = value
        data += self._event(type=kinds[0], item_id=item["id"], output_index=index, delta=value)
        done = {value_key: value} if value_key == "input" else {"name": item["name"], value_key: value}
        data += self._event(type=kinds[1], item_id=item["id"], output_index=index, **done)
        item["status"] = "completed"
        return data + self._event(type="response.output_item.done", output_index=index, item=item)

    def error(self, e: APIError) -> bytes:
        return self._event(type="error", code=e.code, message=e.message, param=e.param)

    def body(self) -> dict:
        self._close()
        return self._response(self._status())


async def responses(state, request: Request) -> Response:
    body = await state.read_json(request)
    creq, echo = parse_request(body, state)
    state.check_model(echo["model"])
    gen = Generation.chat(state, creq, call_id_prefix="call_")
    return await state.respond(request, gen, lambda: ResponseView(state, gen, echo), echo["stream"])
