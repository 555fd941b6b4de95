"""Client metadata stays out of the prompt, and every request says what it reused of the cache and
why not more (`serve.engine.reuse`, shown by `serve.http.cache_explain`).

Claude Code's first two requests of two tasks (`tests/data/clients/minimal-claude-code-billing-
header-*.json`) share their system prompt once the billing header is left out. Five misses are built
on purpose (an edited early turn, an evicted conversation, another API key, a conversation the
KV pool pushed out, a divergence before the first checkpoint) and each report must name its cause,
with `reused` equal to what `usage` says was cached. The expected positions come from the token ids
the library's own encoding gives (`tokenizer.encode_chat`) or the test's own token lists.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx
import pytest

from ds4_torch.paged import block_nbytes
from helpers import MODEL, metric, prompt_ids, server, wait_idle

DATA = Path(__file__).resolve().parents[2] / "data" / "clients"
BILLING = [json.loads((DATA / f"minimal-claude-code-billing-header-{x}.json").read_text())["body"] for x in "ab"]


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def report_of(srv, r, key=None) -> dict:
    """The report of response `r` (asked for with x-ds4-cache), read back from the explain endpoint."""
    assert r.status_code == 200, r.text
    m = re.match(r"request=([0-9a-f]+); ", r.headers["x-ds4-cache"])
    assert m, r.headers["x-ds4-cache"]
    got = httpx.get(f"{srv.url}/v1/cache/explain/{m.group(1)}", headers=auth(key))
    assert got.status_code == 200, got.text
    report = got.json()
    assert r.headers["x-ds4-cache"].startswith(f"request={report['request']}; prompt={report['prompt']}; "
                                               f"reused={report['reused']}; source={report['source']}; "
                                               f"reason={report['reason']}")
    return report


def auth(key):
    return {"x-ds4-cache": "1", **({"Authorization": f"Bearer {key}"} if key else {})}


def complete(srv, ids, n=4, key=None):
    body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=auth(key), timeout=300)
    assert r.status_code == 200, r.text
    return r


def cached(r) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def sse_usage(r) -> dict:
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return [e for e in events if e.get("type") == "message_delta"][-1]["usage"]


# --------------------------------------------------------------------------- client metadata
def test_two_claude_code_tasks_share_their_system_prompt(tok):
    """Task b's first request reuses everything task a's shared with it: the system prompt up to
    the user turn. What the model saw (usage and count_tokens) holds no billing header."""
    expected = [tok.encode_chat([{"role": "system", "content": b["text"]} for b in body["system"][1:]] +
                                [{"role": "user", "content": body["messages"][0]["content"][0]["text"]}])
                for body in BILLING]
    shared = common(*expected)
    system_only = len(tok.encode_chat([{"role": "system", "content": b["text"]} for b in BILLING[0]["system"][1:]],
                                      add_generation_prompt=False))
    assert shared >= system_only > 400  # the instructions and the user turn's marker
    with server(ctx=4096) as srv:
        replies = []
        for body, ids in zip(BILLING, expected):
            r = httpx.post(srv.url + "/v1/messages", json=dict(body, max_tokens=4), headers=auth(None), timeout=300)
            usage = sse_usage(r)
            assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(ids)
            counted = httpx.post(srv.url + "/v1/messages/count_tokens", json=body).json()
            assert counted["input_tokens"] == len(ids)
            replies.append((r, usage))
        (_, first), (second, usage) = replies
        assert first["cache_read_input_tokens"] == 0
        assert usage["cache_read_input_tokens"] == shared
        report = report_of(srv, second)
        assert (report["reused"], report["source"], report["reason"]) == (shared, "checkpoint", "full")


def test_codex_client_metadata_and_anthropic_metadata_stay_out_of_the_prompt():
    """Codex's `client_metadata` (window and thread ids) and Anthropic's `metadata` change nothing the
    model sees: the same prompt token count, and a repeat of the request reuses the whole prompt
    (its end was checkpointed with its logits)."""
    codex = json.loads((DATA / "minimal-codex-client-metadata.json").read_text())["body"]
    claude = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with server(ctx=1024) as srv:
        plain = dict(codex)
        del plain["client_metadata"]
        counts = []
        for body in (plain, codex, dict(codex, client_metadata={"x-codex-window-id": "w:9", "thread_id": "u"})):
            r = httpx.post(srv.url + "/v1/responses", json=dict(body, max_output_tokens=2), timeout=120)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            counts.append((usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]))
        n = counts[0][0]
        assert counts == [(n, 0), (n, n), (n, n)]
        for meta in ({"user_id": "session_a"}, {"user_id": "session_b"}):
            counted = httpx.post(srv.url + "/v1/messages/count_tokens", json=dict(claude, metadata=meta)).json()
            assert counted == httpx.post(srv.url + "/v1/messages/count_tokens", json=claude).json()


def test_a_later_system_message_stays_where_it_is():
    """Only the leading `system` blocks are checked for client metadata; a system message inside
    the conversation (Claude Code's reminders) is rendered where it stands, whatever it says."""
    from ds4_torch.default_model import default_tokenizer

    tok = default_tokenizer()
    note = "x-anthropic-billing-header: a note the user wrote"
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"},
                                                          {"role": "system", "content": note}]}
    want = len(tok.encode_chat([{"role": "user", "content": "hi"}, {"role": "system", "content": note}]))
    with server(ctx=1024) as srv:
        assert httpx.post(srv.url + "/v1/messages/count_tokens", json=body).json()["input_tokens"] == want


