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
message after the conversation started joins the conversation as a user message (the encoding
has no later system slot).

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
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ds4_torch.sampling import SamplingParams

from .chat import Call, ChatRequest, Done, Generation, Text, json_grammar, strict_tool_grammar
from .openai_api import parse_effort, parse_tool_choice
from .protocol import (APIError, bad, check_unknown, get_bool, get_list, get_number, get_object, get_str, type_name)

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "reasoning", "max_output_tokens", "temperature",
          "top_p", "stream", "include", "text", "truncation", "previous_response_id", "conversation", "background",
          "top_logprobs", "stream_options", "max_tool_calls"}
IGNORED = {"store", "metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier", "parallel_tool_calls"}
ENCRYPTED_PREFIX = "ds4-reasoning:"  # our encrypted_content: the reasoning text, base64


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
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type_name(part)
            raise bad(f"{where}[{j}]: content parts of type {kind!r} are not supported (only {', '.join(kinds)})",
                      f"{where}[{j}]", "unsupported_parameter")
        texts.append(part["text"])
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


def _input(body: dict) -> list[dict]:
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
            started = any(m["role"] != "system" for m in messages)
            messages.append({"role": "user" if role == "user" or started else "system", "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad(f"{where}.{key} must be a string", f"{where}.{key}", "invalid_type")
            turn().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{where}.call_id must be a string", f"{where}.call_id", "invalid_type")
            assistant = None
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _parts_text(item.get("output"), f"{where}.output", ("input_text", "text"))})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text is not None:
                m = turn()
                m["reasoning_content"] = m.get("reasoning_content", "") + text
        else:
            raise bad(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output, "
                      f"reasoning are; this server stores nothing, so item references cannot resolve)",
                      f"{where}.type", "unsupported_parameter")
    return messages


def _tools(body: dict) -> list[dict]:
    out = []
    for k, t in enumerate(get_list(body, "tools") or []):
        where = f"tools[{k}]"
        if not isinstance(t, dict):
            raise bad(f"{where} must be an object", where, "invalid_type")
        if t.get("type") != "function":
            raise bad(f"{where}.type {t.get('type')!r}: only function tools are supported", f"{where}.type",
                      "unsupported_parameter")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
        fn = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = get_str(t, "description", where=f"{where}.")
        params = get_object(t, "parameters", where=f"{where}.")
        if params is not None:
            fn["parameters"] = params
        if get_bool(t, "strict", False, where=f"{where}."):
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict):
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "function" and "function" not in tc:
        tc = {"type": "function", "function": {"name": tc.get("name")}}  # Responses spells it flat
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
    check_unknown(fmt, fields, where="text.format.")
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
    check_unknown(body, FIELDS, IGNORED)
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise bad(f"'{name}' is not supported: this server stores no responses; send the whole conversation "
                      f"in 'input'", name, "unsupported_parameter")
    if get_bool(body, "background", False):
        raise bad("'background' is not supported", "background", "unsupported_parameter")
    if get_number(body, "top_logprobs", 0, integer=True):
        raise bad("'top_logprobs' is not supported", "top_logprobs", "unsupported_parameter")
    text = get_object(body, "text") or {}
    check_unknown(text, {"format", "verbosity"}, where="text.")
    fmt = get_object(text, "format", where="text.")
    grammar = parse_text_format(state, fmt)
    reasoning = get_object(body, "reasoning") or {}
    effort = parse_effort(reasoning.get("effort"), "reasoning.effort")
    include = get_list(body, "include") or []
    model = get_str(body, "model")
    sampling = SamplingParams(temperature=float(get_number(body, "temperature", 1.0, lo=0.0, hi=2.0)),
                              top_p=float(get_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)))
    creq = ChatRequest(messages=_input(body), tools=_tools(body), tool_choice=_tool_choice(body),
                       thinking=effort is not None, reasoning_effort=effort, sampling=sampling,
                       max_tokens=get_number(body, "max_output_tokens", None, lo=1, integer=True),
                       messages_param="input", max_tokens_param="max_output_tokens", grammar=grammar,
                       tool_params_path="tools[{i}].parameters")
    creq.grammar = strict_tool_grammar(state, creq)  # strict tools: a forced call, or auto's text-or-calls
    echo = {"model": model, "instructions": body.get("instructions"), "stream": get_bool(body, "stream", False),
            "encrypted": "reasoning.encrypted_content" in include, "reasoning": reasoning,
            "max_output_tokens": body.get("max_output_tokens"), "tools": get_list(body, "tools") or [],
            "tool_choice": body.get("tool_choice", "auto"), "temperature": sampling.temperature,
            "top_p": sampling.top_p, "metadata": body.get("metadata") or {},
            "text_format": fmt or {"type": "text"}}
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
                "output": self.items if done else [], "parallel_tool_calls": True, "previous_response_id": None,
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
                item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": ev.id,
                        "name": ev.name, "arguments": "", "status": "in_progress"}
                self.items.append(item)
                index = self._index()
                out.append(self._event(type="response.output_item.added", output_index=index, item=dict(item)))
                item["arguments"] = ev.arguments
                out.append(self._event(type="response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=index, delta=ev.arguments))
                out.append(self._event(type="response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, name=ev.name, arguments=ev.arguments))
                item["status"] = "completed"
                out.append(self._event(type="response.output_item.done", output_index=index, item=item))
            elif isinstance(ev, Done):
                out.append(self._close())
                status = self._status()
                out.append(self._event(type=f"response.{status}", response=self._response(status)))
        return b"".join(out)

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
