"""Resident sessions: which conversation each resident slot holds, where a prompt can resume,
their checkpoints, LRU eviction and the disk store. The engine (serve.engine.loop) schedules; this
module decides what a request reuses and keeps the state it may reuse later.

- **Index.** Every session with tokens is registered in a `PrefixIndex` under its slot and its
  tenant (the API key that authenticated: reuse never crosses keys), with its checkpoints and its
  end. `claim` matches a request's sequence against all of them at once.
- **Checkpoints** (`DS4Cache.take_checkpoint`, held by the replica under an id, the logits here)
  are taken at a prompt's end, at message boundaries and client hints (`GenRequest.boundaries`),
  and every `interval` tokens of prefill (chunks end there) and decode (between steps, on the
  batch slot; they join the session when it leaves the batch). They are kept within
  `memory_bytes`: the least recently used go first, interval ones before boundary ones (a
  boundary is where agents diverge: a new conversation, a regenerate, an edit).
- **Reuse.** The best state at or below the divergence: a session's end (an idle session is
  taken over, a busy one copied: a fork) or a checkpoint. From a checkpoint the request
  *branches* into another slot (copying the source's compressed rows; a busy source is left as
  it is) or *rewinds in place*. Rule: an idle session is rewound in place only when no empty
  slot is free. Its later tokens are then lost, but keeping them would cost evicting another
  whole conversation, and the tail past a divergence is what regenerates and edits replace.
  With an empty slot free the request branches and both conversations stay.
- **Eviction.** No empty slot: the least recently used idle session goes (snapshotted to disk
  first with its checkpoints, when a store is attached). On a miss (or when the store holds a
  longer prefix than any resident state) the store restores into a free slot; the checkpoints
  the snapshot carried come back with it.

- **Disk snapshots** (with a store): after a prompt's prefill (once its first token is out),
  every `store.every` generated tokens, when an idle session is evicted, and at shutdown. The
  state is read out of the cache between steps; encoding and writing run on the writer thread.
- **The KV pool** (`make_room`): a prefill chunk or a decode step that needs blocks first takes
  the pool's unreferenced cached ones, then has idle sessions leave, least recently used first.

Every cache operation goes through `run` (the engine's: sent to the other ranks first under
tensor parallelism), so checkpoints exist on every rank under the same ids.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Callable

import torch

from .prefix_index import CHECKPOINT, END, PrefixIndex, PrefixMatch
from .reuse import Look, ReuseReports
from .sequence import GenRequest

# A session's request is a serve.engine.sequence.GenRequest (the one type the engine's parts share).

log = logging.getLogger("ds4.serve")

SNAPSHOT_QUEUE = 8  # snapshots waiting for the writer; past that a new one is dropped, not queued
DEFAULT_CHECKPOINT_INTERVAL = 256
DEFAULT_CHECKPOINT_MEMORY_MB = 1024


@dataclass(eq=False)
class Checkpoint:
    id: int
    position: int
    logits: torch.Tensor | None    # the next token's logits (rank 0 keeps them; the replicas hold the rest)
    boundary: bool                 # a prompt end, message boundary or hint: kept longer than interval ones
    last_used: float = 0.0


@dataclass(eq=False)
class Session:
    """One resident conversation: slot `slot` of the resident cache holds `tokens`."""
    slot: int
    tokens: list[int] = field(default_factory=list)
    last_logits: torch.Tensor | None = None   # the next token's logits: a prompt equal to `tokens` needs no step
    last_used: float = 0.0
    request: "GenRequest | None" = None      # the request using it, if any
    saved_at: int = 0                        # tokens at its last disk snapshot
    restored: str | None = None              # the snapshot it was restored from, until a step confirms it
    tenant: Hashable = None
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)   # position -> checkpoint (resident rows)
    pending: list[Checkpoint] = field(default_factory=list)  # taken on its batch slot, joining when it leaves


class SnapshotWriter:
    """Writes prepared snapshots on its own thread, so disk I/O never sits between two steps."""

    def __init__(self, store):
        self.store = store
        self.queue: queue.Queue = queue.Queue(SNAPSHOT_QUEUE)
        self.thread = threading.Thread(target=self._run, name="ds4-kv-writer", daemon=True)
        self.thread.start()

    def submit(self, pending, wait: float | None = None) -> bool:
        """Queue `pending`; False when dropped: at once while the writer is behind (decoding never
        waits for the disk), or after `wait` seconds for room (shutdown)."""
        try:
            if wait is None:
                self.queue.put_nowait(pending)
            else:
                self.queue.put(pending, timeout=max(wait, 0.0))
            return True
        except queue.Full:
            log.warning("engine: the disk writer is behind; snapshot of %d tokens dropped", len(pending.tokens))
            return False

    def _run(self) -> None:
        while True:
            pending = self.queue.get()
            try:
                if pending is None:
                    return
                self.store.write(pending)
            except Exception as e:  # noqa: BLE001 - the disk cache must never fail anything
                log.warning("engine: kv store write failed: %s: %s", type(e).__name__, e)
            finally:
                self.queue.task_done()

    def flush(self) -> None:
        self.queue.join()

    def close(self, timeout: float = 30.0) -> list[int]:
        """Write what is queued, then stop; the token counts of the snapshots left unwritten
        after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        try:
            self.queue.put(None, timeout=max(timeout, 0.0))
        except queue.Full:
            pass
        self.thread.join(max(deadline - time.monotonic(), 0.0))
        if not self.thread.is_alive():
            return []
        with self.queue.mutex:  # still writing: what it has not taken yet is lost with the process
            return [len(p.tokens) for p in self.queue.queue if p is not None]


