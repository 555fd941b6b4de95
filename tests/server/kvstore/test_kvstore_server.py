"""The disk KV cache through the server: real `python -m serve` processes killed with SIGKILL
in the middle of a snapshot write and restarted, a conversation continued across a clean
restart, damaged snapshots and injected post-restore failures served by a clean prefill, the
budget under many conversations."""
from __future__ import annotations

import contextlib
import os
import re
import threading

import httpx
import pytest

from ds4_torch import faults
from serve.http.app import ServerConfig, create_app
import serve.engine.loop
from serve.engine.sessions import SNAPSHOT_QUEUE
from serve.kvstore.store import WRITE_DELAY_ENV
from serve.http.chat import dsml_tokens
from helpers import (MODEL, expected, greedy_completion, interrupt, metric, random_prompt, serve_process, server,
                     wait_for, wait_idle)

CTX, CHUNK = 512, 32
SYSTEM = "You are a player in a company of actors. Answer in the manner of the age, briefly."


# --------------------------------------------------------------------------- helpers
def process(kv_dir, env_extra=None):
    return serve_process("--ctx", str(CTX), "--prefill-chunk", str(CHUNK), "--kv-disk-dir", str(kv_dir),
                         "--kv-disk-space-mb", "16", "--kv-disk-min-tokens", "8", env_extra=env_extra)


def stop(proc) -> str:
    """Clean shutdown (SIGINT, as Ctrl-C): the engine saves the live conversation."""
    return interrupt(proc)


def chat(url, messages, n=12):
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def quietly(fn, *args):
    with contextlib.suppress(Exception):
        fn(*args)


def snapshots(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".ds4kv"))


def temps(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith(".tmp-"))


# --------------------------------------------------------------------------- real processes
def test_kill9_mid_write_then_clean_restart_cycle(tmp_path, model, tok):
    d = tmp_path / "kv"
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What news on the Rialto?"}]

    # 1. A write made slow (test hook: sleep between sections); SIGKILL once its temp file exists.
    with process(d, {"DS4_TORCH_KV_WRITE_DELAY": "0.5"}) as p:
        threading.Thread(target=quietly, args=(chat, p.url, turn1), daemon=True).start()
        wait_for(lambda: temps(d), 30, "a snapshot's temporary file")
        p.kill()
        p.wait(10)
    assert temps(d) and not snapshots(d)  # half a file under a temporary name, no visible snapshot

    # 2. Restart: the stale temporary file goes; serve turn 1; clean shutdown saves the conversation.
    with process(d) as p:
        assert not temps(d)
        first, cached = chat(p.url, turn1)
        assert cached == 0
        log = stop(p)
    assert "saved" in log and "(shutdown" in log, log
    assert snapshots(d) and not temps(d)

    # 3. Restart: the conversation continues from disk, with the output it has without a restart.
    turn2 = turn1 + [{"role": "assistant", "content": first["message"]["content"]},
                     {"role": "user", "content": "Why, then the world's mine oyster."}]
    ids2 = tok.encode_chat(turn2)
    want, _ = expected(model, tok, ids2, 12, forbidden=dsml_tokens(tok)[0])  # a chat with no tools: no DSML tags
    with process(d) as p:
        second, cached = chat(p.url, turn2)
        metrics = httpx.get(p.url + "/metrics").text
        stop(p)
    # the shutdown snapshot: turn 1's prompt and the 11 generated tokens fed back (the 12th was not)
    assert cached == len(tok.encode_chat(turn1)) + 11
    assert second["token_ids"] == want
    assert re.search(r"^ds4_kv_disk_hits_total 1\.0$", metrics, re.M), metrics


# --------------------------------------------------------------------------- in-process servers
@contextlib.contextmanager
def disk_server(model, tok, kv_dir, space_mb=8.0, serving=None, **kw):
    # Checkpoints off: a prompt sent again is not resumed from the live cache, so these tests reach the disk.
    with server(model, tok, ctx=CTX, prefill_chunk=CHUNK, checkpoint_interval=0, **(serving or {}),
                kv_disk=dict(dir=kv_dir, space_mb=space_mb, min_tokens=8, **kw)) as srv:
        srv.store = srv.app.state.engine.kv_store
        yield srv


