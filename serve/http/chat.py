"""The API-agnostic core of one generation: an internal request in, an internal event stream out.

Every API module translates its JSON into a `ChatRequest` (OpenAI-style messages and tools, the
tool choice, thinking, sampling) or, for plain completions, prompt ids; `Generation` does the
rest, the same for all of them:

* the prompt: rendered with the DeepSeek-V4 encoding part by part, each assistant turn the
  server generated replaced by the token ids it sampled (`serve.http.replay`), so a conversation
  sent back reuses the engine's cache to its last token;
* the engine request(s), through `GenRequest` and its emitted events;
* the output parser: reasoning, content and whole tool calls, never a markup fragment; markup
  out of place, a call block that does not parse, a call to a tool that was not offered or
  with arguments its schema rejects are dropped from the text, logged with their raw text and
  counted (`ds4_markup_dropped_total`); a completion's raw text is kept free of special tokens
  and tags the same way;
* `tool_choice`: "none" renders no tools; "required" and a named function make the reply
  start with the DSML opener (and the function's name): in chat mode right after the
  generation prompt; in thinking mode once the reasoning ends (the engine stops at
  ``</think>`` and a second request continues with the opener appended), and a grammar writes
  the rest of the call (an offered tool's name, well-formed parameters);
* strict tools (`strict_tool_grammar`): a grammar keeps their calls to their schemas, forced
  or not (auto: the content is text, or text then a call block);
* no tools offered (none given, or tool_choice "none"): no DSML tag is sampled, the tool-call
  opener first (`no_calls_sampling`), reasoning included, whatever `logit_bias` says: a call
  the server would have to drop is never begun, so the model writes text instead;
* the finish: "end" (EOS), "stop_sequence", "length" or "tool_calls", and the usage.

Events: `Token` (one sampled token: logprobs, id), `Text` (reasoning or content), `Call`,
then one of `Done`, `Failed` (an `APIError`), `Cancelled`.
"""
from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import hashlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Union

from ds4_torch.chat_encoding import (
    DSML, INVOKE_CLOSE, INVOKE_OPEN, PARAMETER_CLOSE, PARAMETER_OPEN, THINK_END, TOOL_CALLS_CLOSE, TOOL_CALLS_OPEN,
    TOOL_CALLS_SEPARATOR, render_assistant_completion, render_prompt_parts, USER, ASSISTANT,
)
from ds4_torch.json_schema import validate_json_schema
from ds4_torch.output_parser import (ContentDelta, MarkupDropped, MarkupFilter, ReasoningDelta, StreamingOutputParser,
                                     ToolCall)
from ds4_torch.sampling import SamplingParams

from serve.engine.loop import EngineStopped, GenRequest, QueueFull, TokenOut
from .protocol import APIError, bad, check_fits, fit_context, value_error
from .replay import ReplayStore, signature

log = logging.getLogger("ds4.serve")


# --------------------------------------------------------------------------- the internal request
@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"            # auto | none | required | function
    name: str | None = None       # the function, for mode "function"


@dataclass
class ChatRequest:
    messages: list[dict]                          # OpenAI-style chat messages (chat_encoding's input)
    tools: list[dict] = field(default_factory=list)   # [{"type": "function", "function": {...}}]
    tool_choice: ToolChoice = ToolChoice()
    thinking: bool = False
    reasoning_effort: str | None = None           # chat_encoding's levels: low, high, max
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None                 # None: what the context leaves
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    ignore_eos: bool = False
    grammar: Any = None                           # a ds4_torch.structured.Grammar the content follows
    parallel_tool_calls: bool = True              # False: one call at most (a grammar, or later calls dropped)
    # Message counts after which the client marked a cache breakpoint (Anthropic's cache_control):
    # hints where to checkpoint, never needed (message starts are checkpointed anyway).
    cache_hints: tuple[int, ...] = ()
    # Field names of the API, for error messages.
    messages_param: str = "messages"
    max_tokens_param: str = "max_tokens"
    tool_choice_param: str = "tool_choice"
    tools_param: str = "tools"
    tool_params_path: str = "tools[{i}].function.parameters"   # a tool's parameter schema ({i}: its index)


# --------------------------------------------------------------------------- events
# `choice`: which generation of a `Choices` the event belongs to (0 for a single one).
@dataclass(frozen=True)
class Token:
    out: TokenOut
    choice: int = 0


@dataclass(frozen=True)
class PromptLogprobs:
    outs: list            # [TokenOut] of every prompt token (the first has no logprob)
    choice: int = 0


@dataclass(frozen=True)
class Text:
    channel: str          # "reasoning" | "content"
    text: str
    choice: int = 0


@dataclass(frozen=True)
class Call:
    index: int
    id: str
    name: str
    arguments: str        # a JSON object
    choice: int = 0


@dataclass(frozen=True)
class Done:
    finish: str                       # end | stop_sequence | length | tool_calls
    stop_sequence: str | None = None
    choice: int = 0


@dataclass(frozen=True)
class Failed:
    error: APIError


@dataclass(frozen=True)
class Cancelled:
    stage: str


Event = Union[Token, PromptLogprobs, Text, Call, Done, Failed, Cancelled]


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


# --------------------------------------------------------------------------- tenants
# Who sent the request being handled: set by `AppState.check_auth` when the server has several API
# keys (else None: one tenant). Prefix reuse and exact replay never cross tenants.
TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("ds4_tenant", default=None)