# --------------------------------------------------------------------------- why not more
def chat(srv, messages, key=None):
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=auth(key), timeout=300)
    assert r.status_code == 200, r.text
    return r


def test_an_edited_early_turn_is_named_where_it_diverged(tok, capsys):
    """A conversation sent again with its first user turn edited in the middle: the report gives
    the position of the first token that differs, the text before it and both sides' words, and
    reuse goes back to the checkpoint at that turn's start."""
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    turn = "Please look at the garden plan and tell me which {} should be planted first, and why."
    convo = [system, {"role": "user", "content": turn.format("flowers")},
             {"role": "assistant", "content": "The roses."}, {"role": "user", "content": "Thanks, and then?"}]
    edited = [convo[0], {"role": "user", "content": turn.format("vegetables")}, *convo[2:]]
    ids = [tok.encode_chat(c) for c in (convo, edited)]
    p = common(*ids)
    turn_start = ids[0].index(tok.encode("<｜User｜>", add_special_tokens=False)[0]) + 1
    assert turn_start < p < len(ids[1]) - 10
    with server(ctx=2048, checkpoint_interval=4096) as srv:  # checkpoints at message starts only
        chat(srv, convo)
        r = chat(srv, edited)
        report = report_of(srv, r)
        from ds4_torch.cli import main  # the operator's command, asking the server for the same report

        assert main(["cache-explain", report["request"], "--url", srv.url]) == 0
        said = capsys.readouterr().out
        assert main(["cache-explain", "nope", "--url", srv.url]) == 2
        assert "404: no cache report for request 'nope'" in capsys.readouterr().err
    assert f"{report['reused']:,} of {report['prompt']:,} prompt tokens reused, from a checkpoint" in said
    assert f"it differs from this one at token {p}" in said and "(diverged)" in said
    assert f"this prompt: {json.dumps(report['ours'], ensure_ascii=False)}" in said
    assert report["reused"] == r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == turn_start
    assert (report["reason"], report["source"], report["diverged_at"], report["shared"]) == \
        ("diverged", "checkpoint", p, p)
    assert report["before"] == tok.decode(ids[1][p - 8:p])
    assert report["ours"].startswith(tok.decode(ids[1][p:p + 2])) and report["theirs"].startswith(
        tok.decode(ids[0][p:p + 2]))
    assert "veg" in report["ours"] and "flow" in report["theirs"]


def test_a_divergence_before_the_first_checkpoint_reuses_nothing_and_says_so():
    first = prompt_ids(300, 1)
    second = first[:100] + prompt_ids(50, 2)
    with server(ctx=1024, checkpoint_interval=256) as srv:  # checkpoints of the first: 256 and its end
        complete(srv, first)
        r = complete(srv, second)
        report = report_of(srv, r)
    assert report["reused"] == cached(r) == 0
    assert (report["reason"], report["source"], report["diverged_at"], report["shared"]) == \
        ("no_checkpoint", "none", 100, 100)