def test_damaged_snapshot_served_by_clean_prefill(tmp_path, model, tok):
    a, b = random_prompt(1), random_prompt(2)
    want, _ = expected(model, tok, a, 8)
    with disk_server(model, tok, tmp_path / "kv") as srv:
        assert greedy_completion(srv, a) == (want, 0)
        assert greedy_completion(srv, b)[1] == 0          # replaces the live cache (a's state is saved)
        wait_idle(srv)
        name = srv.store._name(a)
        path = os.path.join(srv.store.dir, name)
        data = bytearray(open(path, "rb").read())
        data[len(data) - 100] ^= 0x10
        open(path, "wb").write(data)
        assert greedy_completion(srv, a) == (want, 0)     # rejected: served by a clean prefill, no error
        assert srv.store.last_rejection[:2] == (name, "checksum")
        assert greedy_completion(srv, b)[1] > 0           # b comes back from disk
        got = greedy_completion(srv, a)                   # a's fresh snapshot (written after the clean prefill)
        assert got == (want, len(a))
        assert srv.app.state.metrics.value("ds4_kv_disk_rejected_total", reason="checksum") == 1
        assert srv.app.state.metrics.value("ds4_device_errors_total") == 0


def test_injected_post_restore_failure(tmp_path, model, tok, monkeypatch):
    a, b = random_prompt(3), random_prompt(4)
    want, _ = expected(model, tok, a + [5], 8)
    faults.reset_fault_counts()
    with disk_server(model, tok, tmp_path / "kv") as srv:
        greedy_completion(srv, a)
        greedy_completion(srv, b)
        wait_idle(srv)
        monkeypatch.setenv("DS4_TORCH_FAULT", "restore:1")
        assert greedy_completion(srv, a + [5]) == (want, 0)   # restore of a, first step fails, clean prefill
        assert srv.store.counts.rejected == {"restore_failed": 1}
        assert len(srv.store.quarantined()) == 1
        assert srv.app.state.engine.degraded is None
        assert srv.app.state.metrics.value("ds4_kv_disk_rejected_total", reason="restore_failed") == 1
        monkeypatch.delenv("DS4_TORCH_FAULT")
    faults.reset_fault_counts()
    monkeypatch.setenv("DS4_TORCH_FAULT", "restore:1:device:always")  # any further restore would fail
    with disk_server(model, tok, tmp_path / "kv") as srv:   # restart: the quarantined file is never tried again
        assert srv.store.counts.rejected == {}
        tried = set(srv.store.entries)
        assert srv.store._name(a) not in tried and len(srv.store.quarantined()) == 1
        toks, cached = greedy_completion(srv, b + [7])   # b's snapshot, restored: fails (injected) and is rejected
        assert cached == 0 and srv.store.counts.rejected == {"restore_failed": 1}
        assert len(srv.store.quarantined()) == 2
    monkeypatch.delenv("DS4_TORCH_FAULT")
    faults.reset_fault_counts()


def test_a_failed_first_step_quarantines_its_own_snapshot(tmp_path, model, tok, monkeypatch):
    """Two snapshots restored and neither confirmed by a step yet (each request ended at its first
    token, sampled from the stored logits): the first step of the conversation restored from `a`
    fails (injected), and exactly `a`'s snapshot is quarantined, not the one restored last (`c`)."""
    a, c = random_prompt(5), random_prompt(6)
    want, _ = expected(model, tok, a + [5], 8)
    faults.reset_fault_counts()
    with disk_server(model, tok, tmp_path / "kv") as srv:
        greedy_completion(srv, a)
        greedy_completion(srv, c)
        wait_idle(srv)
        name_a, name_c = srv.store._name(a), srv.store._name(c)
        assert set(srv.store.entries) == {name_a, name_c}
        assert greedy_completion(srv, a, n=1)[1] == len(a)   # restored whole: no step before the reply ends
        assert greedy_completion(srv, c, n=1)[1] == len(c)
        monkeypatch.setenv("DS4_TORCH_FAULT", "restore:1")
        assert greedy_completion(srv, a + [5]) == (want, 0)  # resumes a's restored session: its first step fails
        monkeypatch.delenv("DS4_TORCH_FAULT")
        quarantined = srv.store.quarantined()
        assert len(quarantined) == 1 and quarantined[0].startswith(name_a + "."), quarantined
        assert name_c in srv.store.entries and os.path.exists(os.path.join(srv.store.dir, name_c))
        assert srv.store.counts.rejected == {"restore_failed": 1}
    faults.reset_fault_counts()