def tenant_of(api_key: str) -> str:
    """A key's tenant name: stable across restarts (replay records persist), not the key itself."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- the prompt
def message_boundaries(tokenizer, ids: list[int]) -> tuple[int, ...]:
    """Positions in `ids` where a message starts (right after a user marker, and right after an
    assistant marker and its think tag): where agents' conversations diverge (a new conversation
    after the system prompt, an edited user message, a regenerated reply), so the engine
    checkpoints there. Found on the ids, so replayed turns and client templates count alike."""
    markers = _markers(tokenizer)
    if markers is None:
        return ()
    user, assistant = markers
    out = []
    for i, t in enumerate(ids):
        if t == user:
            out.append(i + 1)
        elif t == assistant and i + 2 < len(ids):
            out.append(i + 2)
    return tuple(out)


MAX_CACHE_HINTS = 4  # as Anthropic allows: each costs encoding the prompt up to it
MAX_MESSAGE_CHECKPOINTS = 8  # message starts checkpointed per request besides the first


def hint_positions(tokenizer, creq: "ChatRequest", ids: list[int]) -> tuple[int, ...]:
    """Token positions of `creq.cache_hints`: the length of the prompt rendered up to each, less
    one (the text before a breakpoint may tokenize apart from the whole: its last token can merge
    with what follows, and a checkpoint past the shared prefix is of no use to the next request).
    A hint that cannot be placed is dropped: hints never fail a request."""
    if not creq.cache_hints or getattr(tokenizer, "chat_template", None) is not None:
        return ()
    msgs = creq.messages
    n_system = next((i for i, m in enumerate(msgs) if m.get("role") != "system"), len(msgs))
    out = set()
    for k in sorted(set(creq.cache_hints))[-MAX_CACHE_HINTS:]:
        if not 0 < k < len(msgs):
            continue
        try:  # tools are rendered after the whole system section: only a hint past it includes them
            parts = render_prompt_parts(msgs[:k], tools=_offered(creq) or None if k >= n_system else None,
                                        thinking=creq.thinking, reasoning_effort=creq.reasoning_effort,
                                        add_generation_prompt=False, effort_profile=tokenizer.effort_profile)
            n = len(tokenizer.encode("".join(p.text for p in parts), add_special_tokens=False))
        except Exception as e:  # noqa: BLE001 - a hint is worth nothing more than a log line
            log.debug("cache hint after message %d not placed: %s: %s", k, type(e).__name__, e)
            continue
        if 1 < n < len(ids):
            out.add(n - 1)
    return tuple(sorted(out))


def _markers(tokenizer) -> tuple[int, int] | None:
    cached = getattr(tokenizer, "_ds4_markers", False)
    if cached is False:
        user, assistant = (tokenizer.encode(m, add_special_tokens=False) for m in (USER, ASSISTANT))
        cached = (user[0], assistant[0]) if len(user) == 1 and len(assistant) == 1 else None
        try:
            tokenizer._ds4_markers = cached
        except AttributeError:  # a tokenizer that takes no attributes: found again next time
            pass
    return cached


def encode_conversation(tokenizer, replay: ReplayStore | None, messages, *, tools=None, thinking: bool = False,
                        reasoning_effort: str | None = None, tenant: str | None = None) -> list[int]:
    """Prompt ids of a conversation ending in a generation prompt. Assistant turns this server
    generated contribute the ids it sampled (see `serve.http.replay`); the rest is encoded as text. A
    tokenizer with its own chat template renders with it (no replay). ValueError on bad input."""
    if getattr(tokenizer, "chat_template", None) is not None:
        return tokenizer.encode_chat(messages, thinking=thinking, tools=tools or None,
                                     reasoning_effort=reasoning_effort)
    parts = render_prompt_parts(messages, tools=tools or None, thinking=thinking, reasoning_effort=reasoning_effort,
                                effort_profile=tokenizer.effort_profile)
    ids: list[int] = []
    text: list[str] = []
    for part in parts:
        turn = None
        if part.message is not None and replay is not None:
            m = part.message
            sig = signature(m.reasoning, m.content, [(c.name, c.arguments) for c in m.tool_calls], part.with_reasoning)
            call_ids = [c.id for c in m.tool_calls if c.id]
            if call_ids and len(call_ids) == len(m.tool_calls):
                turn = replay.by_calls(call_ids, sig, tenant)
            if turn is None:
                turn = replay.by_text(part.text, tenant)
        if turn is None:
            text.append(part.text)
            continue
        # Parts meet at special tokens (</think>, <think>, EOS), so encoding runs apart is encoding the whole.
        if text:
            ids += tokenizer.encode("".join(text), add_special_tokens=False)
            text = []
        ids += turn.ids
    if text:
        ids += tokenizer.encode("".join(text), add_special_tokens=False)
    return ids


def _forced_opener(choice: ToolChoice) -> str:
    """What a reply must start with (after any reasoning) to call a tool."""
    if choice.mode not in ("required", "function"):
        return ""
    opener = f'{TOOL_CALLS_SEPARATOR}{TOOL_CALLS_OPEN}\n{INVOKE_OPEN} name="'
    return opener + (f'{choice.name}">' if choice.mode == "function" else "")


def _check_tool_choice(creq: ChatRequest) -> dict[str, Any]:
    """The offered tools by name (their parameter schemas); 400 for a choice they cannot meet."""
    schemas = {}
    for t in creq.tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            schemas[fn["name"]] = fn.get("parameters") or {}
    choice = creq.tool_choice
    if choice.mode in ("required", "function") and not creq.tools:
        raise bad(f"'{creq.tool_choice_param}' asks for a tool call but no tools are given", creq.tool_choice_param)
    if choice.mode == "function" and choice.name not in schemas:
        raise bad(f"'{creq.tool_choice_param}' names the function {choice.name!r}, which is not among the tools",
                  creq.tool_choice_param)
    return schemas


def _offered(creq: ChatRequest) -> list[dict]:
    return [] if creq.tool_choice.mode == "none" else creq.tools  # "none": the model is offered no tools


def dsml_tokens(tokenizer) -> tuple[tuple[int, ...], bool]:
    """(every token whose text holds a DSML tag name (`｜DSML｜`: the tool-call block's tags, its
    invoke and parameter tags, open or closed), whether one of them holds the whole block opener
    `<｜DSML｜tool_calls>`). Found by decoding the vocabulary once per tokenizer (the server does
    it at start), so any token that spells a tag counts, not only the tokenizer's added ones. No
    token holds the opener when it takes several tokens (a byte tokenizer, a vocabulary without
    DSML tokens)."""
    cached = getattr(tokenizer, "_ds4_dsml_tokens", None)
    if cached is None:
        texts = {i: _token_text(tokenizer, i) for i in range(tokenizer.vocab_size)}
        ids = tuple(i for i, text in texts.items() if DSML in text)
        cached = ids, any(TOOL_CALLS_OPEN in texts[i] for i in ids)
        try:
            tokenizer._ds4_dsml_tokens = cached
        except AttributeError:  # a tokenizer that takes no attributes: found again next time
            pass
    return cached


def _token_text(tokenizer, token_id: int) -> str:
    try:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    except TypeError:
        return tokenizer.decode([token_id])


def no_calls_sampling(state, creq: ChatRequest) -> tuple[SamplingParams, list[str]]:
    """The sampling settings of a chat request, and the stop strings the server adds (not the
    client's). With no tools offered (none given, or tool_choice "none") a tool call could only be
    dropped, and any DSML tag is markup out of place, dropped too: the model must not begin
    either. The tokens that spell DSML tags, the block opener first, are forbidden
    (`SamplingParams.forbidden_token_ids`: masked like a grammar's, before `logit_bias`, in
    reasoning and content). A tokenizer with no token holding the opener (it takes several)
    stops the reply where the opener would begin instead. Off with `--free-tool-calls`."""
    if not state.config.tool_call_grammar or _offered(creq):
        return creq.sampling, []
    tags, opener_masked = dsml_tokens(state.tokenizer)
    sampling = creq.sampling
    if tags:
        sampling = dataclasses.replace(sampling, forbidden_token_ids=(*sampling.forbidden_token_ids, *tags))
    return sampling, [] if opener_masked else [TOOL_CALLS_OPEN]


def chat_prompt(state, creq: ChatRequest, counting: bool = False) -> list[int]:
    """The prompt ids of a chat request; 400 naming the messages when they cannot be rendered,
    or (unless only `counting` them) when their text alone cannot fit the context, which is known
    before it is rendered and encoded."""
    if not counting:
        chars = sum(len(m["content"]) for m in creq.messages if isinstance(m.get("content"), str))
        check_fits(chars // state.tokenizer.max_token_chars, state.config.ctx, creq.messages_param)
    try:
        return encode_conversation(state.tokenizer, state.replay, creq.messages, tools=_offered(creq),
                                   thinking=creq.thinking, reasoning_effort=creq.reasoning_effort,
                                   tenant=TENANT.get())
    except ValueError as e:
        raise bad(str(e), creq.messages_param) from None


# --------------------------------------------------------------------------- one generation
class Channel:
    """Events from the engine thread to the request's handler on the event loop. Channels may
    share their wake-up `event` (the choices of one response)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event | None = None):
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.event = event or asyncio.Event()

    def push(self, event: tuple) -> None:  # engine thread
        self.items.append(event)
        self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self, timeout: float) -> None:
        """Until something was pushed (to any channel sharing the event) or `timeout`; then the
        event is cleared, so drain after this: a push racing with us leaves the event set."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
        except asyncio.TimeoutError:  # a distinct class before Python 3.11, an alias after
            pass
        self.event.clear()

    def drain(self) -> list[tuple]:
        out = []
        while self.items:
            out.append(self.items.popleft())
        return out

    async def get(self, timeout: float) -> list[tuple]:
        if not self.items:
            await self.wait(timeout)
        else:
            self.event.clear()
        return self.drain()


def queue_requests(engine, reqs: list[GenRequest], continuation: bool = False) -> None:
    """Queue `reqs` in the engine together (or none); APIError 429 (queue full), 503 (stopped) or
    400 (a setting the model cannot serve, named). `continuation`: see `Engine.submit_all`."""
    try:
        engine.submit_all(reqs, continuation=continuation)
    except QueueFull as e:
        raise APIError(429, f"{e}; retry later", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except EngineStopped as e:
        raise APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "5"}) from None
    except ValueError as e:
        raise value_error(e) from None


class Generation:
    """One request through the engine: build with `chat(...)` or `completion(...)`, `submit()`,
    then `await next_events(timeout)` until a final event; `cancel()` when the client left."""

    def __init__(self, state, prompt_ids: list[int], max_tokens: int, *, sampling: SamplingParams, stop: list[str],
                 logprobs: int | None, ignore_eos: bool, parse: bool, thinking: bool = False,
                 schemas: dict | None = None, tool_choice: ToolChoice = ToolChoice(), call_id_prefix: str = "call_",
                 grammar=None, prompt_logprobs: int | None = None, after_trigger=None,
                 parallel_tool_calls: bool = True, server_stops: tuple[str, ...] = ()):
        self.state = state
        self.choice = 0                      # its index among the choices of a response
        self.grammar = grammar               # what the content (after any reasoning) follows
        self.after_trigger = after_trigger   # a tool-call block's grammar (offered_calls_grammar)
        self.parallel_tool_calls = parallel_tool_calls
        self.prompt_logprobs = prompt_logprobs
        self.tokenizer = state.tokenizer
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.sampling, self.stop, self.logprobs, self.ignore_eos = sampling, stop, logprobs, ignore_eos
        # Stop strings of the server's (no_calls_sampling), not the client's: one ends the reply as EOS would.
        self.server_stops = tuple(s for s in server_stops if s not in stop)
        self.thinking, self.schemas, self.tool_choice = thinking, schemas, tool_choice
        self.call_id_prefix = call_id_prefix
        self.tenant = TENANT.get()
        self.boundaries: tuple[int, ...] = ()   # where the prompt's messages start (chat requests)
        self.parser = StreamingOutputParser(thinking=thinking) if parse else None
        self.markup = MarkupFilter() if not parse else None   # a completion's raw text
        self.opener = _forced_opener(tool_choice) if parse else ""
        self.opener_ids: list[int] = []
        # In thinking mode a forced call or a grammar starts once the reasoning ends: a second phase.
        self.two_phase = thinking and bool(self.opener or grammar)
        self.reserved = 0                    # tokens phase 1 left for the content (see _reserve)
        self.channel: Channel | None = None
        self.requests: list[GenRequest] = []
        self.reply_text: list[str] = []      # every character fed to the parser
        self.reply_ids: list[int] = []       # the reply's tokens: forced ones and sampled ones
        self.calls: list[Call] = []
        self.returned_content: list[str] = []
        self.returned_reasoning: list[str] = []
        self.usage = Usage()
        self.done: Done | None = None
        self.markup_logged = False           # its first dropped markup was logged as a warning
        self._ended = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def chat(cls, state, creq: ChatRequest, call_id_prefix: str = "call_") -> "Generation":
        """Render and encode the conversation, check that it fits; APIError (400) on bad input."""
        return cls.chats(state, creq, 1, call_id_prefix)[0]

    @classmethod
    def chats(cls, state, creq: ChatRequest, n: int, call_id_prefix: str = "call_") -> list["Generation"]:
        """`n` choices of one chat request (the prompt encoded once; choice i samples with
        `SamplingParams.for_choice(i)`)."""
        schemas = _check_tool_choice(creq)
        ids = chat_prompt(state, creq)
        tools = _offered(creq)
        starts = message_boundaries(state.tokenizer, ids)
        # The first (the system prompt's end) and the latest message starts: where agents diverge.
        # A conversation of many messages must not fill the checkpoint budget, others' included.
        starts = starts[:1] + starts[1:][-MAX_MESSAGE_CHECKPOINTS:]
        boundaries = tuple(sorted({*starts, *hint_positions(state.tokenizer, creq, ids)}))
        max_tokens = fit_context(len(ids), creq.max_tokens, state.config.ctx, prompt_param=creq.messages_param)
        after_trigger = offered_calls_grammar(state, creq)
        sampling, server_stops = no_calls_sampling(state, creq)
        gens = []
        for i in range(n):
            gen = cls(state, ids, max_tokens, sampling=sampling.for_choice(i), stop=creq.stop,
                      logprobs=creq.logprobs, ignore_eos=creq.ignore_eos, parse=True, thinking=creq.thinking,
                      schemas=schemas if tools else None, tool_choice=creq.tool_choice,
                      call_id_prefix=call_id_prefix, grammar=creq.grammar, after_trigger=after_trigger,
                      parallel_tool_calls=creq.parallel_tool_calls, server_stops=tuple(server_stops))
            gen.usage.prompt_tokens = len(ids)
            gen.boundaries = boundaries
            gens.append(gen)
        return gens

    @classmethod
    def completion(cls, state, prompt_ids: list[int], max_tokens: int, **options) -> "Generation":
        """Raw text out, no parsing (the prompt is used as given)."""
        gen = cls(state, prompt_ids, max_tokens, parse=False, **options)
        gen.usage.prompt_tokens = len(prompt_ids)
        return gen

    # ------------------------------------------------------------------ engine
    @property
    def request(self) -> GenRequest | None:
        return self.requests[-1] if self.requests else None

    @property
    def queued(self) -> bool:
        return self.request is not None and self.request.state == "queued"

    def _request(self, prompt_ids: list[int], max_tokens: int, stop: list[str], grammar=None,
                 prompt_logprobs: int | None = None) -> GenRequest:
        req = GenRequest(prompt_ids, max_tokens, sampling=self.sampling, stop=[*stop, *self.server_stops],
                         logprobs=self.logprobs,
                         ignore_eos=self.ignore_eos, grammar=grammar, prompt_logprobs=prompt_logprobs,
                         after_trigger=self.after_trigger if grammar is None else None,
                         emit=self.channel.push, tenant=self.tenant, boundaries=self.boundaries)
        self.requests.append(req)
        return req

    def first_request(self, channel: Channel) -> GenRequest:
        """The first engine request (not queued yet); its events go to `channel`."""
        self.channel = channel
        ids, max_tokens, stop = self.prompt_ids, self.max_tokens, self.stop
        if self.two_phase:  # phase 1: the reasoning, leaving room for the shortest valid content
            self.reserved = self._reserve(max_tokens)
            return self._request(ids, max(1, max_tokens - self.reserved), stop + [THINK_END])
        if self.opener:
            ids, max_tokens = self._append_opener(ids, max_tokens)
        return self._request(ids, max_tokens, stop, self.grammar, self.prompt_logprobs)

    def _reserve(self, max_tokens: int) -> int:
        """Tokens phase 1 leaves for what must follow the reasoning with a grammar: `</think>`, the
        opener, the grammar's shortest completion (its closing path); 0 without a grammar."""
        if self.grammar is None:
            return 0
        path = self.grammar.constraint().closing_path(max_tokens)
        if path is None:
            return 0
        opener = self.tokenizer.encode(self.opener, add_special_tokens=False) if self.opener else []
        return 1 + len(opener) + len(path)

    def submit(self) -> None:
        """Queue the request in the engine; APIError 429 (queue full), 503 (stopped), 400."""
        queue_requests(self.state.engine, [self.first_request(Channel(asyncio.get_running_loop()))])

    def _append_opener(self, ids: list[int], max_tokens: int) -> tuple[list[int], int]:
        opener_ids = self.tokenizer.encode(self.opener, add_special_tokens=False)
        if max_tokens <= len(opener_ids):  # no room for a call after the opener: do not force one
            log.warning("tool_choice %s not enforced: max tokens %d leave no room for a call",
                        self.tool_choice.mode, max_tokens)
            self.opener = ""
            return ids, max_tokens
        self.opener_ids = opener_ids
        self.reply_ids += opener_ids
        self._feed(self.opener, [])
        return ids + opener_ids, max_tokens - len(opener_ids)

    def cancel(self) -> None:
        if self.request is not None and not self.request.finished():
            self.state.engine.cancel(self.request)

    def finished(self) -> bool:
        return self._ended

    # ------------------------------------------------------------------ events
    async def next_events(self, timeout: float) -> list[Event]:
        """The events that arrived within `timeout` ([] if none)."""
        return self.events(await self.channel.get(timeout))

    def events(self, items: list[tuple]) -> list[Event]:
        """The engine's `items` (drained from the channel) as events."""
        out: list[Event] = []
        for kind, value in items:
            if self._ended:
                break
            if kind == "prompt_logprobs":
                out.append(PromptLogprobs(value))
            elif kind == "token":
                if len(self.requests) == 1:  # known once the prefill began
                    self.usage.cached_tokens = min(self.request.cached_tokens, self.usage.prompt_tokens)
                out.append(Token(value))
                if self.parser is not None and self.parser.in_reasoning:
                    self.usage.reasoning_tokens += 1
                self._feed(value.text, out)
            elif kind == "done":
                self._phase_done(out)
            elif kind == "error":
                self._ended = True
                out.append(Failed(value))
            elif kind == "cancelled":
                self._ended = True
                out.append(Cancelled(value))
        if self.choice:
            out = [dataclasses.replace(e, choice=self.choice) if hasattr(e, "choice") else e for e in out]
        return out

    def _feed(self, text: str, out: list[Event], final: bool = False) -> None:
        if text:
            self.reply_text.append(text)
        if self.parser is None:
            text = self.markup.feed(text, final=final)
            for dropped in self.markup.dropped:
                self._dropped("token", dropped)
            self.markup.dropped.clear()
            if text:
                self.returned_content.append(text)
                out.append(Text("content", text))
            return
        if text:
            for ev in self.parser.feed(text):
                self._translate(ev, out)

    def _dropped(self, kind: str, raw: str, why: str = "") -> None:
        # One warning a reply (a choice): a model that keeps emitting markup (a raw completion of random
        # tokens, say) would otherwise log every token; the metric counts them all.
        level = logging.DEBUG if self.markup_logged else logging.WARNING
        self.markup_logged = True
        log.log(level, "markup kept out of the text (%s%s): %r%s", kind, f": {why}" if why else "", raw[:500],
                "" if level == logging.DEBUG else " (any more in this reply: debug level)")
        self.state.metrics.markup_dropped.labels(kind=kind).inc()

    def _translate(self, ev, out: list[Event]) -> None:
        if isinstance(ev, ReasoningDelta):
            self.returned_reasoning.append(ev.text)
            out.append(Text("reasoning", ev.text))
        elif isinstance(ev, ContentDelta):
            self.returned_content.append(ev.text)
            out.append(Text("content", ev.text))
        elif isinstance(ev, MarkupDropped):
            self._dropped(ev.kind, ev.text)
        elif isinstance(ev, ToolCall):
            problem = "parallel_tool_calls is false: only the first call is kept" \
                if self.calls and not self.parallel_tool_calls else self._call_problem(ev)
            if problem:
                self._dropped("call", ev.raw, problem)
                return
            call = Call(len(self.calls), f"{self.call_id_prefix}{uuid.uuid4().hex[:24]}", ev.name, ev.arguments)
            self.calls.append(call)
            out.append(call)

    def _call_problem(self, call: ToolCall) -> str | None:
        if self.schemas is None:
            return "no tools are offered (tool_choice none or no tools)"
        if call.name not in self.schemas:
            return f"unknown tool {call.name!r}"
        problems = validate_json_schema(json.loads(call.arguments), self.schemas[call.name], "arguments")
        return "; ".join(problems) if problems else None

    def _phase_done(self, out: list[Event]) -> None:
        req = self.request
        if len(self.requests) == 1:
            self.usage.cached_tokens = min(req.cached_tokens, self.usage.prompt_tokens)
        eos = self.state.eos_ids
        ended_by_eos = req.finish_reason == "stop" and bool(req.generated) and req.generated[-1] in eos \
            and not self.ignore_eos
        sampled = req.generated[:-1] if ended_by_eos else list(req.generated)
        self.reply_ids += sampled
        stop_hit = None
        if req.finish_reason == "stop" and not ended_by_eos:
            rest = self.tokenizer.decode(req.generated)[len(req.text):]
            stop_hit = next((s for s in req.stop if rest.startswith(s)), None)
            if stop_hit in self.server_stops:  # the server's own: the reply ends as at EOS
                stop_hit = None
        out_of_room = req.finish_reason == "length" and self.reserved > 0  # only phase 1's budget is spent
        if self.two_phase and len(self.requests) == 1 and (ended_by_eos or out_of_room or (
                stop_hit == THINK_END and THINK_END not in self.stop)):
            self._continue_after_reasoning(req, ended_by_eos or out_of_room, rest if stop_hit else "", out)
            return
        self._ended = True
        finish = "end" if ended_by_eos else "length" if req.finish_reason == "length" else \
            "stop_sequence" if stop_hit is not None else "end"
        if self.parser is not None:
            for ev in self.parser.finish():
                self._translate(ev, out)
            if self.calls and finish != "length":
                finish = "tool_calls"
            if self.opener and not self.calls:
                log.warning("tool_choice %s: the reply holds no valid tool call", self.tool_choice.mode)
            self._record()
        else:
            self._feed("", out, final=True)  # what the markup filter held back
        self.usage.completion_tokens = len(self.reply_ids) + (1 if ended_by_eos else 0)
        self.done = Done(finish, stop_hit if finish == "stop_sequence" else None)
        out.append(self.done)

    def _continue_after_reasoning(self, req: GenRequest, close: bool, rest: str, out: list[Event]) -> None:
        """Phase 2 of a forced tool call or a grammar in thinking mode: the reasoning ended; append
        the opener (a forced call), constrain the rest (a grammar). `close`: the reasoning did not
        end by itself (the model sent EOS in it, or it used the tokens phase 1 had): `</think>` is
        appended (in place of the EOS), so what was asked for (a call, the format) still follows."""
        ids = self.prompt_ids + req.generated
        if close:
            end_ids = self.tokenizer.encode(THINK_END, add_special_tokens=False)
            self.reply_ids += end_ids
            ids = self.prompt_ids + self.reply_ids
            extra, opener = THINK_END, self.opener
        elif rest != THINK_END:
            # The token that finished </think> carried more text: the opener cannot follow cleanly.
            log.warning("tool_choice %s not enforced: the reasoning ended inside a token", self.tool_choice.mode)
            self.grammar = None  # the content already began: a grammar from its start cannot hold
            extra, opener = rest, ""
        else:
            extra, opener = THINK_END, self.opener
        self._feed(extra, out)
        self.opener = opener
        left = self.max_tokens - (len(ids) - len(self.prompt_ids))
        if left <= 0:
            self._ended = True
            self.usage.completion_tokens = len(self.reply_ids)
            self.done = Done("length")
            out.append(self.done)
            return
        if opener:
            ids, left = self._append_opener(ids, left)
        try:
            queue_requests(self.state.engine, [self._request(ids, left, self.stop, self.grammar)], continuation=True)
        except APIError as e:
            self._ended = True
            out.append(Failed(e))

    def _record(self) -> None:
        """Remember the reply's sampled ids for exact replay (see serve.http.replay)."""
        replay = self.state.replay
        text = "".join(self.reply_text)
        if replay is None or not self.reply_ids or set(self.reply_ids) & self.state.eos_ids:
            return
        if self.tokenizer.decode(self.reply_ids) != text:
            return  # e.g. cut at a stop string: what the client got is not what was sampled
        sig = signature("".join(self.returned_reasoning), "".join(self.returned_content),
                        [(c.name, json.loads(c.arguments)) for c in self.calls], self.thinking)
        # Keyed by the text the client's copy of the turn renders to: when markup was kept out of
        # what it got, that is not the sampled text, and the turn sent back must still find its ids.
        message = {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning or None,
                   "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                "arguments": c.arguments}}
                                  for c in self.calls] or None}
        try:
            key = render_assistant_completion(message, thinking=self.thinking)
        except ValueError:
            key = text
        try:
            replay.record(key, self.reply_ids, sig, [c.id for c in self.calls], self.tenant)
        except Exception as e:  # noqa: BLE001 - replay is an optimisation: never fail the request
            log.warning("replay: recording failed: %s: %s", type(e).__name__, e)

    # ------------------------------------------------------------------ results
    @property
    def reasoning(self) -> str:
        return "".join(self.returned_reasoning)

    @property
    def content(self) -> str:
        return "".join(self.returned_content)

    @property
    def generated(self) -> list[int]:
        """Every sampled token id, in order (all phases)."""
        return [t for r in self.requests for t in r.generated]



