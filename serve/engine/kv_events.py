"""KV-cache events in vLLM's wire format, on ZeroMQ: which full blocks of the KV pool this replica
holds, for routers that send each request to the replica holding the most of its prompt
(vllm-router's `kv_aware` policy; NVIDIA Dynamo, llm-d and AIBrix read the same stream).

The format is vLLM 0.29.0's (`vllm.distributed.kv_events`, `ZmqEventPublisher`), which
vllm-router 0.1.17 decodes:

- A PUB socket, bound at the endpoint (`serve --kv-events`). Every message is three frames: the
  topic (empty), the sequence number (8 bytes, big-endian, 0 first, one per message) and a
  msgpack payload.
- The payload is a batch, an array `[ts, events, data_parallel_rank]` (ts: seconds since the
  epoch, a float; the rank 0). Each event is a map tagged with its class name under "type", as
  msgspec writes a tagged struct: `{"type": "BlockStored", "block_hashes": [bin, ...],
  "parent_block_hash": bin or nil, "token_ids": [int, ...], "block_size": int, "lora_id": nil,
  "medium": "GPU", "lora_name": nil}` (several blocks of one sequence, each the parent of
  the next: token_ids holds block_size ids per hash), `{"type": "BlockRemoved", "block_hashes":
  [...], "medium": ...}` and `{"type": "AllBlocksCleared"}`.
- A block hash is 32 bytes: a keyed BLAKE2b of the pool's chain digest (`ds4_torch.paged`), the key
  random per process, so a hash says nothing about the tenant nor correlates across runs. The
  digests start from the tenant, so two tenants' equal prompts are different blocks here too.
- Optionally a ROUTER socket for replay (`--kv-events-replay`): a request `[identity, b"",
  start_seq]` (8 bytes, big-endian) is answered with `[identity, b"", topic, seq, payload]` for every
  batch still buffered (the last 10,000) from start_seq on, then `[identity, b"", b"", -1, b""]`.

The first batch is AllBlocksCleared (this process's pool starts empty), and so is the last one,
sent when the server stops: a router still subscribed forgets what this replica held.

Token ids: a BlockStored carries its block's token ids (the router hashes them; vLLM does the
same), so whoever connects to the endpoint reads every prompt the pool caches. serve.cli refuses
`--kv-events` with several API keys (tenants) unless `--kv-events-all-tenants` says the
subscribers may read every tenant's (a router forwards every tenant's requests, so it sees them
anyway). The socket has no authentication: bind it on loopback or a private network.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import os
import struct
import threading
import time
from collections.abc import Sequence

from ds4_torch.runtime import UserError

log = logging.getLogger("ds4.serve")

VLLM_FORMAT = "0.29.0"         # the vLLM release whose KV-event wire format this is
BUFFER_BATCHES = 10_000        # batches kept for replay (vLLM's default buffer_steps)
MAX_EVENTS = 1024              # raw pool events per batch at most (vllm-router refuses batches of over 4096)
REPLAY_POLL_S = 0.05           # how often the publishing thread looks for a replay request when idle
CLOSE_LINGER_MS = 1000         # how long the last batch may take to leave when the server stops
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# vLLM's tier names: "GPU" is the cache the model computes from (routers credit it in full; "CPU" and
# "STORAGE" are offload tiers a block must first be brought back from). The pool is that cache on
# whatever device the model runs.
MEDIUM = "GPU"


# --------------------------------------------------------------------------- msgpack
def packb(obj) -> bytes:
    """`obj` (None, bool, int, float, str, bytes, list/tuple, dict) in msgpack, smallest forms
    first, as msgspec writes them."""
    out = bytearray()
    _pack(obj, out)
    return bytes(out)


def _pack(obj, out: bytearray) -> None:
    if obj is None:
        out.append(0xC0)
    elif obj is True or obj is False:
        out.append(0xC3 if obj else 0xC2)
    elif isinstance(obj, int):
        if 0 <= obj < 0x80:
            out.append(obj)
        elif -32 <= obj < 0:
            out.append(obj & 0xFF)
        elif obj >= 0:
            for limit, code, fmt in ((0xFF, 0xCC, ">B"), (0xFFFF, 0xCD, ">H"), (0xFFFFFFFF, 0xCE, ">I"),
                                     (0xFFFFFFFFFFFFFFFF, 0xCF, ">Q")):
                if obj <= limit:
                    out.append(code)
                    out += struct.pack(fmt, obj)
                    return
            raise OverflowError(f"{obj} does not fit msgpack's 64-bit integers")
        else:
            for limit, code, fmt in ((-0x80, 0xD0, ">b"), (-0x8000, 0xD1, ">h"), (-0x80000000, 0xD2, ">i"),
                                     (-0x8000000000000000, 0xD3, ">q")):
                if obj >= limit:
                    out.append(code)
                    out += struct.pack(fmt, obj)
                    return
            raise OverflowError(f"{obj} does not fit msgpack's 64-bit integers")
    elif isinstance(obj, float):
        out.append(0xCB)
        out += struct.pack(">d", obj)
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        _head(len(data), out, 0xA0, 32, (0xD9, 0xDA, 0xDB))
        out += data
    elif isinstance(obj, (bytes, bytearray)):
        _head(len(obj), out, None, 0, (0xC4, 0xC5, 0xC6))
        out += obj
    elif isinstance(obj, (list, tuple)):
        _head(len(obj), out, 0x90, 16, (None, 0xDC, 0xDD))
        for item in obj:
            _pack(item, out)
    elif isinstance(obj, dict):
        _head(len(obj), out, 0x80, 16, (None, 0xDE, 0xDF))
        for key, value in obj.items():
            _pack(key, out)
            _pack(value, out)
    else:
        raise TypeError(f"cannot write {type(obj).__name__} as msgpack")


def _head(n: int, out: bytearray, fix: int | None, fix_limit: int, codes: tuple) -> None:
    """The length prefix of a str, bin, array or map of `n`: its fix form below `fix_limit`, else
    the 8-, 16- or 32-bit form (`codes`; None where msgpack has none)."""
    if fix is not None and n < fix_limit:
        out.append(fix | n)
        return
    for limit, code, fmt in ((0xFF, codes[0], ">B"), (0xFFFF, codes[1], ">H"), (0xFFFFFFFF, codes[2], ">I")):
        if code is not None and n <= limit:
            out.append(code)
            out += struct.pack(fmt, n)
            return
    raise OverflowError(f"a msgpack length of {n}")


# --------------------------------------------------------------------------- the publisher
class KVEventPublisher:
    """A `ds4_torch.paged.PoolListener` that publishes what it is told in vLLM's format (see the
    module docstring): the pool's thread only queues (`stored`, `removed`); a thread of its own
    batches what is queued (a sequence's consecutive blocks into one BlockStored), writes and sends
    it, and answers replay requests. `endpoint` / `replay_endpoint`: ZeroMQ addresses to bind (a
    port `*` takes a free one; `endpoint` / `replay_endpoint` then say which); one that cannot be
    bound is a UserError."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, block_tokens: int, topic: str = ""):
        import zmq

        self.block_tokens, self.topic = block_tokens, topic.encode()
        self._key = os.urandom(32)
        self._ctx = zmq.Context()
        self._pub = self._bind(zmq.PUB, endpoint, "--kv-events")
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay = None
        try:
            if replay_endpoint is not None:
                self._replay = self._bind(zmq.ROUTER, replay_endpoint, "--kv-events-replay")
        except UserError:
            self._pub.close(0)
            self._ctx.term()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue: collections.deque = collections.deque()  # raw events from the pool's thread
        self._buffer: collections.deque = collections.deque(maxlen=BUFFER_BATCHES)  # (seq, payload) for replay
        self._seq = itertools.count()
        self._closing = threading.Event()
        self._wake = threading.Event()  # set with every event queued
        self.batches_sent = 0
        self._queue.append(("cleared",))
        self._thread = threading.Thread(target=self._run, name="ds4-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind, endpoint: str, flag: str):
        import zmq

        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(0)
            raise UserError(f"{flag} {endpoint}: cannot bind it: {e}") from None
        return sock

    def sources(self) -> dict:
        """What `GET /kv_event_sources` answers (the form vllm-router's discovery reads): rank 0's
        publisher."""
        return {"0": {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                      "topic": self.topic.decode(), "publisher": "zmq", "encoding": "msgpack", "schema_version": 1,
                      "enable_kv_cache_events": True, "buffer_steps": BUFFER_BATCHES, "format": f"vllm {VLLM_FORMAT}"}}

    # ------------------------------------------------------------------ PoolListener (the pool's thread)
    def stored(self, digest: bytes, parent: bytes | None, tokens: Sequence[int], tenant: str | None) -> None:
        if self._thread.is_alive():  # (a publisher that failed queues nothing more)
            self._queue.append(("stored", digest, parent, tokens))
            self._wake.set()

    def removed(self, digest: bytes) -> None:
        if self._thread.is_alive():
            self._queue.append(("removed", digest))
            self._wake.set()

    def close(self, timeout: float = 2.0) -> None:
        """Publish AllBlocksCleared (this replica's cache goes away) after what is queued, then stop."""
        if self._closing.is_set():
            return
        self._queue.append(("cleared",))
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ its thread
    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(REPLAY_POLL_S)
                self._wake.clear()  # (before draining: what is queued from now on sets it again)
                closing = self._closing.is_set()
                while self._queue:
                    self._send(self._batch())
                if closing:
                    return
                while self._replay is not None and self._replay.poll(0):
                    self._answer_replay()
        except Exception:  # noqa: BLE001 - the server keeps serving without events; say why once
            log.exception("kv events: the publisher stopped")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()
            self._ctx.term()

    def _hash(self, digest: bytes) -> bytes:
        return hashlib.blake2b(digest, key=self._key, digest_size=32).digest()

    def _batch(self) -> list[dict]:
        """Up to MAX_EVENTS queued pool events as vLLM events: a sequence's consecutive stored
        blocks joined into one BlockStored, consecutive removals into one BlockRemoved."""
        events: list[dict] = []
        last_stored = None  # the digest ending the BlockStored at events[-1]
        for _ in range(MAX_EVENTS):
            if not self._queue:
                break
            kind, *rest = self._queue.popleft()
            if kind == "stored":
                digest, parent, tokens = rest
                if last_stored is not None and parent == last_stored:
                    events[-1]["block_hashes"].append(self._hash(digest))
                    events[-1]["token_ids"].extend(int(t) for t in tokens)
                else:
                    events.append({"type": "BlockStored", "block_hashes": [self._hash(digest)],
                                   "parent_block_hash": None if parent is None else self._hash(parent),
                                   "token_ids": [int(t) for t in tokens], "block_size": self.block_tokens,
                                   "lora_id": None, "medium": MEDIUM, "lora_name": None})
                last_stored = digest
                continue
            last_stored = None
            if kind == "removed":
                if events and events[-1]["type"] == "BlockRemoved":
                    events[-1]["block_hashes"].append(self._hash(rest[0]))
                else:
                    events.append({"type": "BlockRemoved", "block_hashes": [self._hash(rest[0])],
                                   "medium": MEDIUM})
            else:
                events.append({"type": "AllBlocksCleared"})
        return events

    def _send(self, events: list[dict]) -> None:
        seq = next(self._seq)
        payload = packb([time.time(), events, 0])
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.batches_sent += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a replay request of %d frames ignored (identity, empty, 8-byte start)", len(frames))
            return
        client, _, start = frames
        start = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