def test_a_conversation_on_disk_is_only_restored_for_its_own_key(tmp_path, model, tok):
    """Several API keys: a conversation pushed out of memory to disk, or saved before a restart,
    comes back for the key that had it and never for another (cached tokens 0 and a clean
    prefill, so neither usage nor latency tells another key what was said). Snapshots written
    without keys are not served to a key either."""
    d, p = tmp_path / "kv", random_prompt(51)
    want, _ = expected(model, tok, p, 8)
    keyed = {"api_key": ("key-a", "key-b", "key-c"), "max_batch": 1, "max_sessions": 1}
    with disk_server(model, tok, d) as srv:                   # no keys: a snapshot of no tenant
        assert greedy_completion(srv, p) == (want, 0)
        wait_idle(srv)
    with disk_server(model, tok, d, serving=keyed) as srv:
        assert greedy_completion(srv, p, key="key-a") == (want, 0)   # the keyless snapshot is not a's
        wait_idle(srv)
        assert greedy_completion(srv, p, key="key-b") == (want, 0)   # a's session goes to disk; b gets nothing of it
        wait_idle(srv)
        assert greedy_completion(srv, p, key="key-a") == (want, len(p))  # a's own, from disk (b's went there)
        wait_idle(srv)
        assert not any("key-" in name for name in os.listdir(d))
    with disk_server(model, tok, d, serving=keyed) as srv:   # a restart: the directory is indexed again
        assert greedy_completion(srv, p, key="key-c") == (want, 0)
        assert greedy_completion(srv, p, key="key-a") == (want, len(p))
        assert srv.store.counts.hits == 1
    with disk_server(model, tok, d) as srv:
        assert greedy_completion(srv, p) == (want, len(p))       # the keyless snapshot is still the keyless server's


def test_requests_waiting_for_one_snapshot_share_one_read(tmp_path, model, tok, monkeypatch):
    """Four requests queued behind a long one (max_batch 1), each continuing the same stored
    conversation: the snapshot is read from disk once and held once while they wait; each copy
    in host memory is gone once it is in the cache, while a request still decodes."""
    import gc
    import weakref

    import serve.kvstore.store as kvstore

    a, long = random_prompt(61), random_prompt(62)
    with disk_server(model, tok, tmp_path / "kv", serving={"max_batch": 1}) as srv:
        first, _ = greedy_completion(srv, a, n=2)
        wait_idle(srv)
        suffixes = [k for k in range(5, 30) if k != first[0]][:4]  # a's session (a + first[0]) is no prefix
        wants = {k: expected(model, tok, a + [k], 12)[0] for k in suffixes}
        read, copies = kvstore.read_snapshot, []

        def counted_read(*args, tokens_only=False, **kw):
            snap = read(*args, tokens_only=tokens_only, **kw)
            if not tokens_only:
                copies.append(weakref.ref(snap))
            return snap

        monkeypatch.setattr(kvstore, "read_snapshot", counted_read)
        engine = srv.app.state.engine
        engine.token_delay = 0.03
        results, threads = {}, []

        def send(k):
            results[k] = greedy_completion(srv, a + [k], n=12)

        threads.append(threading.Thread(target=lambda: greedy_completion(srv, long, n=16)))
        threads[0].start()
        wait_for(lambda: engine.running, what="the long request decoding")
        for k in suffixes:
            threads.append(threading.Thread(target=send, args=(k,)))
            threads[-1].start()
        wait_for(lambda: len(engine.scheduler) == len(suffixes), what="four requests queued")
        # All admitted, the last one decoding: every restore is done, no copy may be left.
        wait_for(lambda: not engine.scheduler.queue and not engine.scheduler.loading and engine.running
                 and engine.running[0].prompt_ids[:len(a)] == a, timeout=30, what="the last request decoding")
        gc.collect()
        alive = [ref for ref in copies if ref() is not None]
        still_decoding = bool(engine.running)
        for t in threads:
            t.join(60)
        engine.token_delay = 0.0
        assert len(copies) == 1, f"{len(copies)} reads of one snapshot"
        assert still_decoding and not alive, "a snapshot copy outlived its restore"
        assert srv.store.loaded_bytes == 0
        assert srv.app.state.metrics.value("ds4_kv_disk_loaded_bytes") == 0
        assert srv.app.state.metrics.value("ds4_kv_disk_reads_total") == 1
        assert {k: r for k, r in results.items()} == {k: (wants[k], len(a)) for k in suffixes}