class Choices:
    """Several generations answered as one response: OpenAI's `n` and `best_of` choices, one
    group per prompt (a completions request may send several). Queued together, back to back,
    so the choices of a prompt share its prefill; their events carry their `choice` (the index
    in `gens`). Offers what `serve.http.app` drives a `Generation` with."""

    def __init__(self, groups: list[list[Generation]]):
        self.groups = groups
        self.gens = [g for group in groups for g in group]
        for i, g in enumerate(self.gens):
            g.choice = i

    def submit(self) -> None:
        wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        queue_requests(self.gens[0].state.engine, [g.first_request(Channel(loop, wake)) for g in self.gens])

    async def next_events(self, timeout: float) -> list[Event]:
        channels = [g.channel for g in self.gens]
        if not any(c.items for c in channels):
            await channels[0].wait(timeout)
        else:
            channels[0].event.clear()
        return [ev for g in self.gens for ev in g.events(g.channel.drain())]

    def cancel(self) -> None:
        for g in self.gens:
            g.cancel()

    def finished(self) -> bool:
        return all(g.finished() for g in self.gens)

    # ------------------------------------------------------------------ for logs
    @property
    def queued(self) -> bool:
        return any(g.queued for g in self.gens)

    @property
    def request(self) -> GenRequest | None:
        return self.gens[0].request

    @property
    def requests(self) -> list[GenRequest]:
        return self.gens[0].requests

    @property
    def done(self) -> Done | None:
        return self.gens[0].done

    @property
    def generated(self) -> list[int]:
        return [t for g in self.gens for t in g.generated]

    @property
    def calls(self) -> list[Call]:
        return [c for g in self.gens for c in g.calls]

    @property
    def usage(self) -> Usage:
        """Each prompt counted once, every choice's completion tokens."""
        heads = [group[0].usage for group in self.groups]
        return Usage(prompt_tokens=sum(u.prompt_tokens for u in heads),
                     completion_tokens=sum(g.usage.completion_tokens for g in self.gens),
                     cached_tokens=sum(u.cached_tokens for u in heads),
                     reasoning_tokens=sum(g.usage.reasoning_tokens for g in self.gens))