@pytest.mark.parametrize("disk", [False, True], ids=["gone", "on-disk"])
def test_an_evicted_conversation_is_named(model, tmp_path, disk):
    """One resident session: a second conversation pushes the first out. Its follow-up reuses
    nothing (`evicted`), or, with a disk store, everything it had (restored from `disk`)."""
    from serve.kvstore.store import KVStore

    store = KVStore(tmp_path / "kv", 64, model, ctx=1024, min_tokens=1) if disk else None
    a = prompt_ids(120, 3)
    with server(model, kv_store=store, ctx=1024, max_batch=1, max_sessions=1) as srv:
        reply = complete(srv, a, 6).json()["choices"][0]["token_ids"]
        complete(srv, prompt_ids(80, 4))
        wait_idle(srv)
        held = len(a) + len(reply) - 1  # the session held the prompt and the reply but its last token
        r = complete(srv, a + reply + prompt_ids(10, 5))
        report = report_of(srv, r)
        assert metric(srv, "ds4_session_evictions_total") >= 1
    assert report["reused"] == cached(r)
    if disk:
        assert (report["reused"], report["source"], report["reason"]) == (held, "disk", "full")
    else:
        assert (report["reused"], report["source"], report["reason"], report["shared"]) == \
            (0, "none", "evicted", held)
        assert "diverged_at" not in report  # the follow-up extends it: nothing differs


def test_a_conversation_the_pool_pushed_out_is_named_pool(model):
    """A pool of 24 blocks of 32 tokens: a 200-token conversation, then a 600-token prompt that
    needs most of the pool. The first conversation leaves for its blocks (every session slot is
    free), and its follow-up's report says so."""
    bt = 32
    block_mb = block_nbytes(model.config, model.dtype, bt) / 2**20
    a, big = prompt_ids(200, 6), prompt_ids(600, 7)
    with server(model, ctx=1024, kv_block_tokens=bt, kv_cache_mb=24 * block_mb, max_sessions=8,
                prefill_chunk=64) as srv:
        reply = complete(srv, a, 4).json()["choices"][0]["token_ids"]
        complete(srv, big)
        r = complete(srv, a + reply + prompt_ids(8, 8))
        report = report_of(srv, r)
        assert metric(srv, "ds4_prompt_reuse_total", reason="pool") == 1
    assert (report["reused"], report["source"], report["reason"], report["shared"]) == \
        (cached(r), "none", "pool", len(a) + len(reply) - 1)


def test_another_keys_prompt_is_the_operators_to_see(caplog):
    """Reuse never crosses API keys. The second key's request reports `new` to its client (its
    own tenant had nothing), the access log and /metrics say `other_tenant` with how much the
    other key's prompt shared, and the first key cannot read the second's report."""
    prompt = prompt_ids(200, 9)
    with server(ctx=1024, api_key=("k1", "k2")) as srv:
        complete(srv, prompt, key="k1")
        with caplog.at_level(logging.INFO, logger="ds4.serve"):
            r = complete(srv, prompt, key="k2")
            report = report_of(srv, r, key="k2")
        assert metric(srv, "ds4_prompt_reuse_total", reason="other_tenant") == 1
        m = re.search(r"x-ds4-cache: request=([0-9a-f]+)", "x-ds4-cache: " + r.headers["x-ds4-cache"])
        assert httpx.get(f"{srv.url}/v1/cache/explain/{m.group(1)}", headers=auth("k1")).status_code == 404
        again = complete(srv, prompt + prompt_ids(5, 10), key="k2")
        assert report_of(srv, again, key="k2")["reason"] == "full"
    assert (report["reused"], report["source"], report["reason"]) == (cached(r), "none", "new") == (0, "none", "new")
    assert "other_tenant" not in report and "other_tenant" not in r.headers["x-ds4-cache"]
    line = next(rec.getMessage() for rec in caplog.records if f"id={report['request']}" in rec.getMessage())
    assert "reuse_source=none reuse_reason=other_tenant other_tenant_shared=200" in line


def test_a_follow_up_reuses_its_whole_conversation_and_reports_full():
    a = prompt_ids(150, 11)
    with server(ctx=1024) as srv:
        reply = complete(srv, a, 5).json()["choices"][0]["token_ids"]
        r = complete(srv, a + reply + prompt_ids(6, 12))
        report = report_of(srv, r)
        plain = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": a, "max_tokens": 1})
        assert "x-ds4-cache" not in plain.headers  # only when asked for
        assert metric(srv, "ds4_reused_prompt_tokens_total", source="session") == report["reused"]
    assert (report["reused"], report["source"], report["reason"]) == (cached(r), "session", "full")
    assert report["reused"] == len(a) + len(reply) - 1


def test_an_unknown_request_id_is_a_404_naming_it():
    with server(ctx=512) as srv:
        r = httpx.get(f"{srv.url}/v1/cache/explain/nope")
        assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"]
