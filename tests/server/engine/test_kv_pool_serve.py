"""The server's paged KV pool through HTTP (`--kv-cache-mb`, `--kv-block-tokens`): a shared prefix
is stored once, memory follows live tokens, and a pool too small for what is asked of it makes
idle sessions leave, prompts wait and running requests pause, never a failure. Every reply is
checked against greedy decoding of the request alone (`ds4_torch.generate`), and the pool's
gauges against block counts worked out from the token counts."""
from __future__ import annotations

import concurrent.futures
import math

import httpx
import pytest

from ds4_torch.default_model import default_tokenizer
from ds4_torch.generation import generate
from ds4_torch.paged import block_nbytes
from helpers import MODEL, metric, prompt_ids, server

BT = 32  # tokens per block: small, so a few hundred tokens cross several blocks (the rates are 4 and 16)


@pytest.fixture(scope="module")
def block_mb(model):
    return block_nbytes(model.config, model.dtype, BT) / 2**20


def pool_server(model, **config):
    return server(model, **{"ctx": 512, "prefill_chunk": 64, "kv_block_tokens": BT, **config})


def complete(srv, ids, n):
    body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=300)


def concurrently(fn, args_list):
    with concurrent.futures.ThreadPoolExecutor(len(args_list)) as pool:
        return list(pool.map(lambda a: fn(*a), args_list))


_greedy: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _forget_greedy():
    yield
    _greedy.clear()


def greedy(model, ids, n) -> list[int]:
    """`generate`'s greedy tokens, computed once per prompt and length in this module (the
    parametrizations of one test ask for the same ones)."""
    key = (id(model), tuple(ids), n)  # (one model per module: the cache is cleared with it)
    if key not in _greedy:
        _greedy[key] = list(generate(model, ids, n))
    return _greedy[key]


def check_replies(model, prompts, replies, n):
    for ids, r in zip(prompts, replies):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == greedy(model, ids, n)


def blocks(tokens: int) -> int:
    return math.ceil(tokens / BT)


def test_a_shared_prefix_is_held_once(model):
    """Two conversations on one 200-token prefix: the second branches from the first's checkpoint
    at 192 and takes its 6 full blocks without copying them."""
    shared = prompt_ids(200, 1)
    prompts = [shared + prompt_ids(20, s) for s in (2, 3)]
    with pool_server(model, checkpoint_interval=64, max_sessions=8) as srv:
        assert metric(srv, "ds4_kv_block_tokens") == BT
        first = complete(srv, prompts[0], 8)
        second = complete(srv, prompts[1], 8)
        check_replies(model, prompts, [first, second], 8)
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
        # each session holds its prompt and reply but the reply's last token (sampled, never fed)
        held = blocks(len(prompts[0]) + 7)
        assert metric(srv, "ds4_kv_blocks_shared") == 192 // BT
        assert metric(srv, "ds4_kv_blocks_used") == 2 * held - 192 // BT


def test_chats_sent_at_once_on_one_system_prompt_fit_a_pool_holding_it_once(model, block_mb):
    """Six chats on a 640-token prefix, each with its own 40 tokens, at once into a pool of 40
    blocks (1,280 tokens): stored separately they would need 6 x 22 blocks. All are answered as
    alone, all stay resident, and the pool holds the prefix once."""
    shared = prompt_ids(640, 4)
    prompts = [shared + prompt_ids(40, 10 + s) for s in range(6)]
    with pool_server(model, ctx=1024, checkpoint_interval=128, max_sessions=8, max_batch=6,
                kv_cache_mb=40 * block_mb) as srv:
        assert metric(srv, "ds4_kv_blocks_total") == 40
        replies = concurrently(lambda ids: complete(srv, ids, 6), [(p,) for p in prompts])
        check_replies(model, prompts, replies, 6)
        assert metric(srv, "ds4_session_evictions_total") == 0 and metric(srv, "ds4_preemptions_total") == 0
        own = sum(len(p) + 5 - len(shared) for p in prompts)
        used = metric(srv, "ds4_kv_blocks_used")
        assert used <= 1.3 * (len(shared) + own) / BT + len(prompts)
        # every one is resident for its second turn: the whole first turn is reused
        again = [p + r.json()["choices"][0]["token_ids"] + prompt_ids(5, 30 + i)
                 for i, (p, r) in enumerate(zip(prompts, replies))]
        seconds = [complete(srv, ids, 4) for ids in again]
        check_replies(model, again, seconds, 4)
        for p, r in zip(prompts, seconds):
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(p) + 5 - 16


