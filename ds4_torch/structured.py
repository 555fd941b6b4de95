"""Structured outputs: decoding constrained to a JSON schema, and finished within the token budget.

    so = StructuredOutputs(tokenizer, vocab_size)     # once per tokenizer
    grammar = so.json_schema(schema)                  # or so.json_object(), so.lark(text); ValueError names what is unsupported
    c = grammar.constraint()                          # per request (and per choice)
    Triggered(token_id, grammar)                      # the grammar starts after that token (tool-call blocks)
    token = c.step(lambda allowed: sample(logits, params, gen, allowed=allowed), remaining)
    c.done                                            # nothing can follow: the output is complete

The grammar library is llguidance (the Rust core of Guidance; vLLM and SGLang use it too). Compared
here with our tokenizer (1,024 tokens) on a 3-property object schema and on schemas using `not`,
`uniqueItems`, an unknown `format` and a dangling `$ref`:

- llguidance 1.9.1: one dependency-free abi3 wheel (any CPython >= 3.9, Linux and macOS, no torch
  or compiler); takes our Hugging Face tokenizer as it is; compiles a schema lazily (~1 ms, no
  index over the vocabulary), ~10-90 us per token mask; refuses all four schemas by name; recursion
  works. Its matcher copies in ~1 us, which is what makes the closing path below affordable.
- xgrammar 0.2.8: needs torch, triton, transformers, pydantic and apache-tvm-ffi; ~4 ms to compile,
  ~5 us per mask; accepts `not`, `uniqueItems` and the unknown format silently, so outputs would not
  honour them.
- outlines-core 0.2.14: a small wheel, but the token vocabulary must be built by hand from token
  strings, each schema becomes a regex with a token index built per schema (cost grows with the
  vocabulary), and it accepts `uniqueItems` silently.

Finishing within the budget. A model can write inside a JSON string until `max_tokens` runs out,
and an output cut there does not parse. So each constraint keeps a *closing path*: tokens that,
from the current state, reach a complete value (the grammar accepting), found by a deterministic
policy on a copy of the matcher (forced tokens first; then a tag token (a grammar around JSON, e.g. a tool call, closes its text
with one); then, inside a string, its closing quote;
else the container's closer, a comma, the shortest value: `0`, `""`, `null` ...; else the
shortest token the grammar allows). Invariant: the path fits the tokens left. Each step the
model samples under the grammar's mask; the token is taken when a closing path from after it
still fits the tokens left after it, else the path's next token is emitted instead. So the output
is complete when the budget ends, as long as the first path fitted `max_tokens` (a schema whose
smallest value needs more tokens, or a string `pattern` the policy cannot close, falls back to the
plain mask and may be cut: finish_reason "length").
"""
from __future__ import annotations

import functools
import json
from typing import Callable

import torch

# JSON written without optional whitespace: the budget goes to content, and a model cannot loop
# on spaces or newlines between tokens.
_DEFAULTS = {"whitespace_flexible": False}


class StructuredOutputs:
    """The tokenizer as the grammar library sees it, and the grammars compiled for it."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None = None):
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        hf = getattr(tokenizer, "hf", tokenizer)
        eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("structured outputs need a tokenizer with an EOS token")
        self.vocab_size = vocab_size
        self.eos = int(eos)
        self.lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=self.eos)
        self._hf = hf
        self._closer = _Closer(self.lltok, vocab_size, self.eos)

    def json_schema(self, schema) -> "Grammar":
        """The grammar of JSON values valid against `schema` (a dict, or its JSON text). Raises
        ValueError naming what the schema uses that cannot be enforced (a keyword, a format, a
        regex feature, a bad `$ref`): outputs always validate, or the request is refused."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if schema is False:
            raise ValueError("the JSON schema `false` accepts no value")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return self._compile("json", json.dumps(schema))  # key order kept: the order properties are written in

    def json_object(self) -> "Grammar":
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return self._compile("json", json.dumps({"type": "object"}))

    def lark(self, text: str) -> "Grammar":
        """A grammar in llguidance's Lark dialect (`%json {schema}` embeds a JSON schema; text
        literals match whatever tokens spell them). Raises ValueError like `json_schema`."""
        return self._compile("lark", text)

    def literal(self, text: str) -> str:
        """A Lark expression matching exactly `text`. A text that is one added token which
        llguidance keeps apart from text (a tag like `</｜DSML｜invoke>`: such tokens never match a
        string literal) is named by its id, `<[id]>`; anything else is a string literal."""
        ids = self._hf.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in self._closer.tags:
            return f"<[{ids[0]}]>"
        return json.dumps(text, ensure_ascii=False)

    @functools.lru_cache(maxsize=256)
    def _compile(self, kind: str, text: str) -> "Grammar":
        llg = self._llg
        try:
            if kind == "json":
                spec = llg.LLMatcher.grammar_from_json_schema(json.loads(text), defaults=_DEFAULTS)
            else:
                spec = llg.LLMatcher.grammar_from_lark(text)
        except Exception as e:  # noqa: BLE001 - the library's own exception types vary
            raise ValueError(f"unsupported {'JSON schema' if kind == 'json' else 'grammar'}: {e}") from None
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(spec, self.lltok)
        # A warning (e.g. an unknown `format`) means a constraint the output would not respect.
        if failed or messages:
            raise ValueError("unsupported JSON schema feature: " + "; ".join(m.strip() for m in messages))
        return Grammar(self, spec)