# --------------------------------------------------------------------------- structured outputs
def json_grammar(state, schema: Any, param: str):
    """The grammar of JSON values valid against `schema` (None: any JSON object); 400 naming
    `param` and what the schema uses that cannot be enforced."""
    try:
        so = state.engine.structured_outputs()
        return so.json_object() if schema is None else so.json_schema(schema)
    except ValueError as e:
        raise bad(f"'{param}': {e}", param) from None


# Keywords of a strict tool's `parameters` the call grammar honours: it writes exactly the listed
# properties (so `additionalProperties` holds whatever it says), required ones always.
_OBJECT_KEYWORDS = {"type", "properties", "required", "additionalProperties", "description", "title", "$defs",
                    "definitions"}
_ANNOTATIONS = {"description", "title", "examples", "default", "$comment"}
# Text that does not open or close a DSML tag (nor spell `<｜end▁of▁sentence｜>`): a string="true"
# value, and the free text of a reply that may call a strict tool (the parser would read such a
# tag there as markup). Special tokens never match a regex, so only spelled-out tags need keeping out.
_RAW = r"([^<]|<[^\/｜]|<\/[^｜])*"
_RAW_TEXT = f"/{_RAW}/"


def _forced_tools(creq: ChatRequest) -> list[tuple[int, dict]]:
    """(index in `tools`, function) of the tools a forced call may use."""
    choice = creq.tool_choice
    fns = [(i, t["function"]) for i, t in enumerate(creq.tools)]
    if choice.mode == "function":
        fns = [(i, fn) for i, fn in fns if fn["name"] == choice.name]
    return fns


