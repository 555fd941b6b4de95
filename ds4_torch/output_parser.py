"""Splitting DeepSeek-V4 output into reasoning, content and DSML tool calls, streamed or whole.

``StreamingOutputParser`` takes text pieces as they are sampled (split anywhere, including
inside a marker) and returns events:

* ``ReasoningDelta(text)``: reasoning text. In thinking mode the prompt ends with ``<think>``,
  so output starts inside reasoning and ``</think>`` ends it. In chat mode a ``<think>`` at
  the very start of the output opens reasoning too.
* ``ContentDelta(text)``: answer text. A delta never holds a piece of a marker: a tail that
  could still become ``</think>``, ``<｜DSML｜tool_calls>`` (with the blank line before it) or
  ``<｜end▁of▁sentence｜>`` is held back until it is decided.
* ``ToolCall(index, name, arguments, raw, problems)``: one complete call, emitted when its
  ``</｜DSML｜tool_calls>`` block closes. ``arguments`` is a JSON object text: string="true"
  parameters as strings, string="false" ones parsed as JSON. ``raw`` is the ``<｜DSML｜invoke>``
  element exactly as sampled. ``problems`` lists schema violations (when tools were given) and
  values that claimed string="false" without being JSON (kept as strings).
* ``ParseWarning(message)``: something did not follow the format (also logged).

* ``MarkupDropped(kind, text)``: markup that was removed from the text (below).

A block opening in reasoning (the model skipped ``</think>``) still yields its tool calls;
text after it is content. ``<｜end▁of▁sentence｜>`` ends the output; text after it is ignored
with a warning.

Nothing but text reaches text: markup the model emits out of place never appears in a
``ReasoningDelta`` or ``ContentDelta`` (`MarkupFilter`): ``<think>``/``</think>`` where they do
not belong, DeepSeek's special tokens (``<｜...｜>``: BOS, the role markers), DSML tags outside a
complete call block (an orphan ``</｜DSML｜parameter>``), tool-result tags. Each is dropped and
reported as ``MarkupDropped``. A call block that does not parse is dropped whole, up to its
``</｜DSML｜tool_calls>`` (or the end of the output), reported as ``MarkupDropped("block", raw)``
with a warning; nothing is raised.

``parse_output(text)`` is the same parser fed once, so streaming and whole parsing agree.
``ParsedOutput.replays_exactly`` says whether ``chat_encoding.render_assistant_completion`` of
``to_message()`` reproduces the sampled text (then a client sending the turn back hits the
prefix cache); it is False when the model strayed from the canonical layout.

The layout accepted inside a block is lenient about whitespace between elements and accepts two
shapes seen from V4 besides the canonical one: a self-closing ``<｜DSML｜invoke name="f"/>``
for a call without arguments, and an invoke whose body is one JSON object.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

from .chat_encoding import (
    DSML, EOS, INVOKE_CLOSE, INVOKE_OPEN, PARAMETER_CLOSE, PARAMETER_OPEN, THINK_END, THINK_START,
    TOOL_CALLS_CLOSE, TOOL_CALLS_OPEN, TOOL_CALLS_SEPARATOR, TOOL_RESULT_CLOSE, TOOL_RESULT_OPEN, normalize_tools,
    render_assistant_completion,
)
from .json_schema import validate_json_schema

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    index: int
    name: str
    arguments: str  # a JSON object, json.dumps(..., ensure_ascii=False)
    raw: str  # the <｜DSML｜invoke> element as sampled
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParseWarning:
    message: str


@dataclass(frozen=True)
class MarkupDropped:
    kind: str   # "token" (a special token or tag out of place) or "block" (a call block that does not parse)
    text: str   # what was dropped, as sampled


Event = Union[ReasoningDelta, ContentDelta, ToolCall, ParseWarning, MarkupDropped]


# --------------------------------------------------------------------------- markup out of place
_FIXED_TAGS = (THINK_START, THINK_END, TOOL_RESULT_OPEN, TOOL_RESULT_CLOSE)
_SPECIAL_OPEN = "<｜"                 # DeepSeek's special tokens: <｜...｜>
_SPECIAL_CLOSE = "｜>"
_DSML_OPENS = ("<" + DSML, "</" + DSML)   # a DSML tag runs to its ">"
_MAX_SPECIAL = 64                     # longer than this between <｜ and ｜> is prose
_MAX_DSML_TAG = 512                   # a DSML tag with its attributes
_TAG_STARTS = _FIXED_TAGS + (_SPECIAL_OPEN,) + _DSML_OPENS
_DSML_NAME = re.compile(r"[a-z_]*")


class MarkupFilter:
    """Removes markup from streamed text: the fixed tags (think, tool-result), special tokens
    (``<｜...｜>``) and DSML tags (``<｜DSML｜...>`` up to their ``>``). A tail that may still become
    one is held back until it is decided; `dropped` collects what was removed."""

    def __init__(self):
        self._pending = ""
        self.dropped: list[str] = []

    def feed(self, text: str, final: bool = False) -> str:
        text = self._pending + text
        while True:  # again after a drop: the text around a dropped tag may join into another
            clean, self._pending, dropped = self._scan(text, final)
            self.dropped += dropped
            if not dropped:
                return clean
            text = clean + self._pending

    def _scan(self, text: str, final: bool) -> tuple[str, str, list[str]]:
        """(text without markup, an undecided tail held back, the markup dropped)."""
        out, dropped, i = [], [], 0
        while True:
            j = min((k for k in (text.find("<", i), text.find(DSML[0], i)) if k >= 0), default=-1)
            if j < 0:
                out.append(text[i:])
                return "".join(out), "", dropped
            out.append(text[i:j])
            end = self._tag_end(text, j, final) if text[j] == "<" else self._dsml_end(text, j, final)
            if end is None:
                return "".join(out), text[j:], dropped
            if end > j:
                dropped.append(text[j:end])
                i = end
            else:  # not markup: a plain character
                out.append(text[j])
                i = j + 1

    @staticmethod
    def _dsml_end(text: str, j: int, final: bool) -> int | None:
        """The end of a DSML marker (with its tag name) at `text[j]`, wherever it stands."""
        if text.startswith(DSML, j):
            return _DSML_NAME.match(text, j + len(DSML)).end()
        rest = text[j:]
        return None if not final and len(rest) < len(DSML) and DSML.startswith(rest) else j

    @staticmethod
    def _tag_end(text: str, j: int, final: bool) -> int | None:
        """Where the markup starting at `text[j]` ends; `j` when it is not markup; None while
        more text may decide it."""
        rest = text[j:j + _MAX_DSML_TAG + 8]
        for tag in _FIXED_TAGS:
            if rest.startswith(tag):
                return j + len(tag)
        for opener, closer, limit in ((_DSML_OPENS[0], ">", _MAX_DSML_TAG), (_DSML_OPENS[1], ">", _MAX_DSML_TAG),
                                      (_SPECIAL_OPEN, _SPECIAL_CLOSE, _MAX_SPECIAL)):
            if rest.startswith(opener):
                k = rest.find(closer, len(opener))
                if 0 <= k <= limit:
                    return j + k + len(closer)
                if k < 0 and len(rest) < limit and not final:
                    return None
                if opener in _DSML_OPENS:  # an unclosed DSML tag: still markup, up to its name
                    return _DSML_NAME.match(text, j + len(opener)).end()
                break  # too long to be a special token: prose
        else:
            if not final and any(t.startswith(rest) for t in _TAG_STARTS):
                return None
        return j


@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ended: bool = False  # the output ended with <｜end▁of▁sentence｜>
    replays_exactly: bool = False

    def to_message(self) -> dict:
        """The output as an OpenAI-style assistant message (what a client sends back)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls
            ]
        return message


