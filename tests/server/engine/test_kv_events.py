"""`serve --kv-events`: the KV pool's blocks published in vLLM 0.29.0's KV-event format
(serve.engine.kv_events), read the way a router reads them.

The subscriber here is independent of the publisher: it finds the endpoints through GET
/kv_event_sources (as vllm-router's discovery does), decodes every payload with msgspec into
structs declared as vLLM 0.29.0 declares them (`vllm.distributed.kv_events`: the batch an
array, each event a map tagged with its class name; unknown fields refused), asks the replay
socket for any batch it missed (ZeroMQ drops what a subscriber misses while joining), and keeps
what a router keeps: which blocks, with which tokens and parents, the replica holds. The
expectations are the prompts' own token ids cut into blocks, the usage the server answered
(cached tokens) and the pool's own count of registered blocks."""
from __future__ import annotations

import time

import httpx
import pytest

from ds4_torch.paged import block_nbytes
from ds4_torch.runtime import UserError
from helpers import MODEL, prompt_ids, server, wait_for, wait_idle

msgspec = pytest.importorskip("msgspec", reason="msgspec (the dev extra) decodes the events as vLLM's subscribers do")
zmq = pytest.importorskip("zmq", reason="pyzmq (a dependency of the server's --kv-events)")

BT = 16  # tokens per block (the model's rates are 4 and 16)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# vLLM 0.29.0's declarations (vllm/distributed/kv_events.py), restated.
class BlockStored(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    """A router's view of one replica's KV events: the blocks it holds (hash -> token ids, and
    each block's parent), in sequence order, missed batches fetched from the replay socket."""

    def __init__(self, url: str):
        sources = httpx.get(url + "/kv_event_sources").json()
        assert list(sources) == ["0"] and sources["0"]["publisher"] == "zmq" and sources["0"]["encoding"] == "msgpack"
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(sources["0"]["endpoint"])
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.replay_endpoint = sources["0"]["replay_endpoint"]
        self.next_seq = 0
        self.held: dict[bytes, list[int]] = {}
        self.parent: dict[bytes, bytes | None] = {}
        self.events: list = []          # every event applied, in order
        self.stored_at: dict[bytes, float] = {}

    def close(self):
        self.sub.close(0)
        self.ctx.term()

    def pump(self, timeout_ms: int = 100) -> None:
        """Apply what arrived (the batches missed before it fetched from the replay socket)."""
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            seq = int.from_bytes(seq, "big")
            if seq > self.next_seq:
                self._replay(seq)
            if seq == self.next_seq:
                self._apply(seq, payload)
            timeout_ms = 0

    def _replay(self, upto: int) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            empty, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                assert (empty, topic, payload) == (b"", b"", b"")
                break
            if int.from_bytes(seq, "big") == self.next_seq and self.next_seq < upto:
                self._apply(self.next_seq, payload)
        dealer.close(0)
        assert self.next_seq == upto, f"the replay socket sent up to {self.next_seq}, not {upto}"

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = DECODE.decode(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for event in batch.events:
            self.events.append(event)
            if isinstance(event, BlockStored):
                n = event.block_size
                assert n == BT and len(event.token_ids) == n * len(event.block_hashes) and event.lora_id is None
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    assert len(h) == 32 and h not in self.held
                    self.held[h] = event.token_ids[i * n:(i + 1) * n]
                    self.parent[h] = parent
                    self.stored_at[h] = time.monotonic()
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    del self.held[h]  # (KeyError: a block removed that was never stored)
            else:
                self.held.clear()
        self.next_seq = seq + 1

    def wait(self, cond, what: str, timeout: float = 60.0) -> None:
        wait_for(lambda: (self.pump(20), cond())[1], timeout, what)

    def chain(self, tokens: list[int]) -> list[bytes]:
        """The hashes of the longest run of held blocks that starts `tokens`, each the parent of the
        next: what a router credits this replica with for a prompt starting with `tokens`."""
        out, parent = [], None
        for k in range(len(tokens) // BT):
            block = tokens[k * BT:(k + 1) * BT]
            h = next((h for h, ids in self.held.items() if ids == block and self.parent[h] == parent), None)
            if h is None:
                break
            out.append(h)
            parent = h
        return out


def events_server(model, **config):
    return server(model, **{"ctx": 512, "prefill_chunk": 64, "kv_block_tokens": BT,
                            "kv_events": "tcp://127.0.0.1:*", "kv_events_replay": "tcp://127.0.0.1:*", **config})


def complete(srv, ids, n=4):
    r = httpx.post(srv.url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prefill_publishes_its_full_blocks_and_a_stop_clears_them(model):
    prompt = prompt_ids(4 * BT + 8, 1)  # 4 full blocks and part of a fifth
    other = prompt[:2 * BT] + prompt_ids(2 * BT, 2)  # the same first 2 blocks, then its own
    with events_server(model, checkpoint_interval=BT) as srv:
        info = httpx.get(srv.url + "/get_server_info").json()
        assert info["model_id"] == MODEL and info["kv_block_size"] == BT and info["instance_id"]
        sub = Subscriber(srv.url)
        complete(srv, prompt)
        sub.wait(lambda: len(sub.chain(prompt)) == 4, "BlockStored for the prompt's 4 full blocks")
        assert isinstance(sub.events[0], AllBlocksCleared)  # seq 0: the pool starts empty
        stored = [e for e in sub.events if isinstance(e, BlockStored)]
        assert stored[0].parent_block_hash is None and stored[0].medium == "GPU"
        wait_idle(srv)
        sub.pump()  # the 4 reply tokens fill no block: exactly the prompt's blocks are held
        assert sorted(sub.held.values()) == sorted(prompt[k * BT:(k + 1) * BT] for k in range(4))
        assert complete(srv, other)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * BT
        sub.wait(lambda: len(sub.chain(other)) == 4, "BlockStored for the second prompt's own 2 blocks")
        assert sub.chain(other)[:2] == sub.chain(prompt)[:2] and len(sub.held) == 6
    try:  # the server stopped: its last batch clears what it held
        sub.wait(lambda: not sub.held, "AllBlocksCleared when the server stops", timeout=30)
        assert isinstance(sub.events[-1], AllBlocksCleared)
    finally:
        sub.close()


def test_reclaimed_blocks_are_removed(model):
    """Conversations of 13 blocks each, one after another, into a pool of 24: the oldest idle
    ones leave and their blocks are reclaimed. The subscriber sees every reclaimed block removed
    (each one it had seen stored) and ends holding as many blocks as the pool has registered; a
    conversation prefilled again is stored again."""
    prompts = [prompt_ids(200, 40 + i) for i in range(5)]
    full = 200 // BT
    block_mb = block_nbytes(model.config, model.dtype, BT) / 2**20
    with events_server(model, max_sessions=8, kv_cache_mb=24 * block_mb) as srv:
        sub = Subscriber(srv.url)
        try:
            complete(srv, prompts[0])
            sub.wait(lambda: len(sub.chain(prompts[0])) == full, "the first conversation's blocks")
            for p in prompts[1:]:
                complete(srv, p)
            pool = srv.app.state.engine.runner.pool
            wait_idle(srv)
            registered = sum(pool.digest(b) is not None for b in range(pool.num_blocks))
            sub.wait(lambda: len(sub.held) == registered, "the subscriber's blocks to be the pool's")
            removed = sum(len(e.block_hashes) for e in sub.events if isinstance(e, BlockRemoved))
            assert removed == pool.evictions > 0
            assert len(sub.chain(prompts[0])) < full  # (its tail went first)
            complete(srv, prompts[0])
            sub.wait(lambda: len(sub.chain(prompts[0])) == full, "the first conversation stored again")
        finally:
            sub.close()


def test_endpoints_that_cannot_be_bound_and_missing_events_are_clear_errors(model):
    with pytest.raises(UserError, match=r"--kv-events tcp://256\.0\.0\.1:1: cannot bind it"):
        events_server(model, kv_events="tcp://256.0.0.1:1")
    with server(model, ctx=256) as srv:
        r = httpx.get(srv.url + "/kv_event_sources")
        assert r.status_code == 404 and "--kv-events" in r.json()["error"]["message"]


@pytest.mark.parametrize("argv, problem", [
    (["--kv-events", "tcp://127.0.0.1:*", "--api-key", "a", "--api-key", "b"], "--kv-events-all-tenants"),
    (["--kv-events-replay", "tcp://127.0.0.1:*"], "--kv-events-replay needs --kv-events"),
    (["--kv-events-all-tenants"], "--kv-events-all-tenants needs --kv-events"),
])
def test_flags_that_do_not_go_together_are_refused_before_loading(argv, problem, capsys):
    from serve.cli import main

    assert main(argv) == 2
    assert problem in capsys.readouterr().err


def test_the_msgpack_writer_writes_what_msgspec_writes():
    """serve.engine.kv_events.packb against msgspec's encoder, byte for byte, at every length
    and integer boundary of the format."""
    from serve.engine.kv_events import packb

    ints = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1,
            -1, -32, -33, -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63]
    values = [None, True, False, 0.0, 1.5, -2.25e300, *ints,
              *("x" * n for n in (0, 31, 32, 255, 256, 65535, 65536)), "é∑",
              *(bytes(range(256)) * (n // 256) + bytes(n % 256) for n in (0, 32, 255, 256, 65536)),
              *([7] * n for n in (0, 15, 16, 65535, 65536)),
              {"type": "BlockStored", "block_hashes": [b"\1" * 32], "parent_block_hash": None},
              {str(i): i for i in range(16)}, [1.25, [{"type": "AllBlocksCleared"}], 0]]
    for v in values:
        assert packb(v) == msgspec.msgpack.encode(v), repr(v)[:60]