def _string_enum(sub: dict) -> str | None:
    """Lark for a string enum's values (written as text, string="true"), or None when `sub` is
    not one: `enum` a non-empty list of strings, `type` "string" or absent."""
    enum = sub.get("enum")
    if sub.get("type", "string") == "string" and isinstance(enum, list) and enum \
            and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in enum) + ")"
    return None


def _arguments_rule(so, params: Any, where: str) -> str:
    """Lark for the DSML parameters of a call whose arguments follow the JSON schema `params`, as
    `chat_encoding.render_invoke` writes them: properties in the schema's order, a plain string
    as text with string="true", any other value as JSON (`%json`, the property's schema) with
    string="false"; each parameter on its own line."""
    if params is None or params == {}:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise bad(f"'{where}' must be a JSON schema object", where)
    extra = sorted(set(params) - _OBJECT_KEYWORDS)
    if extra:
        raise bad(f"'{where}' uses {extra[0]!r}, which a strict tool call cannot enforce (strict tools take "
                  f"an object schema with properties and required)", where, "unsupported_parameter")
    if params.get("type", "object") != "object":
        raise bad(f"'{where}.type' must be \"object\" for a strict tool", f"{where}.type")
    props = params.get("properties") or {}
    required = params.get("required") or []
    if not isinstance(props, dict) or not isinstance(required, list):
        raise bad(f"'{where}': properties must be an object and required an array", where)
    missing = [r for r in required if r not in props]
    if missing:
        raise bad(f"'{where}.required' names {missing[0]!r}, which is not among the properties", f"{where}.required")
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    parts = []
    for name, sub in props.items():
        if not isinstance(sub, dict):
            raise bad(f"'{where}.properties.{name}' must be a JSON schema object", f"{where}.properties.{name}")
        keys = set(sub) - _ANNOTATIONS
        enum = _string_enum(sub) if keys <= {"type", "enum"} else None
        if keys == {"type"} and sub["type"] == "string":
            flag, value = "true", _RAW_TEXT
        elif enum:
            flag, value = "true", enum
        else:
            flag, value = "false", "%json " + json.dumps({**sub, **defs}, ensure_ascii=False)
        tag = so.literal(PARAMETER_OPEN) + " " + json.dumps(f' name="{name}" string="{flag}">', ensure_ascii=False)
        part = f'{tag} {value} {so.literal(PARAMETER_CLOSE)} "\\n"'
        parts.append(f"({part})" if name in required else f"({part})?")
    if any(name in required for name in props):
        return " ".join(parts)
    return f'({" ".join(parts)} | "\\n")' if parts else '"\\n"'  # no parameter: the line stays empty