# --------------------------------------------------------------------------- DSML block
class _NeedMore(Exception):
    """The block text ends before it can be decided. When it stopped searching for a
    ``terminator`` from ``search_from``, nothing changes until that terminator arrives."""

    def __init__(self, terminator: str | None = None, search_from: int = 0):
        super().__init__(terminator)
        self.terminator, self.search_from = terminator, search_from


class _Malformed(Exception):
    """The block text cannot be a DSML tool-call block."""


_MAX_NAME = 256  # a tool or parameter name longer than this is prose, not DSML


class _Cursor:
    def __init__(self, text: str, final: bool):
        self.text, self.pos, self.final = text, 0, final

    def _short(self, what: str, terminator: str | None = None):
        raise _Malformed(f"unterminated {what}") if self.final else _NeedMore(terminator, self.pos)

    def skip_ws(self, required: bool = False) -> None:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1
        if required and self.pos == start:
            if self.pos == len(self.text):
                self._short("tag")
            raise _Malformed(f"expected whitespace at {self.pos}")

    def choose(self, *literals: str) -> str:
        for lit in literals:
            if self.text.startswith(lit, self.pos):
                self.pos += len(lit)
                return lit
        rest = self.text[self.pos:self.pos + max(map(len, literals))]  # not the whole (long) block
        if any(lit.startswith(rest) for lit in literals):
            self._short("tag")
        # No excerpt of what followed: the message must not depend on how much text has arrived.
        raise _Malformed(f"expected {' or '.join(map(repr, literals))} at offset {self.pos}")

    def until(self, terminator: str, what: str, limit: int | None = None) -> str:
        end = self.text.find(terminator, self.pos)
        if end < 0 or (limit is not None and end - self.pos > limit):
            if limit is not None and len(self.text) - self.pos > limit:
                raise _Malformed(f"{what} longer than {limit} characters")
            self._short(what, terminator if limit is None else None)
        value, self.pos = self.text[self.pos:end], end + len(terminator)
        return value

    def attribute(self, name: str) -> str:
        self.skip_ws(required=True)
        self.choose(f'{name}="')
        return self.until('"', f"{name} attribute", _MAX_NAME)


