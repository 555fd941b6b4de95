"""Tokenizers: a local HuggingFace `tokenizer.json`, or raw bytes for the default model.

Both classes share one small interface used by generation, the CLI and the server:
``encode``, ``decode``, ``render_chat``, ``encode_chat``, ``bos_token_id``, ``eos_token_id``,
``vocab_size``.

Chat rendering follows DeepSeek's format (V3 and V4 share it for plain chat)::

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜>{assistant}<｜end▁of▁sentence｜>...

ending with ``<｜Assistant｜>`` when a generation prompt is asked for. Several system
messages are joined with a blank line, as DeepSeek-V3's template does. V4 can also open
the assistant turn with ``<think>`` (thinking mode) or ``</think>`` (chat mode): pass
``thinking=True/False``; the default ``None`` adds neither. A tokenizer that ships its own
``chat_template`` in tokenizer_config.json is rendered with that template instead.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

ROLES = ("system", "user", "assistant")


def _validate_messages(messages: Any) -> list[dict[str, str]]:
    """Check the OpenAI-style message list; return it as plain dicts."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    seen_turn = False
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: role must be one of {', '.join(ROLES)}; got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}] ({role}): content must be a string, got {type(content).__name__}")
        if role == "system" and seen_turn:
            # DeepSeek places the system prompt right after BOS; a later one has no slot.
            raise ValueError(f"messages[{i}]: system messages must come before user/assistant messages")
        seen_turn = seen_turn or role != "system"
        out.append({"role": role, "content": content})
    return out


def render_deepseek_chat(
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    thinking: bool | None = None,
) -> str:
    """Render messages in DeepSeek's chat format (see the module docstring)."""
    msgs = _validate_messages(messages)
    system = "\n\n".join(m["content"] for m in msgs if m["role"] == "system")
    parts = [BOS, system]
    for m in msgs:
        if m["role"] == "user":
            parts += [USER, m["content"]]
        elif m["role"] == "assistant":
            parts += [ASSISTANT, m["content"], EOS]
    if add_generation_prompt:
        parts.append(ASSISTANT)
        if thinking is not None:
            parts.append(THINK_START if thinking else THINK_END)
    return "".join(parts)


class _ChatMixin:
    chat_template: str | None = None

    def render_chat(self, messages, add_generation_prompt: bool = True, thinking: bool | None = None) -> str:
        return render_deepseek_chat(messages, add_generation_prompt, thinking)

    def encode_chat(self, messages, add_generation_prompt: bool = True, thinking: bool | None = None) -> list[int]:
        # The rendered text already carries BOS, so no special tokens are added again.
        return self.encode(self.render_chat(messages, add_generation_prompt, thinking), add_special_tokens=False)


class ByteTokenizer(_ChatMixin):
    """Vocabulary of the 256 byte values; used only by the built-in random-weight model.

    Special tokens have no ids of their own: chat markers are encoded as their UTF-8 bytes
    and there is no EOS (``eos_token_id`` is None), so generation runs to its token limit.
    """

    vocab_size = 256
    bos_token_id = None
    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer(_ChatMixin):
    """A `transformers.PreTrainedTokenizerFast` read from a local directory."""

    def __init__(self, hf_tokenizer, chat_template: str | None = None):
        self.hf = hf_tokenizer
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return len(self.hf)  # includes added (special) tokens

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

    def render_chat(self, messages, add_generation_prompt: bool = True, thinking: bool | None = None) -> str:
        if self.chat_template is None:
            return super().render_chat(messages, add_generation_prompt, thinking)
        msgs = _validate_messages(messages)
        extra = {} if thinking is None else {"thinking": thinking, "enable_thinking": thinking}
        return self.hf.apply_chat_template(
            msgs, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **extra,
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
    return HFTokenizer(hf, chat_template)


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
