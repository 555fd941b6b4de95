"""Continuous batching in the server's engine: many requests decode together, each exactly as if
it ran alone (checked against `ds4_torch.generate` on the same model), conversations stay
resident between requests, and failures in a batched step are retried per request."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import time

import httpx
import pytest
import torch

from ds4_torch.faults import reset_fault_counts
from ds4_torch.generation import generate
from helpers import MODEL, held_state, metric, prompt_ids, server, wait_for

CTX = 256
CHUNK = 32


def batch_server(model, **config):
    return server(model, **{"ctx": CTX, "prefill_chunk": CHUNK, **config})


@pytest.fixture(scope="module")
def srv(model):
    with batch_server(model) as s:
        yield s



def reference(model, ids, n):
    """The sequential greedy continuation (no EOS stop, as `ignore_eos` asks)."""
    return list(generate(model, ids, n))


def complete(srv, ids, n, **extra):
    body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    return r


def concurrently(fn, args_list):
    with concurrent.futures.ThreadPoolExecutor(len(args_list)) as pool:
        return list(pool.map(lambda a: fn(*a), args_list))


_blockers = iter(range(1000, 10**6))


@contextlib.contextmanager
def queued_behind_a_long_prefill(srv):
    """Keep the engine prefilling a blocker, so requests sent meanwhile all queue and are then
    admitted one per iteration: deterministic batch growth."""
    engine = srv.app.state.engine
    engine.chunk_delay = 0.05
    pool = concurrent.futures.ThreadPoolExecutor(1)
    blocker = pool.submit(complete, srv, prompt_ids(6 * CHUNK, next(_blockers)), 1)  # never resident yet
    wait_for(lambda: engine.prefilling is not None, what="the blocker's prefill")
    try:
        yield
    finally:
        engine.chunk_delay = 0.0
        assert blocker.result().status_code == 200
        pool.shutdown()


# --------------------------------------------------------------------------- exactness
def test_concurrent_greedy_requests_equal_their_sequential_outputs(srv, model):
    lengths = (5, 17, 33, 40, 61, 9, 70, 3)  # different prompt lengths, crossing chunk and window edges
    prompts = [prompt_ids(n, i) for i, n in enumerate(lengths)]
    batch0 = metric(srv, "ds4_batch_size_count"), metric(srv, "ds4_batch_size_sum")
    with queued_behind_a_long_prefill(srv):
        futures = concurrently(lambda ids: complete(srv, ids, 24), [(p,) for p in prompts])
    for ids, r in zip(prompts, futures):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == reference(model, ids, 24)
    steps = metric(srv, "ds4_batch_size_count") - batch0[0]
    rows = metric(srv, "ds4_batch_size_sum") - batch0[1]
    assert rows / steps > 4, f"mean batch {rows / steps:.2f}: the requests did not decode together"


def test_sampled_requests_do_not_depend_on_their_neighbours(srv):
    """A seeded sampled request gives the same tokens alone and inside a batch of others."""
    ids = prompt_ids(20, 7)
    body = dict(temperature=1.0, top_k=50, seed=1234)
    alone = complete(srv, ids, 16, **body).json()["choices"][0]["token_ids"]
    with queued_behind_a_long_prefill(srv):
        results = concurrently(lambda p, extra: complete(srv, p, 16, **extra),
                               [(prompt_ids(30, 8), {}), (ids, body), (prompt_ids(12, 9), dict(temperature=0.7)),
                                (ids, body)])
    assert results[1].json()["choices"][0]["token_ids"] == alone
    assert results[3].json()["choices"][0]["token_ids"] == alone


# --------------------------------------------------------------------------- resident sessions
def test_conversation_resumed_after_others_reuses_its_whole_history(srv, model):
    a = prompt_ids(50, 20)
    first = complete(srv, a, 12).json()
    reply = first["choices"][0]["token_ids"]
    for salt in (21, 22, 23):  # other conversations use the server meanwhile
        assert complete(srv, prompt_ids(40, salt), 8).status_code == 200
    follow_up = a + reply + prompt_ids(9, 24)
    again = complete(srv, follow_up, 6).json()
    # Everything the session fed: the prompt and the reply but its last token (sampled, never fed).
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(a) + len(reply) - 1
    assert again["choices"][0]["token_ids"] == reference(model, follow_up, 6)


def test_idle_resident_session_is_untouched_by_other_decodes(srv):
    engine = srv.app.state.engine
    a = prompt_ids(45, 30)
    assert complete(srv, a, 10).status_code == 200
    session = next(s for s in engine.sessions if s.tokens[:len(a)] == a)
    before = held_state(engine.resident, session.slot)
    tokens_before = list(session.tokens)
    with queued_behind_a_long_prefill(srv):
        concurrently(lambda ids: complete(srv, ids, 20), [(prompt_ids(33, s),) for s in (31, 32, 33)])
    assert session.tokens == tokens_before
    after = held_state(engine.resident, session.slot)
    assert all(torch.equal(x, y) for x, y in zip(before, after)), "an idle session's cache changed"


def test_busy_session_is_forked_not_shared(srv, model):
    """The same prompt twice at once: the second request copies the first's session (busy
    decoding) into a slot of its own and skips the prefill; both give the sequential tokens."""
    ids = prompt_ids(90, 40)
    with queued_behind_a_long_prefill(srv):
        chunks0 = metric(srv, "ds4_prefill_chunks_total")
        r1, r2 = concurrently(lambda n: complete(srv, ids, n), [(12,), (10,)])
    assert r1.json()["choices"][0]["token_ids"] == reference(model, ids, 12)
    assert r2.json()["choices"][0]["token_ids"] == reference(model, ids, 10)
    cached = sorted(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (r1, r2))
    assert cached == [0, len(ids)]
    # The blocker's 6 chunks (some counted before chunks0) and the prompt's 3 chunks, prefilled once.
    assert metric(srv, "ds4_prefill_chunks_total") - chunks0 <= 6 + 3


def test_lru_eviction_snapshots_to_disk_and_restores(model, tmp_path):
    from serve.kvstore.store import KVStore

    store = KVStore(tmp_path / "kv", 64, model, ctx=CTX, min_tokens=1)
    with batch_server(model, kv_store=store, max_batch=2, max_sessions=2) as s:
        a, b, c = prompt_ids(40, 50), prompt_ids(41, 51), prompt_ids(42, 52)
        reply_a = complete(s, a, 6).json()["choices"][0]["token_ids"]
        assert complete(s, b, 6).status_code == 200
        assert complete(s, c, 6).status_code == 200  # two slots: a, the least recently used, goes
        assert metric(s, "ds4_session_evictions_total") >= 1
        assert not any(t[:len(a)] == a for t in s.app.state.engine.resident_tokens())
        s.app.state.engine.flush_snapshots()
        follow_up = a + reply_a + [9]
        r = complete(s, follow_up, 4).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(a) + len(reply_a) - 1  # from disk
        assert r["choices"][0]["token_ids"] == reference(model, follow_up, 4)
        assert store.counts.hits >= 1


# --------------------------------------------------------------------------- cancellation
def test_cancelled_stream_leaves_the_others_exact(srv, model):
    prompts = [prompt_ids(20 + 7 * i, 60 + i) for i in range(4)]

    def stream(ids, cancel_after):
        got = []
        body = {"model": MODEL, "prompt": ids, "max_tokens": 30, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream": True}
        with httpx.Client(timeout=120) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += json.loads(line[6:])["choices"][0].get("token_ids", []) if json.loads(line[6:])[
                        "choices"] else []
                if cancel_after is not None and len(got) >= cancel_after:
                    break  # leaving the block closes the connection: the client is gone
        return got

    aborted0 = metric(srv, "ds4_requests_aborted_total", stage="decode")
    srv.app.state.engine.token_delay = 0.01
    try:
        with queued_behind_a_long_prefill(srv):
            results = concurrently(stream, [(p, 3 if i == 1 else None) for i, p in enumerate(prompts)])
    finally:
        srv.app.state.engine.token_delay = 0.0
    for i, (ids, got) in enumerate(zip(prompts, results)):
        if i != 1:
            assert got == reference(model, ids, 30)
    wait_for(srv.app.state.engine.idle, what="the engine to go idle")
    assert metric(srv, "ds4_requests_aborted_total", stage="decode") == aborted0 + 1


# --------------------------------------------------------------------------- faults
def test_fault_in_a_batched_step_retries_every_request(srv, model, monkeypatch):
    prompts = [prompt_ids(15 + 10 * i, 70 + i) for i in range(4)]
    errors0, resets0 = metric(srv, "ds4_device_errors_total"), metric(srv, "ds4_engine_resets_total")
    reset_fault_counts()
    monkeypatch.setenv("DS4_TORCH_FAULT", "decode:6:device")  # the 6th step: all four are decoding
    with queued_behind_a_long_prefill(srv):
        results = concurrently(lambda ids: complete(srv, ids, 16), [(p,) for p in prompts])
    for ids, r in zip(prompts, results):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == reference(model, ids, 16)
    assert metric(srv, "ds4_device_errors_total") == errors0 + 1
    assert metric(srv, "ds4_engine_resets_total") == resets0 + 1


def test_persistent_fault_answers_503_and_the_server_lives(model, monkeypatch):
    with batch_server(model) as s:
        reset_fault_counts()
        monkeypatch.setenv("DS4_TORCH_FAULT", "decode:1:oom:always")
        results = concurrently(lambda ids: complete(s, ids, 8), [(prompt_ids(20, 80 + i),) for i in range(3)])
        for r in results:
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
        assert httpx.get(s.url + "/health").status_code == 503  # degraded until a request succeeds
        monkeypatch.delenv("DS4_TORCH_FAULT")
        ids = prompt_ids(20, 80)
        r = complete(s, ids, 8)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference(model, ids, 8)
        assert httpx.get(s.url + "/health").status_code == 200


# --------------------------------------------------------------------------- graph mode
def test_graph_mode_equals_eager_as_the_batch_grows_and_shrinks(model):
    """Requests of different lengths arrive together and finish apart: the batch goes 1, 2, .., 5
    and back down; graph mode (captured per power-of-two bucket, padded with scratch rows) gives
    the sequential tokens, as eager does (eager's growing and shrinking batch against the same
    reference: test_concurrent_greedy_requests_equal_their_sequential_outputs)."""
    jobs = [(prompt_ids(10 + 9 * i, 90 + i), n) for i, n in enumerate((3, 14, 7, 20, 5))]
    with batch_server(model, decode_mode="graph") as s:
        with queued_behind_a_long_prefill(s):
            results = concurrently(lambda ids, n: complete(s, ids, n), jobs)
        buckets = set(s.app.state.engine.decoder.graphs)
        assert buckets <= {1, 2, 4, 8} and len(buckets) >= 3, buckets
    assert [r.json()["choices"][0]["token_ids"] for r in results] == [reference(model, ids, n) for ids, n in jobs]


# --------------------------------------------------------------------------- benchmark
def test_bench_serve_prints_every_client_count(tmp_path, capsys, monkeypatch):
    from ds4_torch.bench import serve as bench_serve
    from ds4_torch.cli import main

    floors = []  # what the model alone decoded, per client count

    def recorded_floor(*args, **kwargs):
        floors.append(model_floor(*args, **kwargs))
        return floors[-1]

    model_floor = bench_serve.model_floor
    monkeypatch.setattr(bench_serve, "model_floor", recorded_floor)
    table = tmp_path / "serve.csv"
    rc = main(["bench", "serve", "--clients", "1", "2", "--new-tokens", "4", "--prompt-len", "16",
               "--prefill-chunk", "16", "--stall-prompt-len", "48", "--stall-clients", "2", "--repeat", "1",
               "--threads", "1", "--csv", str(table)])
    out = capsys.readouterr().out
    assert rc == 0
    rows = table.read_text().splitlines()
    assert rows[0].startswith("clients,") and "tok_s_total" in rows[0].split(",")
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2"]
    assert "48-token prompt arriving while 2 streams decode" in out
    # the model alone decodes what its arguments ask: the streams' 3 steps after the first token, --repeat 1 time
    assert [[len(row) for row in f["tokens"]] for f in floors] == [[1 + 3], [1 + 3] * 2]
    header = rows[0].split(",")
    for column in ("host_us_per_seq_step", "mean_batch", "step_model_ms", "step_sampling_ms", "step_host_ms",
                   "client_cores", "loop_us_per_token", "api_us_per_token", "core_step_ms", "alone_tok_s"):
        assert column in header, column
    for row in rows[1:]:
        values = dict(zip(header, row.split(",")))
        assert values["engine_core"] == "process"  # as `serve` runs it, by default
        assert 0 < float(values["host_us_per_seq_step"]) < 1e6 and float(values["step_model_ms"]) > 0
        # the API process's CPU: its event loop and the thread reading the core's messages
        assert float(values["api_us_per_token"]) > float(values["loop_us_per_token"]) > 0 or \
            not hasattr(time, "pthread_getcpuclockid")
        assert 0 < float(values["client_cores"]) <= os.cpu_count()
        # NaN where the platform cannot read another thread's CPU clock (macOS)
        assert float(values["loop_us_per_token"]) > 0 or not hasattr(time, "pthread_getcpuclockid")
    assert "the engine alone" in out
    floor = out.split("the model alone")[1].splitlines()[2:4]
    assert [line.split()[0] for line in floor] == ["1", "2"]


def test_model_floor_is_the_models_own_work(model):
    """`model_floor`: the batch's prompts prefilled at once, then decode steps of every row, each
    row continuing exactly as greedy generation of its prompt alone; its tok/s is new tokens per
    stream over prefill + (new - 1) steps."""
    from ds4_torch.bench.serve import model_floor

    prompts = [list(range(10, 26)), list(range(30, 46)), list(range(50, 66))]
    r = model_floor(model, prompts, new_tokens=8, chunk=8, steps=2, repeat=2)
    assert r["tokens"] == [reference(model, p, 5) for p in prompts]
    assert r["clients"] == 3 and r["prefill_s"] > 0 and r["step_ms"] > 0
    assert r["tok_s_total"] == pytest.approx(3 * 8 / (r["prefill_s"] + 7 * r["step_ms"] / 1000))


def test_bench_serve_compares_speculation_in_the_same_run(tmp_path, capsys):
    """`--speculative-tokens 0 2`: one table per value (the speculating one with the acceptance
    length: tokens per verify step, >= 1, at most 1 + 2) and a line comparing the totals. One
    client count: a table of every count is test_bench_serve_prints_every_client_count's."""
    from ds4_torch.cli import main

    table = tmp_path / "serve.csv"
    rc = main(["bench", "serve", "--clients", "1", "--new-tokens", "6", "--prompt-len", "16",
               "--prefill-chunk", "16", "--stall-prompt-len", "0", "--repeat", "1", "--threads", "1",
               "--speculative-tokens", "0", "2", "--engine-core", "thread", "--csv", str(table)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--speculative-tokens 2 against 0, total tok/s: 1 client(s)" in out and "accept len" in out
    rows = [dict(zip(*(line.split(",") for line in (table.read_text().splitlines()[0], row))))
            for row in table.read_text().splitlines()[1:]]
    assert [(r["clients"], r["speculative_tokens"]) for r in rows] == [("1", "0"), ("1", "2")]
    for r in rows[1:]:
        assert 1.0 <= float(r["acceptance_length"]) <= 3.0