@dataclass
class _Invoke:
    name: str
    arguments: dict
    raw: str
    problems: list[str]


def _reject_constant(text: str):
    raise ValueError(f"{text} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: json.loads would give inf, which no JSON can carry
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _loads(text: str):
    """Strict JSON: no NaN/Infinity, no number beyond float range; ValueError otherwise."""
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _parse_invoke(cur: _Cursor) -> _Invoke:
    start = cur.pos - len(INVOKE_OPEN)
    name = cur.attribute("name")
    if not name:
        raise _Malformed("empty tool name")
    cur.skip_ws()
    if cur.choose("/>", ">") == "/>":
        return _Invoke(name, {}, cur.text[start:cur.pos], [])
    cur.skip_ws()
    kind = cur.choose(INVOKE_CLOSE, PARAMETER_OPEN, "{")
    if kind == "{":  # the whole body is one JSON object
        body = "{" + cur.until(INVOKE_CLOSE, "invoke")
        try:
            arguments = _loads(body)
        except ValueError as e:
            raise _Malformed(f"invoke {name!r}: body is not a JSON object ({e})") from None
        if not isinstance(arguments, dict):
            raise _Malformed(f"invoke {name!r}: body is not a JSON object")
        return _Invoke(name, arguments, cur.text[start:cur.pos], [])
    arguments, problems = {}, []
    while kind == PARAMETER_OPEN:
        key = cur.attribute("name")
        flag = cur.attribute("string")
        if flag not in ("true", "false"):
            raise _Malformed(f"parameter {key!r}: string must be \"true\" or \"false\", got {flag!r}")
        cur.skip_ws()
        cur.choose(">")
        value = cur.until(PARAMETER_CLOSE, "parameter")
        if key in arguments:
            raise _Malformed(f"invoke {name!r}: parameter {key!r} given twice")
        if flag == "false":
            try:
                value = _loads(value)
            except ValueError:
                problems.append(f'parameter {key!r} has string="false" but is not JSON; kept as a string')
        arguments[key] = value
        cur.skip_ws()
        kind = cur.choose(INVOKE_CLOSE, PARAMETER_OPEN)
    return _Invoke(name, arguments, cur.text[start:cur.pos], problems)


def _parse_block(text: str, final: bool) -> tuple[list[_Invoke], int]:
    """Parse a block starting at ``text[0]``; return its invokes and the index after it."""
    cur = _Cursor(text, final)
    cur.choose(TOOL_CALLS_OPEN)
    invokes = []
    while True:
        cur.skip_ws()
        if cur.choose(TOOL_CALLS_CLOSE, INVOKE_OPEN) == TOOL_CALLS_CLOSE:
            if not invokes:
                raise _Malformed("tool call block without an invoke")
            return invokes, cur.pos
        invokes.append(_parse_invoke(cur))


# --------------------------------------------------------------------------- streaming
_BLOCK_AFTER_BLANK = TOOL_CALLS_SEPARATOR + TOOL_CALLS_OPEN
_MARKERS = {
    "reasoning": (THINK_END, _BLOCK_AFTER_BLANK, TOOL_CALLS_OPEN, EOS),
    "content": (_BLOCK_AFTER_BLANK, TOOL_CALLS_OPEN, EOS),
}


def _first_marker(text: str, markers: Sequence[str]) -> tuple[int, str | None]:
    best, found = len(text), None
    for m in markers:
        pos = text.find(m)
        if 0 <= pos < best:
            best, found = pos, m
    return best, found


def _partial_marker_length(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that some marker starts with (shorter than it)."""
    best = 0
    for m in markers:
        # Only tails starting with the marker's first character can match; the earliest is longest.
        i = text.find(m[0], max(0, len(text) - len(m) + 1))
        while i >= 0 and not m.startswith(text[i:]):
            i = text.find(m[0], i + 1)
        if i >= 0:
            best = max(best, len(text) - i)
    return best


class StreamingOutputParser:
    """Feed sampled text with ``feed``; call ``finish`` once at the end; read ``result``."""

    def __init__(self, *, thinking: bool, tools: Sequence[Mapping] | None = None):
        self.thinking = thinking
        self._schemas = {f["name"]: f.get("parameters") for f in normalize_tools(tools)} if tools is not None else None
        self._state = "reasoning" if thinking else "start"
        self._pending = ""  # text not yet classified
        self._block_origin = ""  # channel a tool-call block opened in
        self._block_separator = ""  # the blank line consumed before it
        # Incremental scanning of an open block: the terminator it waits for and from where to
        # look, and how far it has been searched for EOS (long arguments arrive in many pieces).
        self._block_wait: tuple[str, int] | None = None
        self._eos_scanned = 0
        self._fed: list[str] = []
        self._finished = False
        self._ignoring = False  # text after EOS was seen
        self._filters = {"reasoning": MarkupFilter(), "content": MarkupFilter()}
        self.result = ParsedOutput()

    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now would be reasoning (counts reasoning tokens)."""
        return self._state == "reasoning"

    # -- events
    def _text(self, channel: str, text: str, out: list[Event], final: bool = True) -> None:
        """Emit `text` of `channel` without its markup; `final` False: its tail may continue."""
        f = self._filters[channel]
        text = f.feed(text, final=final)
        for dropped in f.dropped:
            out.append(MarkupDropped("token", dropped))
        f.dropped.clear()
        if not text:
            return
        if channel == "reasoning":
            self.result.reasoning += text
            out.append(ReasoningDelta(text))
        else:
            self.result.content += text
            out.append(ContentDelta(text))

    def _warn(self, message: str, out: list[Event]) -> None:
        log.warning("DeepSeek-V4 output: %s", message)
        self.result.warnings.append(message)
        out.append(ParseWarning(message))

    def _call(self, invoke: _Invoke) -> ToolCall:
        problems = list(invoke.problems)
        if self._schemas is not None:
            if invoke.name not in self._schemas:
                problems.append(f"unknown tool {invoke.name!r}")
            else:
                problems += validate_json_schema(invoke.arguments, self._schemas[invoke.name] or {}, "arguments")
        call = ToolCall(len(self.result.tool_calls), invoke.name, json.dumps(invoke.arguments, ensure_ascii=False),
                        invoke.raw, tuple(problems))
        self.result.tool_calls.append(call)
        return call

    # -- driving
    def feed(self, text: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._fed.append(text)
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        """Flush what was held back; after this ``result`` is complete."""
        if self._finished:
            return []
        out = self._drain(final=True)
        self._finished = True
        r = self.result
        sampled = "".join(self._fed)
        try:
            rendered = render_assistant_completion(r.to_message(), thinking=self.thinking)
        except ValueError:  # e.g. a tool name the renderer rejects
            rendered = None
        r.replays_exactly = rendered is not None and rendered + (EOS if r.ended else "") == sampled
        return out

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            state, pending = self._state, self._pending
            if state == "done":
                if pending and not self._ignoring:  # one warning, however the tail is split
                    self._warn(f"text after {EOS} ignored", out)
                    self._ignoring = True
                self._pending = ""
                return out
            if state == "start":  # chat mode: only a leading <think> opens reasoning
                if pending.startswith(THINK_START):
                    self._pending, self._state = pending[len(THINK_START):], "reasoning"
                elif THINK_START.startswith(pending) and not final:
                    return out
                else:
                    self._state = "content"
                continue
            if state == "block":
                if not self._step_block(final, out):
                    return out
                continue
            if state == "skip":
                if not self._skip_block(final, out):
                    return out
                continue
            markers = _MARKERS[state]
            pos, marker = _first_marker(pending, markers)
            if marker is None:
                keep = 0 if final else _partial_marker_length(pending, markers)
                self._text(state, pending[:len(pending) - keep], out, final=final)
                self._pending = pending[len(pending) - keep:]
                return out
            self._text(state, pending[:pos], out)
            rest = pending[pos + len(marker):]
            if marker == THINK_END:
                self._pending, self._state = rest, "content"
            elif marker == EOS:
                self._pending, self._state, self.result.ended = rest, "done", True
            else:
                self._block_origin, self._state = state, "block"
                self._block_wait, self._eos_scanned = None, 0
                self._block_separator = TOOL_CALLS_SEPARATOR if marker == _BLOCK_AFTER_BLANK else ""
                self._pending = TOOL_CALLS_OPEN + rest

    def _step_block(self, final: bool, out: list[Event]) -> bool:
        """Try to close the tool-call block in ``_pending``; False while it needs more text."""
        text = self._pending
        eos = text.find(EOS, max(0, self._eos_scanned - len(EOS) + 1))  # a block ends with the output
        self._eos_scanned = len(text)
        if eos >= 0:
            usable = eos
        else:
            # A tail that may still become EOS is not block text yet, or a stream split inside
            # EOS would be judged differently from the whole output.
            usable = len(text) if final else len(text) - _partial_marker_length(text, (EOS,))
        if self._block_wait and not final and eos < 0:
            # The text so far parsed up to a search for a terminator: only its arrival changes that.
            terminator, search_from = self._block_wait
            if text.find(terminator, search_from, usable) < 0:
                self._block_wait = terminator, max(search_from, usable - len(terminator) + 1)
                return False
        try:
            invokes, end = _parse_block(text[:usable], final=final or eos >= 0)
        except _NeedMore as wait:
            self._block_wait = (wait.terminator, wait.search_from) if wait.terminator else None
            return False
        except _Malformed as e:
            # Its markup must not reach the text. A block opened as the format opens one (after a
            # blank line) is dropped up to its close (or the end); an opener in the middle of a
            # line is prose naming it: the opener alone is dropped and the rest read again.
            if self._block_separator:
                self._warn(f"malformed DSML tool call block dropped: {e}", out)
                self._state = "skip"
            else:
                self._warn(f"DSML tool call opener outside a block dropped: {e}", out)
                out.append(MarkupDropped("token", TOOL_CALLS_OPEN))
                self._pending, self._state = text[len(TOOL_CALLS_OPEN):], self._block_origin
            return True
        if self._block_origin == "reasoning":
            self._warn(f"tool call block inside reasoning (no {THINK_END} before it)", out)
        out.extend(self._call(inv) for inv in invokes)
        self._pending, self._state = text[end:], "content"
        return True


    def _skip_block(self, final: bool, out: list[Event]) -> bool:
        """Drop a malformed block up to its ``</｜DSML｜tool_calls>``, EOS or the end of the output;
        False while neither has arrived."""
        text = self._pending
        close, eos = text.find(TOOL_CALLS_CLOSE), text.find(EOS)
        if close >= 0 and (eos < 0 or close < eos):
            end, state = close + len(TOOL_CALLS_CLOSE), "content"
        elif eos >= 0:
            end, state = eos, "content"  # the EOS itself ends the output in the content state
        elif final:
            end, state = len(text), "content"
        else:
            return False
        out.append(MarkupDropped("block", self._block_separator + text[:end]))
        self._pending, self._state = text[end:], state
        return True


def parse_output(text: str, *, thinking: bool, tools: Sequence[Mapping] | None = None) -> ParsedOutput:
    """Parse one whole generated output (the text after the generation prompt)."""
    parser = StreamingOutputParser(thinking=thinking, tools=tools)
    parser.feed(text)
    parser.finish()
    return parser.result