@pytest.mark.parametrize("speculative", [0, 3], ids=["plain", "speculative"])
def test_periodic_snapshots_taken_mid_decode_continue_after_a_restart(tmp_path, model, tok, speculative):
    """`--kv-disk-every N` through the engine: while a reply decodes, its sequence is snapshotted
    from its batch slot every N tokens (speculating, after each step's rejected drafts went
    back). After a restart, prompts that continue two of those mid-decode snapshots are restored
    from them and answered as `generate()` answers the whole prompt: each snapshot's sequence
    itself (its first token comes from the stored logits), and one with a token added that the
    reply did not take (so no longer snapshot is a prefix of it)."""
    d, every, n = tmp_path / "kv", 8, 40
    p = random_prompt(71, 24)
    want, _ = expected(model, tok, p, n)
    serving = {"speculative_tokens": speculative, "speculative_policy": "always"} if speculative else {}
    with disk_server(model, tok, d, every=every, serving=serving) as srv:
        assert greedy_completion(srv, p, n=n) == (want, 0)
        wait_idle(srv)
        lengths = sorted(len(e.tokens) for e in srv.store.entries.values())
        if speculative:
            accepted = metric(srv, "ds4_spec_accepted_tokens_total")
            assert 0 < accepted < metric(srv, "ds4_spec_draft_tokens_total"), "no draft both accepted and rejected"
    # The prompt's snapshot, then one each time the sequence grew by `every` tokens while decoding.
    periodic = [k for k in lengths if len(p) < k]
    assert lengths[0] == len(p) and len(periodic) >= (n - 1) // every - 1, lengths
    assert all(b - a >= every for a, b in zip(lengths, lengths[1:])), lengths
    whole = p + want
    first, second = periodic[:2]  # each taken mid-decode, with the reply decoding on after it
    other = next(t for t in range(5, 50) if t != whole[second])
    extended = whole[:second] + [other]
    with disk_server(model, tok, d, serving=serving) as srv:  # a restart
        # Longest first: a shorter prompt then finds no live session it could resume (no checkpoints).
        assert greedy_completion(srv, extended, n=6) == (expected(model, tok, extended, 6)[0], second), lengths
        for k in (second, first):
            assert greedy_completion(srv, whole[:k], n=6) == (whole[k:k + 6], k), (k, lengths)
        assert srv.store.counts.hits == 3


def test_budget_holds_through_the_server(tmp_path, model, tok):
    with disk_server(model, tok, tmp_path / "kv", space_mb=0.3) as srv:
        for i in range(14):
            greedy_completion(srv, random_prompt(100 + i, 40 + 9 * i), n=2)
            wait_idle(srv)  # a write may exceed the budget by its file until its eviction
            assert srv.store.usage() <= srv.store.budget
        wait_idle(srv)
        metrics = httpx.get(srv.url + "/metrics").text
    total = sum(f.stat().st_size for f in (tmp_path / "kv").rglob("*") if f.is_file())
    assert total <= 0.3 * 2**20
    assert srv.store.counts.evictions > 0 and srv.store.counts.saves >= 14
    bytes_line = re.search(r"^ds4_kv_disk_bytes (\S+)$", metrics, re.M)
    assert bytes_line and 0 < float(bytes_line.group(1)) <= 0.3 * 2**20


def test_cli_flags_attach_a_store(tmp_path, model, tok):
    from ds4_torch.runtime import UserError
    from serve.cli import attach_kv_store, build_parser, check_flags

    args = build_parser().parse_args(["--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-space-mb", "3",
                                      "--kv-disk-every", "64", "--kv-disk-min-tokens", "20", "--ctx", "512"])
    app = create_app(model, tok, ServerConfig(ctx=512))
    store = attach_kv_store(app.state.engine, args)
    try:
        assert app.state.engine.kv_store is store
        assert (store.budget, store.every, store.min_tokens, store.layout.max_context) == (3 * 2**20, 64, 20, 512)
        assert app.state.metrics.value("ds4_kv_disk_bytes") == store.usage()
        with pytest.raises(UserError, match="in use by another process"):
            attach_kv_store(create_app(model, tok, ServerConfig(ctx=512)).state.engine, args)
    finally:
        store.close()
    with pytest.raises(UserError, match="needs --kv-disk-dir"):
        check_flags(build_parser().parse_args(["--kv-disk-space-mb", "3"]))
    assert attach_kv_store(app.state.engine, build_parser().parse_args([])) is None