def test_idle_sessions_leave_when_the_pool_is_short(model, block_mb):
    """Conversations of 7 blocks each, one after another, into a pool of 24 blocks: the oldest
    idle ones leave to make room, every reply is still the request's own."""
    prompts = [prompt_ids(200, 40 + i) for i in range(5)]
    with pool_server(model, max_sessions=8, kv_cache_mb=24 * block_mb) as srv:
        replies = [complete(srv, p, 8) for p in prompts]
        check_replies(model, prompts, replies, 8)
        assert metric(srv, "ds4_session_evictions_total") >= 2
        assert metric(srv, "ds4_kv_blocks_used") <= 24
        # the first conversation left: asked again, it is prefilled again, and the same
        again = complete(srv, prompts[0], 8)
        check_replies(model, prompts[:1], [again], 8)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_idle_sessions_the_pool_cannot_hold_go_to_disk_and_come_back(model, block_mb, tmp_path):
    """With a disk store, a conversation the pool pushed out is snapshotted first: its follow-up
    restores it (all of the first turn reused) and answers as a fresh server would."""
    from serve.kvstore.store import KVStore

    store = KVStore(tmp_path / "kv", 64, model, ctx=512, min_tokens=1)
    prompts = [prompt_ids(200, 70 + i) for i in range(4)]
    with pool_server(model, kv_store=store, max_sessions=8, kv_cache_mb=24 * block_mb) as srv:
        replies = [complete(srv, p, 8) for p in prompts]
        check_replies(model, prompts, replies, 8)
        assert metric(srv, "ds4_session_evictions_total") >= 1
        engine = srv.app.state.engine
        assert not any(t[:200] == prompts[0] for t in engine.resident_tokens())  # the first one left
        engine.flush_snapshots()
        follow_up = prompts[0] + replies[0].json()["choices"][0]["token_ids"] + prompt_ids(6, 90)
        again = complete(srv, follow_up, 6)
        check_replies(model, [follow_up], [again], 6)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 200 + 7  # from disk
        assert store.counts.hits >= 1


def test_a_prompt_longer_than_the_pool_holds_for_one_request_is_a_400(model, block_mb):
    """A pool of 10 blocks holds 9 x 32 = 288 tokens of one request, whatever --ctx says."""
    with pool_server(model, ctx=512, kv_cache_mb=10 * block_mb) as srv:
        r = complete(srv, prompt_ids(300, 5), 4)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert "288" in error["message"] and "300" in error["message"]
        ok = complete(srv, prompt_ids(100, 5), 4)  # the server goes on
        check_replies(model, [prompt_ids(100, 5)], [ok], 4)


@pytest.mark.parametrize("draft_tokens", [0, 2])
def test_running_requests_that_outgrow_the_pool_are_preempted_and_resumed(model, block_mb, draft_tokens):
    """Four requests of 60 + 120 tokens at once into 16 blocks (512 tokens): together they need
    24. Some are set aside and resumed from what they had sent; every reply is complete and
    exactly its own, and nothing fails; speculating too (verify steps take 3 tokens tentatively)."""
    prompts = [prompt_ids(60, 50 + i) for i in range(4)]
    with pool_server(model, max_batch=4, max_sessions=4, kv_cache_mb=16 * block_mb,
                speculative_tokens=draft_tokens) as srv:
        replies = concurrently(lambda ids: complete(srv, ids, 120), [(p,) for p in prompts])
        check_replies(model, prompts, replies, 120)
        assert metric(srv, "ds4_preemptions_total") >= 1
        assert metric(srv, "ds4_kv_blocks_used") <= 16
        assert srv.app.state.engine.health() is None


def test_the_pool_benchmark_scenarios(model, block_mb):
    """`bench serve --scenario pool`, small: chats on one prompt sent at once are answered as alone
    within the bound, and long sessions past what the pool holds are all answered."""
    from ds4_torch.bench.pool import long_sessions, shared_prompt

    tokenizer = default_tokenizer()
    one = shared_prompt(model, tokenizer, chats=4, system_tokens=600, user_tokens=40, new_tokens=4,
                        kv_cache_mb=2.0, prefill_chunk=128)
    assert one["answered"] == one["same_as_alone"] == 4
    assert one["peak_vs_bound"] <= 1.3 and one["evicted"] == one["preempted"] == 0
    assert one["second_turn_reused_min"] >= -16
    block = block_nbytes(model.config, model.dtype, 256)
    rows = long_sessions(model, tokenizer, session_tokens=1000, kv_cache_mb=20 * block / 2**20, prefill_chunk=256,
                         new_tokens=4)
    assert [r["status"] for r in rows] == [200] * 7  # 20 blocks of 256 tokens hold 5 of 1,000 tokens; 2 more
    assert rows[3]["resident"] == 4 and rows[3]["evicted"] == 0 and rows[-1]["evicted"] >= 2


def test_fp8_rows_in_the_pool_answer_as_an_fp8_cache_does(model, block_mb):
    """`--kv-dtype fp8`: the pool stores rows as e4m3 with a scale per 64 values (fewer bytes per
    block), and replies equal greedy decoding over a static fp8 cache of the library."""
    fp8_block = block_nbytes(model.config, model.dtype, BT, "fp8")
    assert fp8_block <= 0.5 * block_nbytes(model.config, model.dtype, BT)
    prompts = [prompt_ids(150, 60 + i) for i in range(3)]
    with pool_server(model, kv_rows="fp8", kv_cache_mb=40 * fp8_block / 2**20) as srv:
        assert metric(srv, "ds4_kv_block_bytes") == fp8_block and metric(srv, "ds4_kv_blocks_total") == 40
        replies = concurrently(lambda ids: complete(srv, ids, 12), [(p,) for p in prompts])
    for ids, r in zip(prompts, replies):
        assert r.status_code == 200, r.text
        want = list(generate(model, ids, 12, prefill_chunk=64, cache=model.new_cache(1, 512, kv_rows="fp8")))
        assert r.json()["choices"][0]["token_ids"] == want