class Grammar:
    """A compiled grammar: immutable, shared by every request (and choice) using the schema."""

    def __init__(self, outputs: StructuredOutputs, spec: str):
        self.outputs, self.spec = outputs, spec

    def constraint(self) -> "Constraint":
        return Constraint(self)


class Triggered:
    """A grammar that starts once `trigger` (one token) is sampled: what comes before is free, the
    text after the trigger follows `grammar` until it is complete, and what follows that is free
    again (e.g. a tool-call block: `<｜DSML｜tool_calls>` opens it, the calls after it name offered
    tools). A request pays for masks only inside it."""

    def __init__(self, trigger: int, grammar: Grammar):
        self.trigger, self.grammar = int(trigger), grammar

    @property
    def outputs(self) -> StructuredOutputs:
        return self.grammar.outputs


class Constraint:
    """One request's position in its grammar."""

    def __init__(self, grammar: Grammar):
        so = grammar.outputs
        self.matcher = so._llg.LLMatcher(so.lltok, grammar.spec)
        if self.matcher.is_error():
            raise ValueError(f"cannot use the grammar: {self.matcher.get_error()}")
        self._closer = so._closer
        self.eos = so.eos
        self.lexer = _Lexer()
        self.path: list[int] | None = None   # the closing path from here; None: none fits (no guarantee)
        self._started = False
        self.forced = 0                      # tokens emitted from a closing path instead of the sample

    @property
    def done(self) -> bool:
        """Nothing can follow: the output is complete (or the matcher failed, which ends it too)."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def complete(self) -> bool:
        """What was emitted is a whole value (more may still be allowed, e.g. digits of a number)."""
        return self.matcher.is_accepting()

    def closing_path(self, limit: int) -> list[int] | None:
        """The tokens the closing policy would emit from here to a complete value (at most `limit`)."""
        return self._closer.path(self.matcher, self.lexer, limit)

    def allowed(self) -> torch.Tensor:
        """Bool mask [V] of the tokens the grammar allows next."""
        return self._closer.allowed(self.matcher)

    def step(self, choose: Callable[[torch.Tensor], int], remaining: int) -> int:
        """The next token, consumed: `choose(allowed)` (the sampler, given the grammar's mask), or the
        closing path's next token when the sampled one would leave too few of the `remaining`
        tokens (this one included) to finish the value."""
        return self.finish(choose(self.begin(remaining)), remaining)

    def begin(self, remaining: int) -> torch.Tensor:
        """`step` in two halves, for a sampler that draws a whole batch at once: the mask of the
        tokens allowed next (`remaining` as `step` takes it), then `finish(sampled, remaining)`."""
        if not self._started:
            self._started = True
            self.path = self.closing_path(remaining)
        return self.allowed()

    def finish(self, token: int, remaining: int) -> int:
        """The token taken (the sampled one, or the closing path's next), consumed."""
        if token != self.eos and self.path is not None:
            after = self._closer.still_closes(self.matcher, token, self.path, remaining - 1)
            if after is None:
                after = self._closer.path(self.matcher, self.lexer, remaining - 1, first=token)
            if after is not None:
                self.path = after
            elif self.path:
                token, self.path = self.path[0], self.path[1:]
                self.forced += 1
            # else the value is already complete and the sample would reopen it past the budget:
            # cannot happen for an object or array (stopped at its closer); a number just grows.
        self._consume(token)
        return token

    def _consume(self, token: int) -> None:
        # A token the grammar rejects (a bug: the mask allowed it) leaves the matcher in error,
        # which `done` reports: the request ends there rather than failing its batch.
        if self.matcher.consume_token(token):
            self._closer.advance(self.lexer, token)


class _Lexer:
    """Where a JSON text stands: inside a string (and after a backslash), the open containers."""

    __slots__ = ("in_string", "escape", "stack")

    def __init__(self, in_string=False, escape=False, stack=""):
        self.in_string, self.escape, self.stack = in_string, escape, stack

    def copy(self) -> "_Lexer":
        return _Lexer(self.in_string, self.escape, self.stack)

    def push(self, data: bytes) -> None:
        for b in data:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif b == 0x5C:  # backslash
                    self.escape = True
                elif b == 0x22:  # quote
                    self.in_string = False
            elif b == 0x22:
                self.in_string = True
            elif b in (0x7B, 0x5B):  # { [
                self.stack += chr(b)
            elif b in (0x7D, 0x5D) and self.stack:  # } ]
                self.stack = self.stack[:-1]


class _Closer:
    """Token tables and the closing policy, shared by every constraint of a tokenizer."""

    def __init__(self, lltok, vocab_size: int, eos: int):
        self.lltok, self.vocab_size, self.eos = lltok, vocab_size, eos
        n = lltok.vocab_size
        self.token_bytes = [lltok.decode_bytes([i]) if i < n else b"" for i in range(vocab_size)]

        def single(ch: str) -> int | None:
            ids = lltok.tokenize_bytes(ch.encode())
            return ids[0] if len(ids) == 1 else None

        def ids(chars: str) -> list[int]:
            return [t for t in map(single, chars) if t is not None]

        self.quote = ids('"')
        self.close = {"{": ids("}"), "[": ids("]")}
        self.comma = ids(",")
        # Shortest values first: 0, "" (a quote, then the string's own closing), null, false, ...
        self.values = ids('0"nft[{-123456789')
        # Tokens llguidance keeps apart from text: tags such as `</｜DSML｜parameter>`. A grammar
        # allowing one is outside JSON (a tool call's text value), and the tag is what closes it,
        # so the policy tries them first, and after one the lexer starts afresh.
        self.tags = {i for i in range(min(n, vocab_size)) if lltok.is_special_token(i) and i != eos}
        self.tag_order = sorted(self.tags)
        # Fallback: the shortest tokens first (fewest bytes, then lowest id), never EOS or empty ones.
        order = sorted((len(b), i) for i, b in enumerate(self.token_bytes) if b and i != eos)
        self.by_length = torch.tensor([i for _, i in order], dtype=torch.long)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self, matcher) -> torch.Tensor:
        # The matcher's bitmask as bytes (bit i of word w: token 32w + i), unpacked to bools. Not
        # llguidance.torch: it imports torch._dynamo (seconds) for the same few words.
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        bits = (words.unsqueeze(1) >> self._shifts) & 1
        return bits.reshape(-1)[:self.vocab_size].bool()

    def advance(self, lexer: _Lexer, token: int) -> None:
        if token in self.tags:
            lexer.in_string, lexer.escape, lexer.stack = False, False, ""
        else:
            lexer.push(self.token_bytes[token])

    def _next(self, m, lexer: _Lexer) -> int | None:
        for t in self.tag_order:
            if m.validate_tokens([t]) == 1:
                return t
        if lexer.in_string:
            candidates = [] if lexer.escape else self.quote
        else:
            candidates = self.close.get(lexer.stack[-1:], []) + self.comma + self.values
        for t in candidates:
            if m.validate_tokens([t]) == 1:
                return t
        allowed = self.allowed(m)[self.by_length]
        hit = torch.nonzero(allowed)
        return int(self.by_length[hit[0, 0]]) if len(hit) else None

    @staticmethod
    def still_closes(matcher, token: int, path: list[int], limit: int) -> list[int] | None:
        """`path`, when it still closes the value after `token` within `limit` tokens (the common
        case: text inside a string leaves its closing path as it was), else None."""
        if not path or len(path) > limit:
            return None
        m = matcher.deep_copy()
        if not m.consume_token(token) or m.validate_tokens(path) != len(path):
            return None
        m.consume_tokens(path)
        return path if m.is_accepting() else None

    def path(self, matcher, lexer: _Lexer, limit: int, first: int | None = None) -> list[int] | None:
        """The closing path from `matcher` (after `first`, when given): tokens to a complete value,
        at most `limit` of them; None when the policy finds none that short."""
        if limit < 0:
            return None
        m, lx = matcher.deep_copy(), lexer.copy()
        if first is not None:
            if not m.consume_token(first):
                return None
            self.advance(lx, first)
        path: list[int] = []
        while not m.is_accepting():
            forced = m.compute_ff_tokens()
            steps = forced if forced else [self._next(m, lx)]
            for t in steps:
                if t is None or len(path) >= limit or not m.consume_token(t):
                    return None
                self.advance(lx, t)
                path.append(t)
        return path
