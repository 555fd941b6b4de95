"""Tokenizers: a local HuggingFace `tokenizer.json`, or raw bytes for the default model.

Both classes share one small interface used by generation, the CLI and the server:
``encode``, ``decode``, ``render_chat``, ``encode_chat``, ``bos_token_id``, ``eos_token_id``,
``vocab_size``.

Chat rendering follows DeepSeek-V4's format (``chat_encoding.render_prompt``): messages
(system, user, assistant with reasoning and tool calls, tool results), ``tools``, thinking or
chat mode (``thinking``; None means chat mode) and ``reasoning_effort``. A tokenizer that ships
its own ``chat_template`` in tokenizer_config.json is rendered with that template instead (the
tools go to it as ``tools``, the thinking switch as ``thinking``/``enable_thinking``).
"""
from __future__ import annotations

import functools

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from .chat_encoding import (  # noqa: F401  (the markers are re-exported for callers)
    ASSISTANT, BOS, DEFAULT_EFFORT_PROFILE, EOS, THINK_END, THINK_START, USER, Message, detect_effort_profile,
    normalize_messages, normalize_tools, render_prompt,
)


def _template_messages(msgs: list[Message]) -> list[dict]:
    """Validated messages in the shape HF chat templates expect (tool arguments as dicts)."""
    out = []
    for m in msgs:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.reasoning is not None:
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [
                {"type": "function", **({"id": c.id} if c.id else {}),
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


class _ChatMixin:
    chat_template: str | None = None
    # Which reasoning-effort table the checkpoint's encoder uses (see chat_encoding).
    effort_profile: str = DEFAULT_EFFORT_PROFILE

    def render_chat(self, messages, add_generation_prompt: bool = True, thinking: bool | None = None,
                    tools=None, reasoning_effort: str | None = None) -> str:
        return render_prompt(messages, tools=tools, thinking=bool(thinking), reasoning_effort=reasoning_effort,
                             add_generation_prompt=add_generation_prompt, effort_profile=self.effort_profile)

    def encode_chat(self, messages, add_generation_prompt: bool = True, thinking: bool | None = None,
                    tools=None, reasoning_effort: str | None = None) -> list[int]:
        # The rendered text already carries BOS, so no special tokens are added again.
        text = self.render_chat(messages, add_generation_prompt, thinking, tools, reasoning_effort)
        return self.encode(text, add_special_tokens=False)


class ByteTokenizer(_ChatMixin):
    """Vocabulary of the 256 byte values; used only by the built-in random-weight model.

    Special tokens have no ids of their own: chat markers are encoded as their UTF-8 bytes
    and there is no EOS (``eos_token_id`` is None), so generation runs to its token limit.
    """

    vocab_size = 256
    bos_token_id = None
    eos_token_id = None
    max_token_chars = 1  # the most characters one token decodes to: a text of n has >= n / this tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer(_ChatMixin):
    """A `transformers.PreTrainedTokenizerFast` read from a local directory."""

    def __init__(self, hf_tokenizer, chat_template: str | None = None, effort_profile: str = DEFAULT_EFFORT_PROFILE):
        self.hf = hf_tokenizer
        self.chat_template = chat_template
        self.effort_profile = effort_profile

    @property
    def vocab_size(self) -> int:
        return len(self.hf)  # includes added (special) tokens

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token decodes to (an upper bound: a byte-level vocabulary's
        entries spell one character per byte), so a text of n characters has at least n / this
        tokens: a prompt too long for a context is known before it is tokenized."""
        return max(map(len, self.hf.get_vocab()), default=1)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages, add_generation_prompt: bool = True, thinking: bool | None = None,
                    tools=None, reasoning_effort: str | None = None) -> str:
        if self.chat_template is None:
            return super().render_chat(messages, add_generation_prompt, thinking, tools, reasoning_effort)
        msgs = _template_messages(normalize_messages(messages))
        extra: dict[str, Any] = {} if thinking is None else {"thinking": thinking, "enable_thinking": thinking}
        if reasoning_effort is not None:
            extra["reasoning_effort"] = reasoning_effort
        functions = normalize_tools(tools)
        return self.hf.apply_chat_template(
            msgs, tools=[{"type": "function", "function": f} for f in functions] or None,
            chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt, **extra,
        )


def _token_content(tok: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as
    # {"__type": "AddedToken", "content": ...} dicts (DeepSeek's does the latter).
    if isinstance(tok, Mapping):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def load_tokenizer(path: str | Path) -> HFTokenizer:
    """Load ``tokenizer.json`` (+ optional tokenizer_config.json, special_tokens_map.json)
    from a local directory, or from the tokenizer.json file itself. Never contacts a hub."""
    path = Path(path)
    directory = path.parent if path.is_file() else path
    tok_file = path if path.is_file() else path / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {directory} (looked for {tok_file})")

    from transformers import PreTrainedTokenizerFast  # heavy import: only when needed

    kwargs: dict[str, Any] = {}
    chat_template = None
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        f = directory / name
        if not f.is_file():
            continue
        data = _read_json(f)
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            content = _token_content(data.get(key))
            if content is not None:
                kwargs[key] = content
        if isinstance(data.get("model_max_length"), int):
            kwargs["model_max_length"] = data["model_max_length"]
        if name == "tokenizer_config.json":
            ct = data.get("chat_template")
            if isinstance(ct, list):  # named templates: [{"name": "default", "template": ...}, ...]
                ct = next((t.get("template") for t in ct if t.get("name") == "default"), None)
            chat_template = ct if isinstance(ct, str) else None
    try:
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_file), **kwargs)
    except Exception as e:  # tokenizers raises plain Exception subclasses on bad JSON
        raise ValueError(f"cannot load tokenizer {tok_file}: {e}") from e
    # V4 checkpoints ship their encoder; its reasoning-effort table differs between releases.
    encoder = directory / "encoding" / "encoding_dsv4.py"
    profile = detect_effort_profile(encoder.read_text(encoding="utf-8")) if encoder.is_file() else DEFAULT_EFFORT_PROFILE
    return HFTokenizer(hf, chat_template, profile)


class StreamDecoder:
    """Turns a stream of token ids into text pieces that are safe to print.

    A token can end in the middle of a multi-byte character (byte-level BPE, or the byte
    tokenizer); decoding it alone shows U+FFFD. We hold such text back until the character
    completes. Decoding from an earlier offset (``_prefix``) keeps tokenizers that strip a
    leading space at the start of a decode from eating spaces between pieces.
    """

    # UTF-8 characters span at most 4 bytes: past that, a U+FFFD is a real invalid byte.
    MAX_HELD = 4

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode context
        self._read = 0  # ids up to here have been emitted

    def _pending(self) -> tuple[str, str]:
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        return before, self.tokenizer.decode(self.ids[self._prefix:])

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before, text = self._pending()
        held = len(self.ids) - self._read
        if len(text) > len(before) and (not text.endswith("\ufffd") or held >= self.MAX_HELD):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (incomplete characters come out as U+FFFD)."""
        before, text = self._pending()
        self._prefix = self._read = len(self.ids)
        return text[len(before):]
