"""Exact replay (serve.http.replay, serve.http.chat.encode_conversation): a turn the server generated,
sent back by the client, becomes exactly the token ids that were sampled.

The expectations are built by hand: sampled ids that decode to the right text but are not the
tokenizer's canonical split (one id per character), and DSML laid out differently from the
canonical rendering; the prompt must contain those ids, in place, and otherwise be the plain
encoding of the rendered conversation.
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading

from ds4_torch.chat_encoding import (EOS, render_assistant_completion, render_prompt)
from serve.http.chat import encode_conversation
from serve.http.replay import ReplayStore, signature
from serve.kvstore.snapshot import REPLAY_FILE

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


def split_ids(tok, text: str) -> list[int]:
    """Ids of `text`, one character at a time: decodes to `text`, but is not how it encodes."""
    ids = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]
    assert tok.decode(ids) == text and ids != tok.encode(text, add_special_tokens=False)
    return ids


def test_a_text_turn_replays_its_sampled_ids(tok):
    store = ReplayStore()
    reply = "Good morrow, Paris."
    sampled = split_ids(tok, reply)
    store.record(reply, sampled, signature(None, reply, [], False))
    history = [{"role": "user", "content": "Hail!"}, {"role": "assistant", "content": reply},
               {"role": "user", "content": "And then?"}]
    ids = encode_conversation(tok, store, history)
    before = tok.encode(render_prompt(history[:1]), add_special_tokens=False)
    after = tok.encode(EOS + render_prompt(history)[len(render_prompt(history[:2], add_generation_prompt=False)):],
                       add_special_tokens=False)
    assert ids == before + sampled + after
    assert tok.decode(ids, skip_special_tokens=False) == render_prompt(history)
    # Unknown to the store: the plain encoding of the rendered text.
    assert encode_conversation(tok, ReplayStore(), history) == tok.encode(render_prompt(history),
                                                                          add_special_tokens=False)


def test_tool_call_ids_replay_a_non_canonical_layout(tok):
    """The model wrote its call with JSON the canonical rendering would write differently
    ({"a":1} for an integer array...): the call id brings back exactly what was sampled."""
    sampled_text = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
                    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                    '<｜DSML｜parameter name="days" string="false">  3</｜DSML｜parameter>\n'
                    '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    returned = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": json.dumps({"city": "Paris", "days": 3})}}]}
    assert render_assistant_completion(returned) != sampled_text  # "  3" renders as "3"
    sampled = split_ids(tok, sampled_text)
    store = ReplayStore()
    store.record(sampled_text, sampled, signature("", "", [("get_weather", {"city": "Paris", "days": 3})], False),
                 ["call_abc"])
    history = [{"role": "user", "content": "Weather?"}, returned,
               {"role": "tool", "tool_call_id": "call_abc", "content": "{\"sky\": \"grey\"}"}]
    ids = encode_conversation(tok, store, history, tools=[WEATHER])
    head = tok.encode(render_prompt(history[:1], tools=[WEATHER]), add_special_tokens=False)
    assert ids[:len(head) + len(sampled)] == head + sampled
    assert tok.decode(ids[len(head) + len(sampled):], skip_special_tokens=False).startswith(EOS + "<｜User｜><tool_result>")

    # The client changed the arguments: the turn says something else, so it renders canonically.
    edited = json.loads(json.dumps(returned))
    edited["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "Lyon", "days": 3})
    history[1] = edited
    assert encode_conversation(tok, store, history, tools=[WEATHER]) == \
        tok.encode(render_prompt(history, tools=[WEATHER]), add_special_tokens=False)


def test_reasoning_is_part_of_what_a_turn_says():
    store = ReplayStore()
    sig = signature("think first", "", [("f", {})], True)
    store.record("think first</think>x", [1, 2, 3], sig, ["call_1"])
    assert store.by_calls(["call_1"], sig).ids == (1, 2, 3)
    assert store.by_calls(["call_1"], signature("other thoughts", "", [("f", {})], True)) is None
    assert store.by_calls(["call_1", "call_unknown"], sig) is None
    # Surrounding whitespace and argument order do not change what a turn says.
    assert signature(" a ", "b\n", [("f", {"x": 1, "y": 2})], True) == signature("a", "b", [("f", {"y": 2, "x": 1})], True)


def test_records_survive_a_restart_and_a_damaged_file(tmp_path):
    store = ReplayStore(str(tmp_path))
    sig = signature(None, "hello", [], False)
    store.record("hello", [5, 6], sig, ["call_x"])
    store.close()
    again = ReplayStore(str(tmp_path))
    assert again.by_text("hello").ids == (5, 6) and again.by_calls(["call_x"], sig).ids == (5, 6)
    again.close()
    with open(tmp_path / REPLAY_FILE, "r+b") as f:  # overwrite the SQLite header
        f.write(b"garbage" * 20)
    damaged = ReplayStore(str(tmp_path))
    assert damaged.by_text("hello") is None
    damaged.record("hello", [7], sig)
    assert damaged.by_text("hello").ids == (7,)
    assert any(name.startswith(REPLAY_FILE + ".damaged-") for name in os.listdir(tmp_path))


def test_memory_is_bounded():
    store = ReplayStore(max_records=3, max_tokens=10)
    for k in range(5):
        store.record(f"t{k}", [k] * 2, "s")
    assert len(store) == 3 and store.by_text("t0") is None and store.by_text("t4").ids == (4, 4)
    store.record("long", list(range(9)), "s")
    assert store.by_text("long") is not None and len(store) == 1  # 9 + 2 > 10 tokens: older ones went


def test_disk_is_bounded(tmp_path):
    store = ReplayStore(str(tmp_path), max_records=1, max_disk_records=10)
    for k in range(200):
        store.record(f"t{k}", [k], "s", [f"call_{k}"])
    store.flush()
    (count,) = store._db.execute("SELECT COUNT(*) FROM turns").fetchone()
    assert count <= 10 + 64  # trimmed every 64 writes
    assert store.by_text("t199").ids == (199,) and store.by_text("t0") is None


def test_disk_is_bounded_in_bytes(tmp_path):
    store = ReplayStore(str(tmp_path), max_records=1, max_disk_bytes=20_000)
    text = "x" * 1000
    for k in range(200):
        store.record(f"{k:04d}" + text, [k] * 20, "s")
    store.close()
    db = sqlite3.connect(tmp_path / REPLAY_FILE)
    (stored,) = db.execute("SELECT SUM(length(text) + length(ids) + length(signature)) FROM turns").fetchone()
    db.close()
    assert stored <= 20_000 + 64 * 1200  # trimmed every 64 writes
    again = ReplayStore(str(tmp_path))
    assert again.by_text("0199" + text).ids == (199,) * 20 and again.by_text("0000" + text) is None


def test_a_busy_file_is_waited_for_not_moved_aside(tmp_path):
    ReplayStore(str(tmp_path)).close()
    other = sqlite3.connect(tmp_path / REPLAY_FILE, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN EXCLUSIVE")  # another process writing: "database is locked"
    threading.Timer(2.5, other.execute, ("COMMIT",)).start()
    store = ReplayStore(str(tmp_path))
    store.record("hello", [5, 6], "s")
    store.close()
    other.close()
    assert os.listdir(tmp_path) == [REPLAY_FILE]
    assert ReplayStore(str(tmp_path)).by_text("hello").ids == (5, 6)


def test_records_are_found_by_their_tenant_only(tmp_path):
    store = ReplayStore(str(tmp_path))
    store.record("hello", [5, 6], "s", ["call_1"], tenant="a")
    store.record("bye", [7], "s", ["call_2"])
    for reopen in (False, True):  # in memory, then from disk
        if reopen:
            store.close()
            store = ReplayStore(str(tmp_path))
        assert store.by_text("hello", "a").ids == (5, 6) and store.by_calls(["call_1"], "s", "a").ids == (5, 6)
        assert store.by_text("hello") is None and store.by_text("hello", "b") is None
        assert store.by_calls(["call_1"], "s") is None and store.by_calls(["call_1"], "s", "b") is None
        assert store.by_text("bye").ids == (7,) and store.by_text("bye", "a") is None
