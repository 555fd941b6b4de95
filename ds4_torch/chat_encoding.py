"""DeepSeek-V4 chat encoding: OpenAI-style messages, tools and options -> prompt text.

DeepSeek-V4 defines its chat format with a Python encoder shipped in the checkpoint
(``encoding/encoding_dsv4.py`` in ``deepseek-ai/DeepSeek-V4-Flash`` / ``-Pro``), not with a
Jinja template. This module renders the same text from our own code. The facts it follows:

* ``<｜begin▁of▁sentence｜>`` then the system prompt (no marker of its own), then turns:
  ``<｜User｜>{user}`` and, after each user turn that an assistant answers (or that ends the
  conversation), ``<｜Assistant｜>`` plus ``<think>`` (thinking mode) or ``</think>`` (chat
  mode). An assistant turn is ``{reasoning}</think>{content}{tool calls}<｜end▁of▁sentence｜>``;
  the reasoning part exists only in thinking mode.
* Earlier turns' reasoning is dropped: in thinking mode, assistant turns before the last user
  turn render without reasoning and their user turn ends in ``</think>`` instead of
  ``<think>``. When tools are given, nothing is dropped (the official encoder turns
  ``drop_thinking`` off whenever a message carries tools), so an agent loop's prompt only grows.
* Tools: the system prompt gets a blank line and a fixed "## Tools" section listing each
  function schema as one line of JSON (``json.dumps(..., ensure_ascii=False)``). With no system
  message the section follows BOS directly (what vLLM and SGLang do: they insert an empty system
  message to carry the tools).
* Tool calls are DSML, after a blank line::

      <｜DSML｜tool_calls>
      <｜DSML｜invoke name="f">
      <｜DSML｜parameter name="p" string="true">text</｜DSML｜parameter>
      <｜DSML｜parameter name="n" string="false">42</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls>

  A string argument is written as is with ``string="true"``; any other value as
  ``json.dumps(value, ensure_ascii=False)`` with ``string="false"``, in the arguments' key order.
* Tool results (role ``tool``) join a user turn as ``<tool_result>{content}</tool_result>``;
  consecutive results and a following user message share one ``<｜User｜>`` turn, their blocks
  separated by a blank line, the results ordered like the calls of the assistant turn before
  them (by ``tool_call_id``).
* ``reasoning_effort`` (thinking mode only) prefixes the whole prompt, right after BOS, with a
  fixed instruction. Two tables exist: the first V4 release knows ``high``/``max`` and only
  ``max`` adds the text; the 0731 refresh knows ``low``/``high``/``max``, ``high`` adds the former
  ``max`` text and ``max`` a stronger one (see ``REASONING_EFFORT_PROMPTS``).
* The official format has no ``tool_choice`` instruction: "none"/"required"/a named tool are
  the server's to enforce (e.g. by not offering tools, or by constraining/validating output).

Exact replay: whatever the model sampled after the generation prompt renders back to the same
text when the client returns it as an assistant message (``render_assistant_completion``),
given the format's canonical layout: a tool call's arguments (a JSON object, as a string or a
dict) become DSML parameters in key order, strings with ``string="true"`` and everything else
re-serialised with ``json.dumps(v, ensure_ascii=False)`` (so ``{"n": 1.5, "o": {"k": [1, 2]}}``
renders ``1.5`` and ``{"k": [1, 2]}``, exactly as the model was trained to write them).

System messages anywhere. The leading system messages fill the system slot after BOS. A system
message after the conversation started (Claude Code sends them mid-conversation, Responses
clients send ``developer`` items) has no slot of its own in the format: the official encoder
writes its text bare where it stands, which glues it to the turn before (``...</think>hi<EOS>Be
brief.<｜User｜>``) and, after the last user message, leaves no generation prompt at all. Here it
joins the user turn it stands in as one more block (a blank line apart), or opens one, exactly
as the official encoder renders its own mid-conversation instruction role (``developer``: a
``<｜User｜>`` turn); so ``[user "hi", system "Be brief."]`` renders
``<｜User｜>hi\n\nBe brief.<｜Assistant｜>``. vLLM and SGLang pass the messages to the official
encoder unchanged.

Deliberate differences from the official encoder: several leading system messages are joined
with a blank line (the official one concatenates them with nothing between), a later system
message is a user-turn block (above), and input it would render into a garbled prompt is
rejected with ValueError: an assistant message not answering a user/tool turn. DeepSeek-internal
roles (``developer``, ``latest_reminder``) and quick-instruction tasks are not supported.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

DSML = "｜DSML｜"
TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAMETER_OPEN = f"<{DSML}parameter"
PARAMETER_CLOSE = f"</{DSML}parameter>"
# The blank line between an assistant's text and its tool-call block.
TOOL_CALLS_SEPARATOR = "\n\n"
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"
# Between the blocks (text, tool results) of one user turn.
USER_BLOCK_SEPARATOR = "\n\n"

ROLES = ("system", "user", "assistant", "tool")

# The prompt texts below are data the model was trained on: they must match byte for byte.
_TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{TOOL_CALLS_OPEN}" block like the following:

{TOOL_CALLS_OPEN}
{INVOKE_OPEN} name="$TOOL_NAME">
{PARAMETER_OPEN} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_CLOSE}
...
{INVOKE_CLOSE}
{INVOKE_OPEN} name="$TOOL_NAME2">
...
{INVOKE_CLOSE}
{TOOL_CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

_RESPONSE_FORMAT_SECTION = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)

_EFFORT_ABSOLUTE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
_EFFORT_BEYOND = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every causal "
    "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles "
    "and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
# Per encoder generation: effort level -> text put right after BOS in thinking mode.
# "v4": the first V4-Flash/Pro release; "v4-0731": the 0731 refresh, whose levels moved down one.
REASONING_EFFORT_PROMPTS: dict[str, dict[str, str]] = {
    "v4": {"low": "", "high": "", "max": _EFFORT_ABSOLUTE},
    "v4-0731": {"low": "", "high": _EFFORT_ABSOLUTE, "max": _EFFORT_BEYOND},
}
DEFAULT_EFFORT_PROFILE = "v4"


def to_json(value: Any) -> str:
    """JSON as the format writes it: Python's default separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