class Sessions:
    """The resident sessions of one engine (iterable: every `Session`, by slot)."""

    def __init__(self, replica, run: Callable, metrics, count: int, *, interval: int = DEFAULT_CHECKPOINT_INTERVAL,
                 memory_bytes: int = DEFAULT_CHECKPOINT_MEMORY_MB * 2**20, kv_store=None, peers=None):
        if interval < 0:
            raise ValueError(f"checkpoint interval must be >= 0, got {interval}")
        self.replica, self.run, self.metrics = replica, run, metrics
        self.interval = interval
        self.memory_bytes = memory_bytes
        self.kv_store = kv_store
        self.peers = peers
        self.writer: SnapshotWriter | None = None
        self.slots = [Session(i) for i in range(count)]
        self.index = PrefixIndex()
        self.reports = ReuseReports(self.index, metrics)  # what each request reused, and why not more
        self._ids = itertools.count()
        self._held: dict[int, Checkpoint] = {}   # id -> checkpoint (resident or pending)
        vocab = replica.model.config.vocab_size
        # Logits are kept as the model returns them (fp32 on the embedded model): counted at 4 bytes.
        self.checkpoint_nbytes = replica.resident.checkpoint_nbytes() + 4 * vocab

    def __iter__(self):
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: int) -> Session:
        return self.slots[i]

    @property
    def enabled(self) -> bool:
        """Checkpoints are taken at all (`interval` 0 and no memory: off, as before them)."""
        return self.interval > 0 and self.memory_bytes >= self.checkpoint_nbytes

    # ------------------------------------------------------------------ claiming
    def claim(self, req: "GenRequest") -> int:
        """Give `req` a session holding a prefix of its sequence; return the tokens it reuses. On
        its first admission `req.cache_report` says what it reused and why not more (serve.engine.reuse)."""
        seq = req.sequence()
        loaded, req.disk = req.disk, None  # what was read for it: applied below or not at all, then released
        first = req.attempts <= 1 and not req.generated  # what its usage reports (serve.engine.admission)
        if req.wants_prompt_logprobs():
            # Cached tokens have no logits: prefill the whole prompt in a fresh session.
            session = self.free_session()
            req.plp = []
            return self._reported(req, first, Look(len(seq)), "none", self._attach(session, req), "prompt_logprobs")
        reuse, source, match, chain = self._best_match(req.tenant, seq)
        disk = self._stored_prefix(seq, req.tenant) if self.kv_store is not None and not req.no_restore else 0
        look = self.reports.look(req.tenant, seq, chain, match, max(reuse, disk)) if first else None
        if source is None or disk > reuse:
            session = self.free_session()
            if disk:
                self.restore(session, seq, req.tenant, loaded)
            return self._reported(req, first, look, "disk" if session.tokens else "none", self._attach(session, req))
        session, kind = source
        if kind == END and session.request is None:
            return self._reported(req, first, look, "session", self._attach(session, req))  # taken over: no copy
        if kind == END:  # busy: fork its state
            target = self.free_session(keep=session)
            self.run("copy", "resident", target.slot, session.slot, "resident")
            target.tokens, target.last_logits = list(session.tokens), session.last_logits
            return self._reported(req, first, look, "shared", self._attach(target, req))
        ck = session.checkpoints[reuse]
        ck.last_used = time.monotonic()
        if session.request is None and not any(s.request is None and not s.tokens for s in self.slots):
            self.run("restore_checkpoint", "resident", session.slot, ck.id)
            self._truncate(session, reuse, ck.logits)
            self.metrics.rewinds.inc()
            return self._reported(req, first, look, "checkpoint", self._attach(session, req))
        target = self.free_session(keep=session)
        self.run("branch_from_checkpoint", "resident", target.slot, "resident", session.slot, ck.id)
        target.tokens, target.last_logits = list(seq[:reuse]), ck.logits
        self.metrics.branches.inc()
        return self._reported(req, first, look, "checkpoint", self._attach(target, req))

    def _reported(self, req: "GenRequest", first: bool, look, source: str, reused: int,
                  reason: str | None = None) -> int:
        if first:
            req.cache_report = self.reports.finish(req.id, req.tenant, look, reused,
                                                   source if reused else "none", reason)
        return reused

    def _best(self, tenant, seq: list[int]) -> tuple[int, tuple[Session, str] | None]:
        return self._best_match(tenant, seq)[:2]

    def _best_match(self, tenant, seq: list[int]):
        """The furthest reusable state of `tenant`'s sessions for `seq`: (position, (session,
        END or CHECKPOINT)), preferring an idle session's end, then a checkpoint, then a busy end;
        and the index's match (its `common`) and `seq`'s block hashes, for the request's report.
        A state at the whole sequence needs its logits (else a token is left to prefill)."""
        chain = self.index.chain(seq)
        widest = None
        for cap in (len(seq), len(seq) - 1):
            if cap <= 0:
                break
            m = self.index.match(tenant, seq, max_reuse=cap, chain=chain)
            widest = widest or m
            if m.reuse == 0:
                return 0, None, widest, chain
            usable = []
            for slot, kind in m.sources:
                s = self.slots[slot]
                logits = s.last_logits if kind == END else s.checkpoints[m.reuse].logits
                if m.reuse < len(seq) or logits is not None:
                    rank = 0 if kind == END and s.request is None else 1 if kind == CHECKPOINT else 2
                    usable.append((rank, s.slot, s, kind))
            if usable:
                _, _, s, kind = min(usable, key=lambda u: u[:2])
                return m.reuse, (s, kind), widest, chain
        return 0, None, widest or PrefixMatch(0, None, 0, ()), chain

    def _attach(self, session: Session, req: "GenRequest") -> int:
        if session.tenant != req.tenant or session.slot not in self.index:
            self.index.remove(session.slot)
            session.tenant = req.tenant
            self.index.add(session.slot, req.tenant, session.tokens, list(session.checkpoints))
        session.request = req
        session.last_used = time.monotonic()
        req.session = session
        return len(session.tokens)

    def _truncate(self, session: Session, n: int, logits) -> None:
        """`session` was rewound to its first `n` tokens: later checkpoints go with them."""
        for p in [p for p in session.checkpoints if p > n]:
            self._drop(session.checkpoints.pop(p))
        del session.tokens[n:]
        session.last_logits = logits
        session.saved_at = min(session.saved_at, n)
        if session.slot in self.index:
            self.index.truncate(session.slot, n)

    def free_session(self, keep: Session | None = None) -> Session:
        """An empty session: a free one, else the least recently used idle one (never `keep`), evicted."""
        for s in self.slots:
            if s.request is None and not s.tokens and s is not keep:
                return s
        idle = [s for s in self.slots if s.request is None and s is not keep]
        if not idle:  # every other slot is busy (max_sessions == max_batch and a fork): take `keep`'s place
            raise RuntimeError("no resident session can be freed")
        victim = min(idle, key=lambda s: s.last_used)
        self.evict(victim)
        return victim

    def evict_idle(self, keep=()) -> bool:
        """Evict the least recently used idle session holding tokens (never one of `keep`), so
        the KV pool gets its blocks back; False when there is none."""
        idle = [s for s in self.slots if s.request is None and s.tokens and s not in keep]
        if not idle:
            return False
        self.evict(min(idle, key=lambda s: s.last_used), "pool")
        return True

    def make_room(self, need: int, keep=()) -> bool:
        """Have `need` blocks of the KV pool available: its unreferenced cached blocks count
        already; then idle sessions leave (least recently used first; to the disk store when
        there is one), never one of `keep`. False when even that leaves too few."""
        pool = self.replica.pool
        while pool.num_available < need:
            if not self.evict_idle(keep):
                return False
        return True

    def evict(self, session: Session, cause: str = "sessions") -> None:
        """`session` leaves memory: snapshotted to the disk store first when there is one. `cause`:
        "sessions" (its slot is needed) or "pool" (its KV blocks are), for later requests' reports."""
        written = self.snapshot(session, self.replica.resident.slot(session.slot), session.tokens, session.last_logits,
                                "evicted")
        on_disk = self.kv_store is not None and written and (session.saved_at >= len(session.tokens)
                                                               or session.restored is not None)
        self.reports.left(session.tokens, session.tenant, cause, on_disk)
        self.clear(session)
        self.metrics.session_evictions.inc()

    def clear(self, session: Session) -> None:
        self.run("reset", "resident", session.slot)
        for ck in [*session.checkpoints.values(), *session.pending]:
            self._drop(ck)
        session.checkpoints, session.pending = {}, []
        session.tokens, session.last_logits, session.saved_at, session.restored = [], None, 0, None
        self.index.remove(session.slot)

    # ------------------------------------------------------------------ growing
    def extend(self, session: Session, tokens: list[int], logits) -> None:
        """`session`'s resident slot now also holds `tokens` (a prefill chunk, or what it decoded)."""
        session.tokens.extend(tokens)
        session.last_logits = logits
        if session.slot in self.index:
            self.index.extend(session.slot, tokens)

    def settle_pending(self, session: Session) -> None:
        """The batch slot was copied back into `session`'s resident slot: the checkpoints taken on
        it are valid there now."""
        for ck in session.pending:
            if ck.position <= len(session.tokens) and ck.position not in session.checkpoints:
                self._register(session, ck)
            else:
                self._drop(ck)
        session.pending = []

    def drop_pending(self, session: Session) -> None:
        for ck in session.pending:
            self._drop(ck)
        session.pending = []

    def next_stop(self, req: "GenRequest", start: int, end: int) -> int:
        """Where a prefill chunk from `start` (at most to `end`) should stop: the first checkpoint
        position after `start`, so the chunk's end state is the checkpoint's."""
        if not self.enabled:
            return end
        k = self.interval
        stops = [p for p in req.boundaries if start < p < end]
        stops.append((start // k + 1) * k)
        return min(end, *stops)

    def wanted(self, req: "GenRequest", position: int) -> bool | None:
        """Whether a checkpoint is due at `position` of `req`'s sequence: None (no), False (an
        interval one), True (a boundary: a prompt end, message boundary or hint)."""
        if not self.enabled or position <= 0:
            return None
        # Past the prompt (every decode step asks) no boundary can match: the interval only.
        if position == len(req.prompt_ids) or (position < len(req.prompt_ids) and position in req.boundaries):
            return True
        return False if position % self.interval == 0 else None

    def wanted_between(self, req: "GenRequest", before: int, position: int) -> bool | None:
        """`wanted` for a step that took `req`'s sequence from `before` to `position` tokens at
        once (speculative decoding): an interval checkpoint is due at `position` when the step
        crossed a multiple of the interval."""
        due = self.wanted(req, position)
        if due is None and self.enabled and position // self.interval > before // self.interval:
            return False
        return due

    def take(self, session: Session, cache: str, slot: int, position: int, logits, boundary: bool,
             pending: bool = False) -> None:
        """Checkpoint slot `slot` of `cache` (holding `session`'s first `position` tokens). A
        device copy, no host sync: cheap between steps. `pending`: it was taken on a batch slot."""
        if position in session.checkpoints:
            session.checkpoints[position].boundary |= boundary
            return
        # A copy: a decode step's logits are one row of the batch's, which would stay alive whole.
        ck = Checkpoint(next(self._ids), position, None if logits is None else logits.clone(), boundary,
                        time.monotonic())
        self.run("take_checkpoint", ck.id, cache, slot)
        self._held[ck.id] = ck
        if pending:
            session.pending.append(ck)
        else:
            self._register(session, ck)
        self._trim()

    def take_or_skip(self, session: Session, cache: str, slot: int, position: int, logits, boundary: bool,
                     pending: bool = False) -> None:
        """`take`, but a checkpoint costs a device copy: one that fails (out of memory) is skipped,
        not the request's."""
        try:
            self.take(session, cache, slot, position, logits, boundary, pending)
        except Exception as e:  # noqa: BLE001 - the tensor-parallel group breaking is noticed by the loop
            log.warning("engine: checkpoint at %d skipped: %s: %s", position, type(e).__name__, e)

    def _register(self, session: Session, ck: Checkpoint) -> None:
        session.checkpoints[ck.position] = ck
        if session.slot in self.index:
            self.index.add_checkpoint(session.slot, ck.position)

    def _drop(self, ck: Checkpoint) -> None:
        if self._held.pop(ck.id, None) is not None:
            self.run("drop_checkpoint", ck.id)
        self._update_bytes()

    def _trim(self) -> None:
        """Within the memory budget: the least recently used go first, interval ones before boundaries."""
        excess = len(self._held) - self.memory_bytes // self.checkpoint_nbytes
        if excess > 0:
            owners = {ck.id: s for s in self.slots for ck in [*s.checkpoints.values(), *s.pending]}
            for ck in sorted(self._held.values(), key=lambda c: (c.boundary, c.last_used))[:excess]:
                s = owners.get(ck.id)
                if s is not None:
                    if s.checkpoints.get(ck.position) is ck:
                        del s.checkpoints[ck.position]
                        if s.slot in self.index:
                            self.index.remove_checkpoint(s.slot, ck.position)
                    else:
                        s.pending.remove(ck)
                self._drop(ck)
        self._update_bytes()

    def _update_bytes(self) -> None:
        self.metrics.checkpoint_bytes.set(len(self._held) * self.checkpoint_nbytes)

    # ------------------------------------------------------------------ disk
    def _stored_prefix(self, seq: list[int], tenant) -> int:
        fn = getattr(self.kv_store, "stored_prefix", None)
        if fn is None:  # a store without it: asked on every miss, as before
            return 1
        try:
            return fn(seq, tenant=tenant)
        except Exception as e:  # noqa: BLE001 - a store bug: serve without it
            log.warning("engine: kv store stored_prefix failed: %s: %s", type(e).__name__, e)
            return 0

    def wants_disk(self, req: "GenRequest") -> bool:
        """Whether `req` would take its state from a disk snapshot (to read it before `claim`)."""
        if self.kv_store is None or req.no_restore or req.wants_prompt_logprobs() or \
                not hasattr(self.kv_store, "load"):
            return False
        return self._stored_prefix(req.sequence(), req.tenant) > self._best(req.tenant, req.sequence())[0]

    def load(self, req: "GenRequest"):
        """Read and check the stored state `req` would take (on the scheduler's reader thread)."""
        return self.kv_store.load(req.sequence(), tenant=req.tenant)

    def read_key(self, req: "GenRequest"):
        """What `load(req)` would read first (requests with the same key share one read), or None."""
        name = self.kv("first_choice", req.sequence(), tenant=req.tenant)
        return None if name is None else (req.tenant, name)

    def share(self, loaded, req: "GenRequest"):
        """Another request's read (`load`), for `req`: the same host copy, or None when it cannot serve `req`."""
        return self.kv("share", loaded, req.sequence(), tenant=req.tenant)

    def restore(self, session: Session, seq: list[int], tenant, loaded=None) -> None:
        """Bring `tenant`'s stored state of `seq` into `session`'s clean slot: `loaded` (what the
        reader thread read: `KVStore.load`, False for a miss) is only copied in; without it the
        store reads here."""
        stored = self._stored_prefix(seq, tenant)  # its blocks, made room for (as a prefill chunk would be)
        self.make_room(-(-stored // self.replica.pool.block_tokens) + 1, keep=(session,))
        try:
            slot = self.replica.resident.slot(session.slot)
            if loaded is None:
                restored = self.kv_store.restore(slot, seq, tenant=tenant)
            else:
                restored = self.kv_store.apply(slot, loaded) if loaded else None
        except Exception as e:  # noqa: BLE001 - a store bug: serve without it
            log.warning("engine: kv store restore failed: %s: %s", type(e).__name__, e)
            self.clear(session)
            return
        if restored is None:
            return
        count, logits = restored
        if self.peers is not None:  # the other ranks' caches hold what this one read from disk
            step = self.peers.send("import_sequence",
                                   (session.slot, self.replica.resident.export_sequence(session.slot, "cpu")), model=False)
            self.peers.acknowledge(step, ok=True)
        session.tokens, session.last_logits = list(seq[:count]), logits
        session.saved_at = count
        session.restored = getattr(self.kv_store, "last_restored", None) or "restored"
        checkpoints = getattr(self.kv_store, "restored_checkpoints", None) or {}
        if checkpoints:  # imported below (copied): the store keeps no host copy
            self.kv_store.restored_checkpoints = {}
        for position, checkpoint in sorted(checkpoints.items()):
            if not 0 < position <= count or not self.enabled:
                continue
            ck = Checkpoint(next(self._ids), position, None, True, time.monotonic())
            try:
                self.run("import_checkpoint", ck.id, checkpoint)
            except ValueError as e:  # checked like the rest of the file: this one is not used
                log.warning("engine: a restored checkpoint at %d was refused: %s", position, e)
                continue
            self._held[ck.id] = ck
            session.checkpoints[position] = ck
        self._trim()

    def snapshot(self, session: Session, view, tokens: list[int], logits, why: str,
                 wait: float | None = None) -> bool:
        """Read a sequence out for the disk store, with the session's checkpoints within it; the
        writer thread writes it (`wait`: see `SnapshotWriter.submit`). False only when a snapshot
        worth writing was dropped."""
        if self.kv_store is None or not tokens or logits is None or session.restored is not None:
            return True
        checkpoints = {}
        for p, ck in session.checkpoints.items():
            state = self.replica.checkpoints.get(ck.id)
            if state is not None and p < len(tokens):  # the snapshot format keeps no checkpoint logits
                checkpoints[p] = state
        pending = self.kv("prepare", view, list(tokens), logits, why, checkpoints=checkpoints, tenant=session.tenant)
        if pending is None:
            return True
        if self.writer is None:
            self.writer = SnapshotWriter(self.kv_store)
        if not self.writer.submit(pending, wait):
            return False
        session.saved_at = len(tokens)
        return True

    def snapshot_if_due(self, session: Session, batch_slot: int, tokens: list[int], logits) -> None:
        """A decoding request's periodic snapshot (every `store.every` generated tokens), read
        from batch slot `batch_slot`, holding `tokens`."""
        store = self.kv_store
        if store is not None and store.every > 0 and store.checkpoint_due(len(tokens), session.saved_at):
            self.snapshot(session, self.replica.batch.slot(batch_slot), tokens, logits, "periodic")

    def kv(self, method: str, *args, **kwargs):
        """Call an (optional) store method; its failures are logged, never raised."""
        fn = getattr(self.kv_store, method, None)
        if fn is None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the disk cache must never fail a request
            log.warning("engine: kv store %s failed: %s: %s", method, type(e).__name__, e)
            return None

    def confirm_restored(self, session: Session) -> None:
        if session.restored is not None:
            name, session.restored = session.restored, None
            self.kv("restore_ok", name)
