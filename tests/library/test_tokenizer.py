
import pytest

from ds4_torch.tokenizer import ASSISTANT, BOS, EOS, THINK_END, USER, ByteTokenizer, StreamDecoder, load_tokenizer
from helpers import BPE_TEXT as TEXT, write_bpe

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]
# DeepSeek-V4's format in chat mode (the default), written out by hand: every assistant turn
# opens with </think>. tests/library/test_chat_encoding.py covers the format in depth.
EXPECTED_CHAT = (
    "<｜begin▁of▁sentence｜>You are terse."
    "<｜User｜>Hi there<｜Assistant｜></think>Hello.<｜end▁of▁sentence｜>"
    "<｜User｜>2+2?<｜Assistant｜></think>"
)


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
    assert no_prompt == EXPECTED_CHAT[: -len(ASSISTANT + THINK_END)]


def test_render_chat_variants():
    tok = ByteTokenizer()
    user = [{"role": "user", "content": "Q"}]
    assert tok.render_chat(user) == f"{BOS}{USER}Q{ASSISTANT}</think>"
    assert tok.render_chat(user, thinking=True) == f"{BOS}{USER}Q{ASSISTANT}<think>"
    assert tok.render_chat(user, thinking=False) == f"{BOS}{USER}Q{ASSISTANT}</think>"
    two_systems = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}] + user
    assert tok.render_chat(two_systems) == f"{BOS}A\n\nB{USER}Q{ASSISTANT}</think>"
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = tok.render_chat(user, tools=tools, thinking=True, reasoning_effort="max")
    assert with_tools.startswith(f"{BOS}Reasoning Effort: Absolute maximum")
    assert '{"name": "f"}\n' in with_tools and with_tools.endswith(f"{USER}Q{ASSISTANT}<think>")


def test_encode_chat_uses_special_tokens(tok_dir):
    tok = load_tokenizer(tok_dir)
    ids = tok.encode_chat(CONVERSATION)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[-2:] == tok.hf.convert_tokens_to_ids([ASSISTANT, THINK_END])
    assert ids.count(tok.eos_token_id) == 1  # the one closing the assistant turn
    assert tok.decode(ids, skip_special_tokens=False) == EXPECTED_CHAT


def test_chat_template_from_config_wins(tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}" \
               "{% if add_generation_prompt %}[assistant]{% endif %}"
    tok = load_tokenizer(write_bpe(tmp_path, {"chat_template": template}))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs) == "[user]hi[assistant]"
    assert tok.render_chat(msgs, add_generation_prompt=False) == "[user]hi"


def test_chat_template_gets_tools_and_options(tmp_path):
    template = ("{% for t in tools or [] %}<{{ t['function']['name'] }}>{% endfor %}"
                "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                "{% for c in m.get('tool_calls', []) %}({{ c['function']['name'] }}:{{ c['function']['arguments']['x'] }})"
                "{% endfor %}{% endfor %}"
                "{% if thinking %}+think{% endif %}{% if reasoning_effort %}+{{ reasoning_effort }}{% endif %}")
    tok = load_tokenizer(write_bpe(tmp_path, {"chat_template": template}))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 7}'}}]},
            {"role": "tool", "tool_call_id": "c", "content": "r"}]
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    # Content parts arrive joined, tool arguments as a dict, as HF templates expect.
    assert tok.render_chat(msgs, add_generation_prompt=False, thinking=True, tools=tools, reasoning_effort="high") \
        == "<f><g>[user]hi[assistant](f:7)[tool]r+think+high"


def test_effort_profile_read_from_the_checkpoint_encoder(tmp_path):
    write_bpe(tmp_path)
    assert load_tokenizer(tmp_path).effort_profile == "v4"
    (tmp_path / "encoding").mkdir()
    (tmp_path / "encoding" / "encoding_dsv4.py").write_text(
        'DEFAULT_REASONING_EFFORT = "low"\nREASONING_EFFORT_PROMPTS = {\n    "low": "",\n    "high": "H",\n'
        '    "max": "M",\n}\n', encoding="utf-8")
    tok = load_tokenizer(tmp_path)
    assert tok.effort_profile == "v4-0731"
    high = tok.render_chat([{"role": "user", "content": "Q"}], thinking=True, reasoning_effort="high")
    assert high.startswith(f"{BOS}Reasoning Effort: Absolute maximum")


@pytest.mark.parametrize("messages, match", [
    ([], "empty"),
    ("hello", "list"),
    ([{"role": "robot", "content": "x"}], "role must be one of"),
    ([{"role": "user"}], "content must be a string"),
    ([{"role": "user", "content": 3}], "content must be a string"),
    (["hi"], r"messages\[0\] must be a dict"),
    ([{"role": "assistant", "content": "a"}], "an assistant message must follow"),
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
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == list(f"{BOS}{USER}hi{ASSISTANT}</think>".encode())


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
