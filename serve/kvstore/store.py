"""Disk KV cache, the store policy: which snapshots to write, restore, keep and delete.

A snapshot (`serve.kvstore.snapshot`: the file format and its validation) holds one sequence's
`DS4Cache` state; on a live-cache miss the engine asks `restore` for the longest stored prefix
of the prompt, and `save` / `checkpoint` write new ones. One process per directory (an flock on
`DIR/.lock`); stale temporary files are removed at start.

Tenants: a snapshot belongs to the tenant (API key) whose conversation it holds, named by a tag
derived from it (`serve.kvstore.snapshot.tenant_tag`, in its file name and header; never the key). Every
lookup (`stored_prefix`, `load`, `restore`) sees only the asking tenant's snapshots, so one key's
conversation is never restored for another, nor does its presence show in another's cached
tokens or latency, across restarts too. Files without a tag (written before tenants, or by a
server with at most one key) belong to no tenant: only requests without one reuse them.

A snapshot that fails validation is quarantined: moved to `DIR/quarantine/` with a `.why` note,
counted in `ds4_kv_disk_rejected_total{reason}`, and never tried again. The state is imported
into the live cache only once the whole file passed (`DS4Cache.import_sequence` itself checks
everything before writing). The engine reports a failure of the first step after a restore
(`restore_failed`): that file is quarantined too and the request is prefilled from scratch.
A snapshot may carry checkpoints of its sequence (`save(..., checkpoints=)`); a restore leaves
them, checked like the rest, in `restored_checkpoints` for branching.

Host memory: what `load` read is held only until it is copied into the cache. Requests waiting for
the same snapshot share one read (`share`: the same tensors, each request its own token count;
the engine's scheduler reads once per snapshot). `loaded_bytes` (`ds4_kv_disk_loaded_bytes`)
counts the bytes of snapshots read and still referenced, `ds4_kv_disk_reads_total` the reads.

Budget: every byte this store owns under DIR (snapshots, temporary files, quarantine, the stats
file, and the exact-replay records of `serve.http.replay`, which the server keeps there) stays within
`space_mb`. To make room it deletes quarantined files first (oldest first),
then snapshots of other models/layouts, then its own snapshots with the lowest score
`(1 + hits) * tokens / (1 + age / 10 min)`: old, rarely hit, cheap-to-recompute ones go first.
Room is made only after a new file is durably in place, so a write that fails (a full disk, an
error mid-write) evicts nothing; until that eviction the directory may exceed the budget by the
one new file (also after a crash at that moment: the store evicts down to the budget at start).
A snapshot larger than the whole budget is not written. Every file is written with
`serve.kvstore.snapshot.write_atomically` (temporary file, fsync, rename, directory fsync): snapshots,
`stats.json` and the quarantine notes.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from ds4_torch.cache import DS4Cache

from .snapshot import (REASONS, REPLAY_FILE, SUFFIX, TMP_PREFIX, Layout, SnapshotError, encode_snapshot, file_name, fsync_dir,
                       model_fingerprint, name_prefix, read_snapshot, tenant_tag, write_atomically)

log = logging.getLogger("ds4.serve.kvstore")

QUARANTINE = "quarantine"
STATS = "stats.json"
LOCK = ".lock"
WRITE_DELAY_ENV = "DS4_TORCH_KV_WRITE_DELAY"   # test hook: seconds slept between sections of a write


# ------------------------------------------------------------------------------ the store
def _common_prefix(a: list[int], b: list[int], block: int = 2048) -> int:
    """Length of the common prefix of `a` and `b`: whole blocks compared as slices (at C speed:
    a store holds many snapshots sharing long prefixes, asked on every request), then the block
    that differs token by token."""
    n, lo = min(len(a), len(b)), 0
    while lo < n and a[lo:lo + block] == b[lo:lo + block]:
        lo += block
    hi = min(n, lo + block)
    return next((i for i in range(lo, hi) if a[i] != b[i]), hi) if lo < n else n


@dataclass
class Entry:
    name: str
    tokens: list[int]
    nbytes: int
    created: float
    last_used: float
    hits: int = 0
    checkpoints: tuple[int, ...] = ()   # positions of the checkpoints it carries
    tenant: str | None = None           # the tag of the tenant whose conversation it is (None: no tenant)

    @property
    def n(self) -> int:
        return len(self.tokens)

    def reuse(self, prompt_ids: list[int]) -> int:
        """How much of `prompt_ids` this snapshot can bring back: all of it when it is a prefix of
        the prompt, else its furthest checkpoint at or below the divergence (short of the prompt's
        end: checkpoints on disk keep no logits, a token is left to prefill)."""
        common = _common_prefix(self.tokens, prompt_ids)
        if common == self.n:
            return self.n
        return max((c for c in self.checkpoints if c <= common and c < len(prompt_ids)), default=0)

    def score(self, now: float) -> float:
        """Higher is worth keeping: hit often, used recently, expensive to prefill again."""
        return (1 + self.hits) * self.n / (1 + max(0.0, now - self.last_used) / 600.0)


@dataclass
class _Counts:
    hits: int = 0
    misses: int = 0
    saves: int = 0
    reads: int = 0
    evictions: int = 0
    restored_tokens: int = 0
    rejected: dict = field(default_factory=dict)


class _PromMetrics:
    def __init__(self, registry):
        from prometheus_client import Counter, Gauge

        r = registry
        self.hits = Counter("ds4_kv_disk_hits", "Live-cache misses served from a disk KV snapshot", registry=r)
        self.misses = Counter("ds4_kv_disk_misses", "Live-cache misses with no usable disk KV snapshot", registry=r)
        self.saves = Counter("ds4_kv_disk_saves", "Disk KV snapshots written", registry=r)
        self.reads = Counter("ds4_kv_disk_reads", "Disk KV snapshots read in full for a restore", registry=r)
        self.loaded_bytes = Gauge("ds4_kv_disk_loaded_bytes", "Bytes of disk KV snapshots read for restores and "
                                                              "still in host memory", registry=r)
        self.rejected = Counter("ds4_kv_disk_rejected",
                                "Disk KV snapshots rejected and quarantined, by reason", ["reason"], registry=r)
        self.evictions = Counter("ds4_kv_disk_evictions", "Disk KV snapshots deleted to stay in budget", registry=r)
        self.restored_tokens = Counter("ds4_kv_disk_restored_tokens", "Tokens restored from disk KV snapshots",
                                       registry=r)
        self.bytes = Gauge("ds4_kv_disk_bytes", "Bytes the disk KV cache holds (snapshots, temporary files, "
                                                "quarantine)", registry=r)
        self.snapshots = Gauge("ds4_kv_disk_snapshots", "Usable disk KV snapshots", registry=r)
        for reason in REASONS:
            self.rejected.labels(reason=reason)


@dataclass
class LoadedSnapshot:
    """A stored state read and checked (`KVStore.load`), not yet in a cache (`KVStore.apply`):
    `count` tokens of it are used (its end, or its checkpoint at a divergence)."""
    entry: Entry
    snapshot: object  # serve.kvstore.snapshot.Snapshot
    count: int


@dataclass
class PendingSnapshot:
    """A snapshot read out of the cache, not yet written (see `KVStore.prepare`)."""
    name: str
    tokens: list[int]
    logits: torch.Tensor
    state: dict
    why: str
    checkpoints: dict = field(default_factory=dict)  # position -> host copy of a `take_checkpoint`
    tenant: str | None = None                         # its tenant's tag


class KVStore:
    """The engine's `KVStore` on disk. See the module docstring for the rules, `serve.kvstore.snapshot` for the format.

    `model` is fingerprinted once; `ctx`, `dtype` (default: the model's) and `kv_rows` (the row
    format, `ds4_torch.kv_format`) give the layout of the engine's live cache. `every` > 0: a growing sequence is snapshotted again every `every` tokens
    (`checkpoint_due`). `min_tokens`: shorter sequences are not worth a file. `registry`: a
    prometheus_client registry for the `ds4_kv_disk_*` metrics (else plain counters only)."""

    def __init__(self, directory, space_mb: float, model, *, ctx: int = 4096, dtype: torch.dtype | None = None,
                 kv_rows: str = "full", every: int = 0, min_tokens: int = 16, registry=None, quarantine_max: int = 16):
        if not space_mb or space_mb <= 0:
            raise ValueError(f"space_mb must be > 0, got {space_mb!r}")
        self.dir = os.path.abspath(os.fspath(directory))
        self.qdir = os.path.join(self.dir, QUARANTINE)
        self.budget = int(space_mb * 2**20)
        self.every, self.min_tokens, self.quarantine_max = every, min_tokens, quarantine_max
        self.model_fp = model_fingerprint(model)
        self.layout = Layout.of(model.config, ctx, dtype or model.dtype, kv_rows)
        self.prefix = name_prefix(self.model_fp, self.layout)
        self.counts = _Counts()
        self.prom = _PromMetrics(registry) if registry is not None else None
        self.entries: dict[str, Entry] = {}
        self.last_rejection: tuple[str, str, str] | None = None   # (file, reason, detail)
        self._restored: str | None = None       # file of the last restore, until its first step passes
        self.restored_checkpoints: dict = {}     # the last restore's checkpoints (position -> CPU tensors)
        self.loaded_bytes = 0                    # snapshots `load` read, until no reference is left (`_hold`)
        self._held_lock = threading.RLock()      # RLock: a release runs in whatever thread drops the last reference
        self._lock = threading.RLock()         # the index (`entries`): held briefly, never across a write
        self._write_lock = threading.Lock()    # the background writer's: encoding, writing, evicting
        self._lockfile = None
        os.makedirs(self.qdir, exist_ok=True)
        self._take_lock()
        self._scan()

    # ---------------------------------------------------------------- start / stop
    def _take_lock(self) -> None:
        f = open(os.path.join(self.dir, LOCK), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RuntimeError(f"disk KV cache {self.dir} is in use by another process") from None
            raise
        self._lockfile = f

    def _scan(self) -> None:
        stats = {}
        try:
            with open(os.path.join(self.dir, STATS)) as f:
                stats = json.load(f)
            assert isinstance(stats, dict)
        except (OSError, ValueError, AssertionError):
            stats = {}
        for d in (self.dir, self.qdir):  # what a crash mid-write left (snapshots, stats, notes)
            for name in os.listdir(d):
                if name.startswith(TMP_PREFIX):
                    log.info("kvstore: removing stale temporary file %s", name)
                    _unlink(os.path.join(d, name))
        for name in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, name)
            if not (name.endswith(SUFFIX) and name.startswith(self.prefix)):
                continue  # another model's or layout's snapshots: kept, counted, evicted first
            try:
                snap = read_snapshot(path, self.model_fp, self.layout, tokens_only=True)
                if name != self._name(snap.tokens, snap.header.get("tenant")):
                    raise SnapshotError("header", "file name does not match its tokens")
            except SnapshotError as e:
                self._quarantine(name, e)
                continue
            st = os.stat(path)
            s = stats.get(name) if isinstance(stats.get(name), dict) else {}
            self.entries[name] = Entry(name, snap.tokens, st.st_size, snap.header.get("created", st.st_mtime),
                                       st.st_mtime, hits=int(s.get("hits", 0)),
                                       checkpoints=tuple(snap.header.get("checkpoints") or ()),
                                       tenant=snap.header.get("tenant"))
        self._trim_quarantine()
        self._make_room()  # a crash between a write and its eviction, or a smaller budget
        self._update_gauges()
        log.info("kvstore: %s: %d snapshots, %.1f of %.1f MiB", self.dir, len(self.entries), self.usage() / 2**20,
                 self.budget / 2**20)

    def close(self) -> None:
        """Write the hit statistics and release the directory (once: after that the directory may
        be another process's)."""
        with self._lock:
            if self._lockfile is None:
                return
            try:
                self._write_stats()
            except OSError as e:
                log.warning("kvstore: cannot write %s: %s", STATS, e)
            if self._lockfile is not None:
                self._lockfile.close()
                self._lockfile = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- the engine's hooks
    def _own(self, tenant) -> list[Entry]:
        """`tenant`'s snapshots (the index lock held): the only ones its requests may reuse."""
        tag = tenant_tag(tenant)
        return [e for e in self.entries.values() if e.tenant == tag]

    def _ranked(self, prompt_ids: list[int], tenant) -> list[tuple[int, Entry]]:
        """`tenant`'s snapshots by how much of `prompt_ids` each brings back, best first (the index lock held)."""
        return sorted(((e.reuse(prompt_ids), e) for e in self._own(tenant)), key=lambda s: s[0], reverse=True)

    def stored_prefix(self, prompt_ids: list[int], tenant=None) -> int:
        """Tokens of `prompt_ids` the best of `tenant`'s snapshots would bring back (`restore`
        tries it first)."""
        with self._lock:
            return max((e.reuse(prompt_ids) for e in self._own(tenant)), default=0)

    def restore(self, cache: DS4Cache, prompt_ids: list[int], tenant=None) -> tuple[int, torch.Tensor | None] | None:
        """Load the longest state of `prompt_ids` stored for `tenant` into sequence 0 of `cache`: a snapshot
        that is a prefix of it, or one diverging from it, rewound to its checkpoint at or below the
        divergence (`Entry.reuse`). Return (tokens restored, logits of the next token: None from a
        checkpoint) or None. Snapshots that fail validation are quarantined and the next best is
        tried; `cache` is only written once one passed. `load` then `apply`, on one thread (the
        engine runs `load` on a reader thread and only `apply` on its own)."""
        with self._lock:
            self._restored, self.restored_checkpoints = None, {}
        if not self._check_cache(cache):
            return None
        while True:
            loaded = self.load(prompt_ids, tenant)
            if loaded is None:
                return None
            restored = self.apply(cache, loaded)
            if restored is not None or loaded.entry.name in self.entries:
                return restored  # else `apply` quarantined it: the next best

    def load(self, prompt_ids: list[int], tenant=None) -> "LoadedSnapshot | None":
        """The best state of `prompt_ids` stored for `tenant`, read and fully checked into host memory, or None
        (a miss). Any thread: the file is read without holding the index lock the engine takes.
        Snapshots that fail validation are quarantined and the next best is tried."""
        with self._lock:
            scored = self._ranked(prompt_ids, tenant)
        for count, entry in scored:
            if count == 0:
                break
            try:
                self._count("reads")
                snap = read_snapshot(os.path.join(self.dir, entry.name), self.model_fp, self.layout)
                self._hold(snap)
                if snap.tokens != entry.tokens:
                    raise SnapshotError("token_hash", "token ids differ from the ones indexed at start")
                if count < entry.n and count not in snap.checkpoints:
                    raise SnapshotError("state", f"no checkpoint at {count}")
            except SnapshotError as e:
                error = e
            except Exception as e:  # noqa: BLE001 - whatever else reading this file causes, it is not tried again
                error = SnapshotError("state", f"{type(e).__name__}: {e}")
            else:
                return LoadedSnapshot(entry, snap, count)
            with self._lock:
                if entry.name in self.entries:  # else evicted meanwhile: nothing wrong with it
                    self._quarantine(entry.name, error)
        self._count("misses")
        return None

    def first_choice(self, prompt_ids: list[int], tenant=None) -> str | None:
        """The snapshot `load(prompt_ids, tenant)` would read first (requests that would read the same
        one share that read: `share`), or None (a miss)."""
        with self._lock:
            ranked = self._ranked(prompt_ids, tenant)
        return ranked[0][1].name if ranked and ranked[0][0] > 0 else None

    def share(self, loaded: "LoadedSnapshot", prompt_ids: list[int], tenant=None) -> "LoadedSnapshot | None":
        """What another request's `load` read, for `prompt_ids` of `tenant`: the same tensors (no
        copy) with this prompt's own count, or None when that snapshot cannot serve it (another
        tenant's, no common prefix, or no checkpoint at the divergence)."""
        entry, snap = loaded.entry, loaded.snapshot
        if entry.tenant != tenant_tag(tenant):
            return None
        count = entry.reuse(prompt_ids)
        if count == 0 or (count < entry.n and count not in snap.checkpoints):
            return None
        return LoadedSnapshot(entry, snap, count)

    def apply(self, cache: DS4Cache, loaded: "LoadedSnapshot") -> tuple[int, torch.Tensor | None] | None:
        """Copy a loaded state into sequence 0 of `cache` (all the engine thread does of a restore):
        (tokens restored, logits of the next token: None from a checkpoint), or None when the
        cache refused it (the snapshot is quarantined)."""
        entry, snap, count = loaded.entry, loaded.snapshot, loaded.count
        with self._lock:
            self._restored, self.restored_checkpoints = None, {}
            if not self._check_cache(cache):
                return None
            try:  # checks every name, shape and dtype before it writes anything into the live cache
                cache.import_sequence(0, snap.state)
                if count < entry.n:  # the prompt diverges inside it: rewind to the checkpoint
                    cache.restore_checkpoint(0, snap.checkpoints[count])
            except (ValueError, KeyError) as e:  # any other error (a device failing) is the engine's
                cache.reset(0)
                if entry.name in self.entries:
                    self._quarantine(entry.name, SnapshotError("state", f"the cache refused it: {e}"))
                return None
            entry.hits += 1
            entry.last_used = time.time()
            self._restored = entry.name
            self.restored_checkpoints = {c: ck for c, ck in snap.checkpoints.items() if c <= count}
            self._count("hits")
            self._count("restored_tokens", count)
        _touch(os.path.join(self.dir, entry.name))
        log.info("kvstore: restored %d tokens from %s%s", count, entry.name,
                 "" if count == entry.n else f" (its checkpoint at {count} of {entry.n})")
        return count, (snap.logits.to(cache.device).clone() if count == entry.n else None)

    @property
    def last_restored(self) -> str | None:
        """The file the last `restore` loaded, until `restore_ok`/`restore_failed` settles it."""
        return self._restored

    def restore_failed(self, error: BaseException | str = "", name: str | None = None) -> None:
        """The first step after a restore (of `name`, default: the last one) failed: quarantine
        that snapshot."""
        with self._lock:
            if name is None or name == self._restored:
                name, self._restored = self._restored, None
            if name is not None and name in self.entries:
                self._quarantine(name, SnapshotError("restore_failed", f"first step after restore failed: {error}"))

    def restore_ok(self, name: str | None = None) -> None:
        """The first step after a restore (of `name`, default: the last one) passed."""
        if name is None or name == self._restored:
            self._restored = None

    def save(self, cache: DS4Cache, token_ids: list[int], last_logits: torch.Tensor, why: str = "prefill",
             checkpoints: dict | None = None, tenant=None) -> bool:
        """Write a snapshot of sequence 0 of `cache` (holding `token_ids`, `last_logits` the logits
        of the next token, with `checkpoints` as `prepare` takes them) for `tenant` unless it is
        too short, already stored, or larger than the budget."""
        pending = self.prepare(cache, token_ids, last_logits, why, checkpoints, tenant)
        return pending is not None and self.write(pending)

    def prepare(self, cache: DS4Cache, token_ids: list[int], last_logits: torch.Tensor,
                why: str = "prefill", checkpoints: dict | None = None, tenant=None) -> "PendingSnapshot | None":
        """The part of a save that reads the cache: checks, then a host copy of sequence 0's live
        state (`tenant`'s conversation) and of `checkpoints` ({position: its `take_checkpoint`},
        positions below the token count) (it costs what the snapshot holds). None when not worth
        a file. `write` does the rest, on any thread: the engine hands it to a background writer."""
        with self._lock:
            n = len(token_ids)
            if n < max(1, self.min_tokens) or last_logits is None or n > self.layout.max_context:
                return None
            tag = tenant_tag(tenant)
            name = self._name(token_ids, tag)
            if name in self.entries:
                self.entries[name].last_used = time.time()
                return None
            if not self._check_cache(cache):
                return None
            if int(cache.positions[0]) != n or cache.is_invalid(0):
                log.warning("kvstore: not saving %d tokens: the cache holds %d", n, int(cache.positions[0]))
                return None
            return PendingSnapshot(name, list(token_ids), last_logits.detach().to("cpu", copy=True),
                                   cache.export_sequence(0, device="cpu"), why,
                                   {c: {k: t.to("cpu", copy=True) for k, t in checkpoint.items()}
                                    for c, checkpoint in (checkpoints or {}).items()}, tag)

    def write(self, pending: "PendingSnapshot") -> bool:
        """Encode and write a prepared snapshot; evict only once it is safely on disk. The lock the
        engine's `prepare` and `restore` take is held only to read and update the index, never
        while encoding or writing: snapshots never stall decoding."""
        t0 = time.perf_counter()
        name, n = pending.name, len(pending.tokens)
        with self._lock:
            if name in self.entries:
                return False
        with self._write_lock:  # one write (and its eviction) at a time
            try:
                head, payloads = encode_snapshot(self.model_fp, self.layout, pending.tokens, pending.logits,
                                                 pending.state, pending.checkpoints, pending.tenant)
            except SnapshotError as e:
                log.warning("kvstore: not saving %d tokens: %s", n, e)
                return False
            size = len(head) + sum(p.nbytes for p in payloads)
            if size > self.budget:
                log.info("kvstore: a snapshot of %d tokens (%d bytes) is larger than the budget (%d)", n, size,
                         self.budget)
                return False
            path = os.path.join(self.dir, name)
            try:
                write_atomically(path, [head, *payloads], pause=float(os.environ.get(WRITE_DELAY_ENV) or 0))
            except OSError as e:
                log.warning("kvstore: cannot write %s: %s", name, e)
                _unlink(path)  # renamed but not made durable: not indexed, so not kept either
                self._update_gauges()
                return False
            self._make_room()  # only now: a failed write must not cost other snapshots
            now = time.time()
            with self._lock:
                self.entries[name] = Entry(name, pending.tokens, size, now, now,
                                           checkpoints=tuple(sorted(pending.checkpoints)), tenant=pending.tenant)
                self._count("saves")
            self._update_gauges()
            log.info("kvstore: saved %d tokens (%s, %.1f KiB, %.0f ms)", n, pending.why, size / 1024,
                     1000 * (time.perf_counter() - t0))
            return True

    def checkpoint_due(self, n_tokens: int, saved_at: int) -> bool:
        """A sequence of `n_tokens` last snapshotted at `saved_at` tokens is due another one."""
        return self.every > 0 and n_tokens >= saved_at + self.every

    # ---------------------------------------------------------------- inspection
    def usage(self) -> int:
        """Bytes this store owns under its directory (all snapshot files, temporary files,
        quarantine, stats, lock)."""
        total = 0
        for d in (self.dir, self.qdir):
            try:
                with os.scandir(d) as it:
                    for e in it:
                        if e.is_file(follow_symlinks=False) and _owned(e.name, d == self.qdir):
                            total += e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
        return total

    def quarantined(self) -> list[str]:
        return self._quarantine_files(by_age=False)

    def stats(self) -> dict:
        c = self.counts
        return {"dir": self.dir, "snapshots": len(self.entries), "bytes": self.usage(), "budget": self.budget,
                "hits": c.hits, "misses": c.misses, "saves": c.saves, "reads": c.reads, "evictions": c.evictions,
                "loaded_bytes": self.loaded_bytes,
                "restored_tokens": c.restored_tokens, "rejected": dict(c.rejected)}

    # ---------------------------------------------------------------- internals
    def _name(self, tokens, tag: str | None = None) -> str:
        return file_name(self.model_fp, self.layout, tokens, tag)

    def _check_cache(self, cache: DS4Cache) -> bool:
        got = Layout.of_cache(cache)
        if got != self.layout:
            log.error("kvstore: the cache's layout (max_context %d, %s, %s rows) is not the store's (%d, %s, %s "
                      "rows): the store is unused; build it with the engine's ctx, dtype and kv_rows",
                      cache.max_context, cache.dtype, cache.kv_rows.name, self.layout.max_context,
                      self.layout.dtype, self.layout.kv_rows)
            return False
        return True

    def _make_room(self) -> None:
        """Delete until the directory fits the budget: quarantine (oldest first), other models'
        and layouts' snapshots (oldest first), then our indexed snapshots by ascending score (a
        file not yet indexed, the one just written, is never a victim)."""
        if self.usage() <= self.budget:
            return
        now = time.time()
        victims = [os.path.join(self.qdir, n) for n in self._quarantine_files()]
        foreign = [n for n in os.listdir(self.dir) if n.endswith(SUFFIX) and not n.startswith(self.prefix)]
        victims += sorted((os.path.join(self.dir, n) for n in foreign), key=_mtime)
        with self._lock:
            ours = sorted(self.entries.values(), key=lambda e: e.score(now))
        victims += [os.path.join(self.dir, e.name) for e in ours]
        for path in victims:
            if self.usage() <= self.budget:
                break
            name = os.path.basename(path)
            if os.path.dirname(path) == self.qdir:
                _unlink(path)
                _unlink(path + ".why")
                continue
            with self._lock:  # out of the index first: a restore no longer picks it
                evicted = self.entries.pop(name, None) is not None
                if evicted:
                    self._count("evictions")
            _unlink(path)
            if evicted:
                log.info("kvstore: evicted %s", name)

    def _quarantine_files(self, by_age: bool = True) -> list[str]:
        """Quarantined snapshots (not their notes nor temporary files), oldest first (or by name)."""
        names = sorted(n for n in os.listdir(self.qdir) if not n.endswith(".why") and not n.startswith(TMP_PREFIX))
        return sorted(names, key=lambda n: _mtime(os.path.join(self.qdir, n))) if by_age else names

    def _trim_quarantine(self) -> None:
        files = self._quarantine_files()
        for name in files[:max(0, len(files) - self.quarantine_max)]:
            _unlink(os.path.join(self.qdir, name))
            _unlink(os.path.join(self.qdir, name + ".why"))

    def _quarantine(self, name: str, err: SnapshotError) -> None:
        """Move a rejected snapshot out of the way (never tried again, even after a restart)."""
        self.entries.pop(name, None)
        if self._restored == name:
            self._restored = None
        src = os.path.join(self.dir, name)
        qname = f"{name}.{int(time.time())}.{err.reason}"
        log.warning("kvstore: rejected %s (%s): %s; moved to %s/", name, err.reason, err.detail, QUARANTINE)
        try:
            os.replace(src, os.path.join(self.qdir, qname))
            fsync_dir(self.qdir)
            fsync_dir(self.dir)
        except OSError as e:
            log.warning("kvstore: cannot quarantine %s (%s); deleting it", name, e)
            _unlink(src)
        else:
            # the note only explains; the file is already out of the way without it
            note = {"file": name, "reason": err.reason, "detail": err.detail, "time": time.time()}
            try:
                write_atomically(os.path.join(self.qdir, qname + ".why"), [json.dumps(note).encode()])
            except OSError as e:
                log.warning("kvstore: cannot write the quarantine note for %s: %s", name, e)
        self.last_rejection = (name, err.reason, err.detail)
        self.counts.rejected[err.reason] = self.counts.rejected.get(err.reason, 0) + 1
        if self.prom is not None:
            self.prom.rejected.labels(reason=err.reason).inc()
        self._trim_quarantine()
        self._update_gauges()

    def _write_stats(self) -> None:
        blob = json.dumps({e.name: {"hits": e.hits} for e in self.entries.values() if e.hits}).encode()
        write_atomically(os.path.join(self.dir, STATS), [blob])
        self._make_room()

    def _count(self, what: str, k: int = 1) -> None:
        setattr(self.counts, what, getattr(self.counts, what) + k)
        if self.prom is not None:
            getattr(self.prom, what).inc(k)

    def _hold(self, snap) -> None:
        """Count `snap`'s bytes in `loaded_bytes` until the last reference to it is gone (every
        request that shared it applied or dropped it)."""
        tensors = [snap.logits, *snap.state.values(), *(t for c in snap.checkpoints.values() for t in c.values())]
        nbytes = sum(t.nbytes for t in tensors if t is not None)
        self._add_loaded(nbytes)
        weakref.finalize(snap, self._add_loaded, -nbytes)

    def _add_loaded(self, nbytes: int) -> None:
        with self._held_lock:
            self.loaded_bytes += nbytes
            if self.prom is not None:
                self.prom.loaded_bytes.set(self.loaded_bytes)

    def _update_gauges(self) -> None:
        if self.prom is not None:
            self.prom.bytes.set(self.usage())
            self.prom.snapshots.set(len(self.entries))


def _owned(name: str, in_quarantine: bool) -> bool:
    # The exact-replay records (serve.http.replay) share the directory and its budget.
    return in_quarantine or name.endswith(SUFFIX) or name.startswith(TMP_PREFIX) or name in (STATS, LOCK) \
        or name.startswith(REPLAY_FILE)


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("kvstore: cannot delete %s: %s", path, e)