# The parameters of a non-strict tool's call: any names, text (string="true") or JSON values, as
# the output parser reads them; its schema is checked after the fact (a failing call is dropped,
# logged and counted). When the schema allows no other names (`additionalProperties: false`),
# the properties it declares, in its order, the required ones always; a property typed "string"
# as text (one of its values when it is a string enum), one of another JSON type as JSON of that
# type: what a schema check would refuse for those reasons is never written (other keywords are
# still checked after the fact).
_ANY_PARAMETER = '{open} " name=\\"" {name} "\\" string=\\"" {value} {close} "\\n"'
_ANY_VALUE = '("true\\">" {text} | "false\\">" %json {{}})'
_RAW_NAME = '/[^"<>\\n]+/'
_JSON_TYPES = {"number", "integer", "boolean", "array", "object", "null"}


def _free_arguments(so, fn: dict) -> str:
    """Lark for the parameters of a call of a non-strict tool (see _ANY_PARAMETER)."""
    tags = dict(open=so.literal(PARAMETER_OPEN), close=so.literal(PARAMETER_CLOSE))
    any_value = _ANY_VALUE.format(text=_RAW_TEXT)
    params = fn.get("parameters")
    props = (params.get("properties") or {}) if isinstance(params, dict) else None
    if not isinstance(params, dict) or params.get("additionalProperties") is not False or \
            not isinstance(props, dict) or any(not n or any(c in n for c in '"<>\n') for n in props):
        return f'(({_ANY_PARAMETER.format(name=_RAW_NAME, value=any_value, **tags)})+ | "\\n")'
    if not props:
        return '"\\n"'
    required = params.get("required") if isinstance(params.get("required"), list) else []
    parts = []
    for name, sub in props.items():
        kind = sub.get("type") if isinstance(sub, dict) else None  # a list of types: any value
        kind = kind if isinstance(kind, str) else None
        enum = _string_enum(sub) if isinstance(sub, dict) else None
        value = ('"true\\">" ' + enum if enum else '"true\\">" ' + _RAW_TEXT if kind == "string" else
                 '"false\\">" %json ' + json.dumps({"type": kind}) if kind in _JSON_TYPES else any_value)
        part = _ANY_PARAMETER.format(name=json.dumps(name, ensure_ascii=False), value=value, **tags)
        parts.append(f"({part})" if name in required else f"({part})?")
    if any(name in required for name in props):
        return " ".join(parts)
    return f'({" ".join(parts)} | "\\n")'