def test_clean_shutdown_saves_every_conversation(tmp_path, model, tok, monkeypatch):
    """More live conversations than the writer's queue holds, each grown past its last snapshot,
    and a slow disk: a clean shutdown waits for the writer and saves every one."""
    prompts = [random_prompt(200 + i, 40) for i in range(16)]
    with disk_server(model, tok, tmp_path / "kv") as srv:
        assert srv.app.state.engine.max_sessions >= len(prompts) > SNAPSHOT_QUEUE + 1
        grown = [p + greedy_completion(srv, p, n=4)[0][:3] for p in prompts]  # the last token is not fed back
        wait_idle(srv)
        names = {srv.store._name(g) for g in grown}
        assert not names & set(srv.store.entries)  # only the prompts were saved so far
        monkeypatch.setenv(WRITE_DELAY_ENV, "0.01")  # the writer now falls behind the shutdown
    assert names <= set(srv.store.entries)
    assert set(snapshots(tmp_path / "kv")) >= names


def test_a_shutdown_that_cannot_save_everything_says_so(tmp_path, model, tok, monkeypatch, caplog):
    """No time left to save (a disk too slow for the shutdown's budget): the log names the
    conversations not saved, and none is written."""
    prompts = [random_prompt(300 + i, 40) for i in range(4)]
    with disk_server(model, tok, tmp_path / "kv") as srv:
        for p in prompts:
            greedy_completion(srv, p, n=4)
        wait_idle(srv)
        saved = set(snapshots(tmp_path / "kv"))
        monkeypatch.setattr(serve.engine.loop, "SHUTDOWN_SAVE_S", 0.0)
        caplog.set_level("WARNING", logger="ds4.serve")
    warned = [r.getMessage() for r in caplog.records if "not saved to disk" in r.getMessage()]
    assert len(warned) == 1 and "4 conversation(s)" in warned[0] and "(tokens: 43, 43, 43, 43)" in warned[0], warned
    assert set(snapshots(tmp_path / "kv")) == saved


def test_a_slow_snapshot_write_stalls_no_request(tmp_path, model, tok, monkeypatch):
    d = tmp_path / "kv"
    a, b = random_prompt(31), random_prompt(32)
    want, _ = expected(model, tok, b, 8)
    monkeypatch.setenv(WRITE_DELAY_ENV, "0.2")  # seconds between the sections of a write
    with disk_server(model, tok, d) as srv:
        greedy_completion(srv, a, n=2)
        wait_for(lambda: temps(d), what="a's snapshot being written")
        # b looks for a stored prefix, prefills and has its own snapshot prepared while a's is written.
        assert greedy_completion(srv, b) == (want, 0)
        assert srv.store.counts.saves == 0 and temps(d), "b waited for a's snapshot to be written"
        monkeypatch.delenv(WRITE_DELAY_ENV)
        wait_idle(srv)
        assert srv.store.counts.saves == 2


def test_a_slow_disk_read_stalls_no_stream(tmp_path, model, tok, monkeypatch):
    """A request restored from disk has its snapshot read and checked on the reader thread: while
    that read is held up, a stream beside it runs to its end; then the restored request is served
    from disk with the output it has without a restart."""
    import serve.kvstore.store as kvstore

    d = tmp_path / "kv"
    a, b = random_prompt(41), random_prompt(42)
    want, _ = expected(model, tok, a + [7], 8)
    with disk_server(model, tok, d) as srv:
        greedy_completion(srv, a)
        wait_idle(srv)
    gate, reading = threading.Event(), threading.Event()
    read = kvstore.read_snapshot

    def held_read(*args, **kw):
        reading.set()
        assert gate.wait(60)
        return read(*args, **kw)

    with disk_server(model, tok, d) as srv:  # a restart: `a` is on disk only
        monkeypatch.setattr(kvstore, "read_snapshot", held_read)  # (after the store indexed the directory)
        results = {}
        restored = threading.Thread(target=lambda: results.setdefault("a", greedy_completion(srv, a + [7])))
        restored.start()
        assert reading.wait(30)
        beside = threading.Thread(target=lambda: results.setdefault("b", greedy_completion(srv, b, n=24)))
        beside.start()
        beside.join(60)
        finished_while_held = not beside.is_alive()
        gate.set()
        beside.join(60)
        restored.join(60)
        assert finished_while_held, "the stream waited for another request's disk read"
        assert results["a"] == (want, len(a))
        assert len(results["b"][0]) == 24