# --------------------------------------------------------------------------- input validation
@dataclass(frozen=True)
class ToolCallInput:
    """One tool call of an assistant message, validated."""

    name: str
    arguments: dict
    id: str | None = None


@dataclass(frozen=True)
class Message:
    """One validated message; ``content`` already flattened to text."""

    role: str
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCallInput, ...] = ()
    tool_call_id: str | None = None


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _text_content(value: Any, where: str, joiner: str, allow_none: bool) -> str:
    if isinstance(value, str):
        return value
    if value is None and allow_none:
        return ""
    if isinstance(value, (list, tuple)):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}")
            texts.append(part["text"])
        return joiner.join(texts)
    raise ValueError(f"{where} must be a string or a list of text parts, got {_type_name(value)}")


def _arguments(value: Any, where: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{where} is not valid JSON") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {_type_name(value)}")
    return dict(value)


def _tool_calls(value: Any, where: str) -> tuple[ToolCallInput, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where} must be a list, got {_type_name(value)}")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, Mapping):
            raise ValueError(f"{at} must be an object, got {_type_name(call)}")
        if call.get("type", "function") != "function":
            raise ValueError(f"{at}.type must be \"function\", got {call.get('type')!r}")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{at}.function must be an object, got {_type_name(fn)}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{at}.function.name must be a non-empty string")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise ValueError(f"{at}.id must be a string, got {_type_name(call_id)}")
        calls.append(ToolCallInput(name, _arguments(fn.get("arguments", {}), f"{at}.function.arguments"), call_id))
    return tuple(calls)


def _reasoning(m: Mapping, where: str) -> str | None:
    # OpenAI-compatible servers spell it reasoning_content (DeepSeek's API) or reasoning (vLLM).
    values = {k: m[k] for k in ("reasoning_content", "reasoning") if m.get(k) is not None}
    for k, v in values.items():
        if not isinstance(v, str):
            raise ValueError(f"{where}.{k} must be a string, got {_type_name(v)}")
    if len(set(values.values())) > 1:
        raise ValueError(f"{where}: reasoning_content and reasoning differ; send one")
    return next(iter(values.values()), None)