def _invoke_rule(so, creq: ChatRequest, i: int, fn: dict, with_name: bool = True) -> str:
    """Lark for one call of `fn` after `<｜DSML｜invoke name="` (after the whole opener when not
    `with_name`), as `chat_encoding.render_invoke` writes it, up to `</｜DSML｜invoke>`: a strict
    tool's parameters follow its schema (`_arguments_rule`), any others are free."""
    if fn.get("strict") is True:
        arguments = _arguments_rule(so, fn.get("parameters"), creq.tool_params_path.format(i=i))
    else:
        arguments = _free_arguments(so, fn)
    name = json.dumps(f'{fn["name"]}">', ensure_ascii=False) if with_name else ""
    return f'({name} "\\n" {arguments} {so.literal(INVOKE_CLOSE)})'


# Past this many tools the block grammar is not built: compiling it (on the event loop) and its
# first mask (in the engine's step) grow with the tools, ~0.1 ms each, and a request must not
# stall the others (agents offer 10-40).
MAX_CONSTRAINED_TOOLS = 64
MAX_CALLS_GRAMMAR_CHARS = 1 << 16


def offered_calls_grammar(state, creq: ChatRequest):
    """With tools offered and tool_choice auto, and no other grammar: once the model opens a
    tool-call block (`<｜DSML｜tool_calls>`, one token), the rest of the block follows a grammar:
    calls of offered tools only, a closed schema's declared parameters (`_free_arguments`; a
    strict tool's arguments following its schema), closed within the budget. The reply before it is free and
    costs no masks. So a call never names a tool that was not offered, and always parses (a weak
    model otherwise calls tools it was trained on, and the server has to drop the call). None
    when off (`--free-tool-calls`), with more than MAX_CONSTRAINED_TOOLS tools, or when the
    block's opener is not one token of this tokenizer."""
    if not state.config.tool_call_grammar or creq.grammar is not None or creq.tool_choice.mode != "auto" \
            or not _offered(creq):
        return None
    if len(creq.tools) > MAX_CONSTRAINED_TOOLS:
        log.info("tool calls not constrained to the offered tools: %d tools (more than %d)", len(creq.tools),
                 MAX_CONSTRAINED_TOOLS)
        return None
    trigger = state.tokenizer.encode(TOOL_CALLS_OPEN, add_special_tokens=False)
    if len(trigger) != 1:
        return None
    from ds4_torch.structured import Triggered

    so = state.engine.structured_outputs()
    try:
        invokes = " | ".join(_invoke_rule(so, creq, i, t["function"]) for i, t in enumerate(creq.tools))
        more = ' ("\\n" invoke)*' if creq.parallel_tool_calls else ""
        text = (f'start: "\\n" invoke{more} "\\n" {so.literal(TOOL_CALLS_CLOSE)}\n'
                f'invoke: {so.literal(INVOKE_OPEN)} " name=\\"" ({invokes})\n')
        if len(text) > MAX_CALLS_GRAMMAR_CHARS:  # thousands of parameters, or names of megabytes
            log.info("tool calls not constrained to the offered tools: their grammar would be %d characters",
                     len(text))
            return None
        return Triggered(trigger[0], so.lark(text))
    except (ValueError, APIError) as e:  # a schema the grammar cannot take: calls stay free
        log.warning("tool calls not constrained to the offered tools: %.300s", str(e))
        return None


