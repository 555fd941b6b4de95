"""The request policy: what the server does with what it does not know, and how much it accepts.

Clients evolve faster than this server, so the rule, for all three APIs, is:

* **An unknown field is ignored** and logged once per (API, field name) at warning level: at
  the top level, inside messages, content blocks, input items and tools (`ignore_unknown`).
* **Except where ignoring it would silently change what the client gets**: those fields are a
  400 naming them (`REFUSED`, the one list). They ask for state this server does not keep
  (`previous_response_id`, `conversation`, item references), for output it cannot give
  (`suffix`, audio), or for input it cannot read (images, audio, files).
* **Unknown types** follow the same split (`content_block_rule`, `input_item_rule`):

  | what | rendered | ignored (logged) | refused (400) |
  |---|---|---|---|
  | Anthropic blocks | text, tool_use, tool_result, thinking, document with a text source, search_result (its text) | redacted_thinking, server_tool_use, *_tool_result of server tools, any unknown type | image, document of another source |
  | Responses items | message, function_call(_output), custom_tool_call(_output), reasoning | web_search_call, file_search_call, local_shell_call, compaction, tool_search_*, additional_tools, any unknown type | item_reference |
  | content parts | text, input_text, output_text, refusal | any unknown type | image, audio, file parts |

* **Tools the server cannot run** (OpenAI's hosted tools, Anthropic's server tools: every tool
  type but a client-run function/custom one) are left out of the prompt, with a warning;
  never a 400 (`HOSTED_TOOL`). A `tool_choice` that names such a tool falls back to "auto".

Bounds (`LIMITS`): everything a client sends is bounded before it costs anything; each bound
sits well above what Claude Code and Codex send. Their checks raise 400s naming the field.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Iterable, Mapping

from .protocol import bad

log = logging.getLogger("ds4.serve")

# Fields refused with a 400 when set (to anything but a harmless value): ignoring them would
# silently change what the client gets. (api, field) -> why, or what to send instead: the 400 reads
# "'FIELD' is not supported: WHY".
REFUSED: dict[tuple[str, str], str] = {
    ("chat", "functions"): "the legacy function calling; use 'tools'",
    ("chat", "function_call"): "the legacy function calling; use 'tool_choice'",
    ("chat", "audio"): "this server writes text only",
    ("completions", "suffix"): "no insertion (fill in the middle)",
    ("responses", "previous_response_id"): "this server stores no responses; send the whole conversation in 'input'",
    ("responses", "conversation"): "this server stores no conversations; send the whole conversation in 'input'",
    ("responses", "prompt"): "this server stores no prompt templates",
    ("responses", "background"): "no background responses",
    ("responses", "top_logprobs"): "no logprobs on /v1/responses",
    ("responses", "n"): "one response per request",
    ("anthropic", "n"): "one message per request",
}


def _is_harmless(field: str, value: Any) -> bool:
    """A refused field's value that asks for nothing (the API's own default)."""
    if value is None or value is False:
        return True
    if field in ("suffix",) and value == "":
        return True
    if field in ("top_logprobs",) and value == 0:
        return True
    if field in ("n",) and value == 1:
        return True
    if field == "audio" and value == {}:
        return True
    return False


# Tool types a client runs itself; any other type is a hosted/server tool, left out of the prompt.
CLIENT_TOOL_TYPES = {"chat": {"function"}, "responses": {"function", "namespace", "custom"},
                     "anthropic": {"custom"}}

# Content parts and blocks that carry input this server cannot read: refused.
UNREADABLE_INPUT = {"image", "image_url", "input_image", "input_audio", "audio", "input_file", "file"}

LIMITS = {
    "stop_sequences": 64,            # stop / stop_sequences: count
    "stop_sequence_chars": 1024,     # and length of each
    "logit_bias_entries": 2048,
    "tools": 512,
    "tool_schema_bytes": 256 * 1024,  # one tool's JSON (name, description, schema)
    "tools_bytes": 4 * 2**20,         # all tools' JSON together
    "messages": 20_000,               # messages / input items
    "content_blocks": 20_000,         # blocks or parts of one message
    "array_items": 4 * 2**20,         # any array in the body (a prompt of token ids is one)
    "choices": 16,                    # n, best_of (so n x max_tokens <= 16 x the context)
}

_lock = threading.Lock()
_logged: set[tuple[str, str]] = set()


def forget_logged() -> None:
    """Log every ignored thing once more (what a new server process starts with; for tests)."""
    with _lock:
        _logged.clear()


def note_ignored(api: str, what: str, detail: str = "", level: int = logging.WARNING) -> None:
    """Log, once per (api, what), that something the client sent was ignored."""
    key = (api, what)
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    log.log(level, "%s: ignoring %s%s (logged once)", api, what, f": {detail}" if detail else "")


def ignore_unknown(api: str, obj: Mapping, known: Iterable[str], where: str = "") -> None:
    """Check `obj`'s keys against `known`: a refused one (`REFUSED`) set to anything that asks
    for something is a 400 naming it; any other unknown one is ignored and logged once."""
    known = known if isinstance(known, (set, frozenset)) else set(known)
    for key in obj:
        if key in known:
            continue
        reason = REFUSED.get((api, key)) if not where else None
        if reason is not None:
            if not _is_harmless(key, obj[key]):
                raise bad(f"'{key}' is not supported: {reason}", key, "unsupported_parameter")
            continue
        note_ignored(api, f"the unknown field '{where}{key}'")


def refuse_unreadable(kind: str, where: str) -> None:
    """400 for input this server cannot read (an image, audio, a file)."""
    raise bad(f"{where}: content of type {kind!r} is not supported (this model reads text only)", where,
              "unsupported_parameter")


def is_hosted_tool(api: str, tool: Any) -> bool:
    """A tool the server cannot run (OpenAI's hosted tools, Anthropic's server tools)."""
    if not isinstance(tool, dict):
        return False
    kind = tool.get("type", "custom" if api == "anthropic" else None)
    return isinstance(kind, str) and kind not in CLIENT_TOOL_TYPES[api]


def drop_hosted_tools(api: str, tools: list, where: str = "tools") -> list:
    """`tools` without the ones the server cannot run, each logged once."""
    kept = []
    for t in tools:
        if is_hosted_tool(api, t):
            note_ignored(api, f"the {t['type']!r} tool", "this server cannot run it; left out of the prompt")
        else:
            kept.append(t)
    return kept


def check_count(value: list, limit_name: str, param: str) -> None:
    limit = LIMITS[limit_name]
    if len(value) > limit:
        raise bad(f"'{param}' holds {len(value)} items; this server takes at most {limit}", param)


def check_tools_size(tools: list, param: str = "tools") -> None:
    """The number of tools and the size of their JSON, before any tool is compiled or rendered."""
    check_count(tools, "tools", param)
    total = 0
    for i, t in enumerate(tools):
        size = len(json.dumps(t, ensure_ascii=False))
        if size > LIMITS["tool_schema_bytes"]:
            raise bad(f"'{param}[{i}]' is {size} bytes of JSON; this server takes at most "
                      f"{LIMITS['tool_schema_bytes']} per tool", f"{param}[{i}]")
        total += size
    if total > LIMITS["tools_bytes"]:
        raise bad(f"'{param}' is {total} bytes of JSON; this server takes at most {LIMITS['tools_bytes']}", param)


def parse_stop(body: Mapping, name: str = "stop") -> list[str]:
    """Stop sequences: a string or an array of strings, bounded in count and length."""
    v = body.get(name)
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad(f"'{name}' must be a string or an array of strings", name, "invalid_type")
    check_count(stops, "stop_sequences", name)
    if any(s == "" for s in stops):
        raise bad(f"'{name}' sequences must not be empty", name)
    longest = max(map(len, stops), default=0)
    if longest > LIMITS["stop_sequence_chars"]:
        raise bad(f"'{name}' holds a sequence of {longest} characters; this server takes at most "
                  f"{LIMITS['stop_sequence_chars']}", name)
    return stops
