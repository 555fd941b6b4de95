import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ds4_torch.tokenizer import (
    ASSISTANT, BOS, EOS, USER, ByteTokenizer, StreamDecoder, load_tokenizer, render_deepseek_chat,
)

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]
# The documented DeepSeek format, written out by hand.
EXPECTED_CHAT = (
    "<｜begin▁of▁sentence｜>You are terse."
    "<｜User｜>Hi there<｜Assistant｜>Hello.<｜end▁of▁sentence｜>"
    "<｜User｜>2+2?<｜Assistant｜>"
)


def write_bpe(directory, config=None):
    """A tiny byte-level BPE with DeepSeek's chat markers as special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=[BOS, EOS, USER, ASSISTANT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 3 + ["Hello there. How are you?"], trainer)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@pytest.fixture
def tok_dir(tmp_path):
    # DeepSeek's tokenizer_config.json spells special tokens as AddedToken dicts.
    return write_bpe(tmp_path, {
        "bos_token": {"__type": "AddedToken", "content": BOS},
        "eos_token": {"__type": "AddedToken", "content": EOS},
    })


def test_round_trip(tok_dir):
    tok = load_tokenizer(tok_dir)
    for text in (TEXT, "Ünïcödé ✓ 中文 and emoji 🙂", " leading and  double  spaces "):
        ids = tok.encode(text)
        assert ids and all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text
    # Merges were learnt: common text takes fewer tokens than bytes.
    assert len(tok.encode(TEXT)) < len(TEXT.encode())


def test_special_token_ids_from_config(tok_dir):
    tok = load_tokenizer(tok_dir)
    assert tok.bos_token_id == tok.hf.convert_tokens_to_ids(BOS)
    assert tok.eos_token_id == tok.hf.convert_tokens_to_ids(EOS)
    assert tok.eos_token_id != tok.bos_token_id


def test_render_chat_matches_documented_format(tok_dir):
    tok = load_tokenizer(tok_dir)
    assert tok.render_chat(CONVERSATION) == EXPECTED_CHAT
    assert ByteTokenizer().render_chat(CONVERSATION) == EXPECTED_CHAT
    no_prompt = tok.render_chat(CONVERSATION, add_generation_prompt=False)
    assert no_prompt == EXPECTED_CHAT[: -len(ASSISTANT)]


def test_render_chat_variants():
    user = [{"role": "user", "content": "Q"}]
    assert render_deepseek_chat(user) == f"{BOS}{USER}Q{ASSISTANT}"
    assert render_deepseek_chat(user, thinking=True) == f"{BOS}{USER}Q{ASSISTANT}<think>"
    assert render_deepseek_chat(user, thinking=False) == f"{BOS}{USER}Q{ASSISTANT}</think>"
    two_systems = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}] + user
    assert render_deepseek_chat(two_systems) == f"{BOS}A\n\nB{USER}Q{ASSISTANT}"


def test_encode_chat_uses_special_tokens(tok_dir):
    tok = load_tokenizer(tok_dir)
    ids = tok.encode_chat(CONVERSATION)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[-1] == tok.hf.convert_tokens_to_ids(ASSISTANT)
    assert ids.count(tok.eos_token_id) == 1  # the one closing the assistant turn
    assert tok.decode(ids, skip_special_tokens=False) == EXPECTED_CHAT


def test_chat_template_from_config_wins(tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}" \
               "{% if add_generation_prompt %}[assistant]{% endif %}"
    tok = load_tokenizer(write_bpe(tmp_path, {"chat_template": template}))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs) == "[user]hi[assistant]"
    assert tok.render_chat(msgs, add_generation_prompt=False) == "[user]hi"


@pytest.mark.parametrize("messages, match", [
    ([], "empty"),
    ("hello", "list"),
    ([{"role": "robot", "content": "x"}], "role must be one of"),
    ([{"role": "user"}], "content must be a string"),
    ([{"role": "user", "content": 3}], "content must be a string"),
    (["hi"], r"messages\[0\] must be a dict"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "system messages must come before"),
])
def test_render_chat_rejects_bad_messages(tok_dir, messages, match):
    for tok in (load_tokenizer(tok_dir), ByteTokenizer()):
        with pytest.raises(ValueError, match=match):
            tok.render_chat(messages)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(tmp_path / "nope")


def test_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_byte_tokenizer():
    tok = ByteTokenizer()
    text = "naïve 中文 🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"  # invalid bytes never raise
    assert tok.eos_token_id is None
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == list(f"{BOS}{USER}hi{ASSISTANT}".encode())


def _stream(tok, ids):
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    return pieces, pieces + [dec.flush()]


def test_stream_decoder_holds_partial_characters(tok_dir):
    text = "a 中文 🙂 b, to be"
    for tok in (ByteTokenizer(), load_tokenizer(tok_dir)):
        pieces, with_flush = _stream(tok, tok.encode(text))
        assert "".join(with_flush) == text
        assert not any("\ufffd" in p for p in pieces)
    # Byte by byte, the 4-byte emoji appears only once its last byte arrives.
    pieces, _ = _stream(ByteTokenizer(), list("🙂".encode()))
    assert pieces == ["", "", "", "🙂"]


def test_stream_decoder_emits_invalid_bytes_eventually():
    pieces, with_flush = _stream(ByteTokenizer(), [0xFF] * 6 + [0x41])
    assert "".join(with_flush) == "\ufffd" * 6 + "A"
    assert "".join(pieces).endswith("A")  # not held back forever