def strict_tool_grammar(state, creq: ChatRequest):
    """The grammar the content follows (after any reasoning), given strict tools; else `creq.grammar`
    (a response format, or None). 400 naming the schema a grammar cannot enforce.

    * A forced call (tool_choice required or a named function): the rest of the call after the
      opener (`_forced_opener`): an offered tool's name (required), the parameters (a strict
      tool's following its schema; a non-strict tool's free, validated after the fact), the
      closing tags. So a forced call always parses and names a tool that was offered.
    * tool_choice auto with at least one strict tool and no response format: text without DSML
      markup, or such text, the blank line and a tool-call block of one or more calls to the
      offered tools (a strict one's arguments following its schema), EOS after either. With a
      response format the format holds (the reply is the format; no call can be made).
    """
    mode = creq.tool_choice.mode
    if mode in ("required", "function"):
        fns = _forced_tools(creq)
        if not fns:
            return None
        so = state.engine.structured_outputs()
        invokes = " | ".join(_invoke_rule(so, creq, i, fn, with_name=mode != "function") for i, fn in fns)
        text = f'start: ({invokes}) "\\n" {so.literal(TOOL_CALLS_CLOSE)}\n'
    elif mode == "auto" and creq.grammar is None and any(t["function"].get("strict") is True for t in creq.tools):
        fns = list(enumerate(t["function"] for t in creq.tools))
        so = state.engine.structured_outputs()
        invokes = " | ".join(_invoke_rule(so, creq, i, fn) for i, fn in fns)
        # Several calls in one block, each on its own line (render_tool_calls); the text before the
        # block ends with the separator, one regex, so where the text ends is never ambiguous.
        more = '("\\n" invoke)* ' if creq.parallel_tool_calls else ""
        text = (f'start: /{_RAW}(<\\/?)?/ | /{_RAW}\\n\\n/ {so.literal(TOOL_CALLS_OPEN)} "\\n" invoke {more}'
                f'"\\n" {so.literal(TOOL_CALLS_CLOSE)}\n'
                f'invoke: {so.literal(INVOKE_OPEN)} " name=\\"" ({invokes})\n')
    else:
        return creq.grammar
    try:
        return so.lark(text)
    except ValueError as e:
        strict = [i for i, fn in fns if fn.get("strict") is True]
        param = creq.tool_params_path.format(i=strict[0]) if len(strict) == 1 else creq.tools_param
        raise bad(f"'{param}': {e}", param) from None