def normalize_messages(messages: Any) -> list[Message]:
    """Validate OpenAI-style chat messages; raise ValueError naming the offending field."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[Message] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where} must be a dict with 'role' and 'content', got {_type_name(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
        if role != "assistant" and m.get("tool_calls") is not None:
            raise ValueError(f"{where}.tool_calls: only assistant messages carry tool calls")
        # Tool results with several text parts keep them apart, as the official encoder does.
        content = _text_content(m.get("content"), f"{where}.content", "\n\n" if role == "tool" else "",
                                allow_none=role == "assistant")
        call_id = m.get("tool_call_id")
        if role == "tool" and call_id is not None and not isinstance(call_id, str):
            raise ValueError(f"{where}.tool_call_id must be a string, got {_type_name(call_id)}")
        out.append(Message(
            role=role, content=content,
            reasoning=_reasoning(m, where) if role == "assistant" else None,
            tool_calls=_tool_calls(m.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else (),
            tool_call_id=call_id if role == "tool" else None,
        ))
    return out


def normalize_tools(tools: Any) -> list[dict]:
    """Validate OpenAI-style tools ``[{"type": "function", "function": {...}}]``; return the
    function objects, unchanged, in order."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list, got {_type_name(tools)}")
    out = []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, Mapping):
            raise ValueError(f"{where} must be an object, got {_type_name(tool)}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be \"function\", got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{where}.function must be an object, got {_type_name(fn)}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}.function.name must be a non-empty string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise ValueError(f"{where}.function.parameters must be an object, got {_type_name(fn['parameters'])}")
        out.append(dict(fn))
    return out


def reasoning_effort_prompt(reasoning_effort: str | None, profile: str = DEFAULT_EFFORT_PROFILE) -> str:
    """The text a thinking-mode prompt starts with for this effort level ("" for none)."""
    if profile not in REASONING_EFFORT_PROMPTS:
        raise ValueError(f"effort profile must be one of {', '.join(REASONING_EFFORT_PROMPTS)}; got {profile!r}")
    table = REASONING_EFFORT_PROMPTS[profile]
    if reasoning_effort is None:
        return ""
    if reasoning_effort not in table:
        raise ValueError(f"reasoning_effort must be one of {', '.join(table)}; got {reasoning_effort!r}")
    return table[reasoning_effort]


def detect_effort_profile(encoder_source: str) -> str:
    """Which ``REASONING_EFFORT_PROMPTS`` table a checkpoint's ``encoding_dsv4.py`` uses, read as
    text (never executed): the 0731 encoder defines a prompt table with a "low" level."""
    table = re.search(r"^REASONING_EFFORT_PROMPTS\b[^=]*=\s*\{(.*?)^\}", encoder_source, re.M | re.S)
    if table and re.search(r"""^\s*["']low["']\s*:""", table.group(1), re.M):
        return "v4-0731"
    return "v4"


# --------------------------------------------------------------------------- rendering
def render_tools_section(tools: Any) -> str:
    """The "## Tools" section the system prompt gets (ends with a newline)."""
    return _tools_section(normalize_tools(tools))


def _tools_section(functions: Sequence[Mapping]) -> str:
    return _TOOLS_SECTION.format(schemas="\n".join(to_json(f) for f in functions))


def render_invoke(name: str, arguments: Mapping[str, Any]) -> str:
    """One ``<｜DSML｜invoke>`` element: strings as is with string="true", other values as JSON."""
    params = []
    for key, value in arguments.items():
        is_str = isinstance(value, str)
        text = value if is_str else to_json(value)
        params.append(f'{PARAMETER_OPEN} name="{key}" string="{"true" if is_str else "false"}">{text}{PARAMETER_CLOSE}')
    return f'{INVOKE_OPEN} name="{name}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}"


def render_tool_calls(calls: Sequence[ToolCallInput]) -> str:
    """The ``<｜DSML｜tool_calls>`` block (without the blank line before it)."""
    invokes = "\n".join(render_invoke(c.name, c.arguments) for c in calls)
    return f"{TOOL_CALLS_OPEN}\n{invokes}\n{TOOL_CALLS_CLOSE}"


def _assistant_body(m: Message, with_reasoning: bool) -> str:
    parts = [(m.reasoning or "") + THINK_END if with_reasoning else "", m.content]
    if m.tool_calls:
        parts += [TOOL_CALLS_SEPARATOR, render_tool_calls(m.tool_calls)]
    return "".join(parts)


def render_assistant_completion(message: Mapping, thinking: bool = False) -> str:
    """What the model generates for ``message`` after the generation prompt, without the final
    EOS: ``{reasoning}</think>`` (thinking mode), the content, then the tool-call block.

    This is the text of the latest assistant turn inside ``render_prompt``; comparing it with
    the sampled text tells whether a client that sends the turn back will hit the prefix cache.
    """
    (m,) = normalize_messages([message])
    if m.role != "assistant":
        raise ValueError(f"messages[0].role must be assistant; got {m.role!r}")
    return _assistant_body(m, thinking)


@dataclass
class _Turn:
    role: str  # "user" (user text and tool results) or "assistant"
    blocks: list  # user: [(tool_call_id or None, text, is_tool_result)]
    message: Message | None = None


def _turns(msgs: Sequence[Message], offset: int) -> list[_Turn]:
    turns: list[_Turn] = []
    call_order: dict[str, int] = {}  # tool_call_id -> position in the latest assistant's calls
    for i, m in enumerate(msgs, start=offset):
        if m.role == "assistant":
            if not turns or turns[-1].role != "user":
                raise ValueError(f"messages[{i}]: an assistant message must follow a user or tool message")
            turns.append(_Turn("assistant", [], m))
            if m.tool_calls:
                call_order = {c.id: k for k, c in enumerate(m.tool_calls) if c.id}
            continue
        if not turns or turns[-1].role != "user":
            turns.append(_Turn("user", []))
        # A system message after the conversation started is a block of the user turn it stands
        # in (see the module docstring), like the official encoder's mid-conversation instructions.
        if m.role == "tool":
            turns[-1].blocks.append((m.tool_call_id, f"{TOOL_RESULT_OPEN}{m.content}{TOOL_RESULT_CLOSE}", True))
        else:
            turns[-1].blocks.append((None, m.content, False))
        _order_tool_results(turns[-1].blocks, call_order)
    return turns


def _order_tool_results(blocks: list, call_order: Mapping[str, int]) -> None:
    # Results take the order of the calls they answer; text blocks keep their places and a
    # result whose id is unknown sorts as if it answered the first call (as the official code).
    slots = [k for k, b in enumerate(blocks) if b[2]]
    ordered = sorted((blocks[k] for k in slots), key=lambda b: call_order.get(b[0] or "", 0))
    for k, b in zip(slots, ordered):
        blocks[k] = b


@dataclass(frozen=True)
class PromptPart:
    """A piece of a rendered prompt. ``message`` is set on the body of an assistant turn (what the
    model sampled after its generation prompt, without the EOS that follows): the text a server
    may swap for the token ids it recorded when it generated that turn (exact replay)."""

    text: str
    message: Message | None = None
    with_reasoning: bool = False


def render_prompt(
    messages: Sequence[Mapping],
    *,
    tools: Sequence[Mapping] | None = None,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
    response_format: Mapping | None = None,
    effort_profile: str = DEFAULT_EFFORT_PROFILE,
) -> str:
    """Render a conversation in DeepSeek-V4's format (see the module docstring).

    ``thinking`` selects thinking mode (the prompt ends with ``<think>``) or chat mode
    (``</think>``). ``reasoning_effort`` ("low", "high", "max") only acts in thinking mode.
    ``drop_thinking=False`` keeps earlier turns' reasoning (the official encoder's option).
    ``add_generation_prompt=False`` leaves out the ``<｜Assistant｜>`` + think marker a
    conversation ending in a user/tool turn would otherwise end with. A conversation ending in
    an assistant turn renders that turn complete, with its EOS.
    """
    return "".join(part.text for part in render_prompt_parts(
        messages, tools=tools, thinking=thinking, reasoning_effort=reasoning_effort,
        add_generation_prompt=add_generation_prompt, drop_thinking=drop_thinking, response_format=response_format,
        effort_profile=effort_profile))


def render_prompt_parts(
    messages: Sequence[Mapping],
    *,
    tools: Sequence[Mapping] | None = None,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
    response_format: Mapping | None = None,
    effort_profile: str = DEFAULT_EFFORT_PROFILE,
) -> list[PromptPart]:
    """``render_prompt`` as parts whose texts join to it, each assistant turn's body apart."""
    msgs = normalize_messages(messages)
    functions = normalize_tools(tools)
    effort = reasoning_effort_prompt(reasoning_effort, effort_profile)
    if response_format is not None and not isinstance(response_format, Mapping):
        raise ValueError(f"response_format must be an object, got {_type_name(response_format)}")

    n_system = next((i for i, m in enumerate(msgs) if m.role != "system"), len(msgs))
    turns = _turns(msgs[n_system:], n_system)
    drop = thinking and drop_thinking and not functions
    last_user = max((i for i, t in enumerate(turns) if t.role == "user"), default=-1)

    out = [BOS, effort if thinking else "", "\n\n".join(m.content for m in msgs[:n_system])]
    if functions:
        out += ["\n\n", _tools_section(functions)]
    if response_format is not None:
        out += ["\n\n", _RESPONSE_FORMAT_SECTION.format(schema=to_json(response_format))]
    parts: list[PromptPart] = []
    for i, turn in enumerate(turns):
        if turn.role == "assistant":
            with_reasoning = thinking and (not drop or i > last_user)
            parts += [PromptPart("".join(out)),
                      PromptPart(_assistant_body(turn.message, with_reasoning), turn.message, with_reasoning)]
            out = [EOS]
            continue
        out += [USER, USER_BLOCK_SEPARATOR.join(b[1] for b in turn.blocks)]
        if i + 1 < len(turns) or add_generation_prompt:
            # Thinking opens only where reasoning will be kept: the latest turn, or all if none drop.
            out += [ASSISTANT, THINK_START if thinking and (not drop or i >= last_user) else THINK_END]
    parts.append(PromptPart("".join(out)))
    return [p for p in parts if p.text or p.message is not None]
