"""Disk KV cache: snapshots of a sequence's whole `DS4Cache` state, restored on a live-cache miss.

A snapshot holds everything a decode step needs to continue a sequence of N tokens: every
layer's window ring, the compressed rows written so far (only the N // m rows that exist, so a
snapshot's size follows N, not `--ctx`), the indexer rows, the compressor frontier (open window,
CSA overlap), the counters, the token ids and the logits of the next token.

File format (`<model>-<layout>-<N>-<tokens hash>.ds4kv`, version 1, little endian)::

    magic  b"DS4KVSNP"  | version u32 | header length u32 | xxh3_64 of the header u64
    header: UTF-8 JSON  {model, layout, n_tokens, tokens_hash, created, checksum: "xxh3_64",
                         sections: [{name, dtype, shape, nbytes, xxh3}, ...]}
    sections, back to back, in the header's order

- `model` fingerprints the config plus every weight's name, shape, dtype and an xxh3_64 of its
  bytes (computed once per model object); `layout` fingerprints the cache layout (window,
  layer kinds and rates, dims, dtype, capacities, max_context).
- Writes go to a temporary file (`.tmp-*`) that is fsynced, renamed into place, and the
  directory fsynced: a crash leaves either no snapshot or a whole one. Stale temporary files
  are removed at start. One process per directory (an flock on `DIR/.lock`).

Validation on load (a failure quarantines the file: it is moved to `DIR/quarantine/` with a
`.why` note, counted in `ds4_kv_disk_rejected_total{reason}`, and never tried again):
size (`truncated`/`size`), magic, version, header checksum and structure (`header`), layout,
model, every section's checksum (`checksum`), the token hash (`token_hash`), and the state
itself (`state`): counters equal the token count, compressed-row counts equal N // m, every
value finite except the CSA overlap gates, which are -inf exactly while no window has closed
(N < m) and finite after; ring slots and open-window slots past the count are zero. The restore
is assembled in a staging cache and copied into the live cache only once complete. The engine
reports a failure of the first step after a restore (`restore_failed`): that file is
quarantined too and the request is prefilled from scratch.

Budget: every byte this store owns under DIR (snapshots, temporary files, quarantine, the stats
file) stays within `space_mb`. To make room it deletes quarantined files first (oldest first),
then snapshots of other models/layouts, then its own snapshots with the lowest score
`(1 + hits) * tokens / (1 + age / 10 min)`: old, rarely hit, cheap-to-recompute ones go first.
A snapshot larger than the whole budget is not written.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import struct
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field

import torch
import xxhash

from ds4_torch.cache import DS4Cache

log = logging.getLogger("ds4.serve.kvstore")

MAGIC = b"DS4KVSNP"
VERSION = 1
FIXED = struct.Struct("<8sIIQ")      # magic, version, header length, xxh3_64(header)
MAX_HEADER = 16 * 2**20
SUFFIX = ".ds4kv"
TMP_PREFIX = ".tmp-"
QUARANTINE = "quarantine"
STATS = "stats.json"
LOCK = ".lock"
WRITE_DELAY_ENV = "DS4_TORCH_KV_WRITE_DELAY"   # test hook: seconds slept between sections of a write

REASONS = ("truncated", "size", "magic", "version", "header", "layout", "model", "checksum", "token_hash",
           "state", "restore_failed", "io")

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64)}


class SnapshotError(Exception):
    """A snapshot that must not be used: `reason` is the metric label, `detail` says what."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _xxh(buf) -> str:
    return xxhash.xxh3_64_hexdigest(buf)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# ------------------------------------------------------------------------------ fingerprints
_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def model_fingerprint(model) -> str:
    """sha256 over the config and every weight's name, shape, dtype and xxh3_64(bytes).
    Computed once per model object (a copy is fingerprinted anew; weights changed in place after
    the first call are not noticed)."""
    cached = _FINGERPRINTS.get(model)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    cfg = dataclasses.asdict(model.config) if dataclasses.is_dataclass(model.config) else vars(model.config)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(f"\n{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        digest = xxhash.xxh3_64()
        flat = t.detach().reshape(-1)
        step = max(1, (64 * 2**20) // max(1, t.element_size()))  # device tensors go to the host in pieces
        for a in range(0, flat.numel(), step):
            digest.update(_tensor_bytes(flat[a:a + step]))
        h.update(digest.hexdigest().encode())
    fp = h.hexdigest()
    _FINGERPRINTS[model] = fp
    return fp


@dataclass(frozen=True)
class Layout:
    """What a snapshot's shape depends on; `fingerprint` names it."""
    window: int
    head_dim: int
    index_head_dim: int
    vocab_size: int
    layers: tuple[tuple[str, int], ...]     # (kind, rate) per layer
    dtype: str
    max_context: int
    capacities: tuple[int, ...]

    @classmethod
    def of(cls, config, max_context: int, dtype: torch.dtype) -> "Layout":
        layers = tuple((config.layer_types[i], config.compress_rate(i)) for i in range(config.num_hidden_layers))
        return cls(config.sliding_window, config.head_dim, config.index_head_dim, config.vocab_size, layers,
                   _dtype_name(dtype), max_context,
                   tuple(math.ceil(max_context / r) if r else 0 for _, r in layers))

    @classmethod
    def of_cache(cls, cache: DS4Cache) -> "Layout":
        return cls.of(cache.config, cache.max_context, cache.dtype)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()

    def sections(self, n: int, logits_dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every section of a snapshot of `n` tokens, in file order."""
        d = self.dtype
        out = [("tokens", "int32", (n,)), ("logits", logits_dtype, (self.vocab_size,)),
               ("counters", "int64", (1 + len(self.layers),))]
        for i, (kind, rate) in enumerate(self.layers):
            out.append((f"L{i}.window", d, (self.window, self.head_dim)))
            if not rate:
                continue
            csa = kind == "compressed_sparse_attention"
            for part, dim in (("comp", self.head_dim),) + ((("idx", self.index_head_dim),) if csa else ()):
                width = 2 * dim if csa else dim
                out += [(f"L{i}.{part}.rows", d, (n // rate, dim)),
                        (f"L{i}.{part}.open_kv", d, (rate, width)),
                        (f"L{i}.{part}.open_gate", d, (rate, width))]
                if csa:
                    out += [(f"L{i}.{part}.prev_kv", d, (rate, dim)), (f"L{i}.{part}.prev_gate", d, (rate, dim))]
        return out


def tokens_hash(tokens) -> str:
    return _xxh(struct.pack(f"<{len(tokens)}i", *tokens))


# ------------------------------------------------------------------------------ (de)serialization
def _cache_sections(cache: DS4Cache, index: int, n: int) -> dict[str, torch.Tensor]:
    """The state of sequence `index` (n tokens) as CPU tensors, canonical: only the N // m rows
    that exist, open-window slots past the count zeroed (they hold stale values nothing reads)."""
    out = {}
    for i, layer in enumerate(cache.layers):
        out[f"L{i}.window"] = layer.window[index].detach().to("cpu").clone()
        if not layer.rate:
            continue
        m = layer.rate
        for part, state in zip(("comp", "idx"), layer.states):
            cap = state.rows.shape[1] - 1
            live_rows = state.rows[index]
            if bool(live_rows[n // m:cap].any()):
                raise SnapshotError("state", f"layer {i} {part}: compressed rows written past {n // m} = {n} // {m}")
            out[f"L{i}.{part}.rows"] = live_rows[:n // m].detach().to("cpu").clone()
            for name in ("open_kv", "open_gate"):
                t = getattr(state, name)[index].detach().to("cpu").clone()
                t[n % m:] = 0
                out[f"L{i}.{part}.{name}"] = t
            if state.prev_kv is not None:
                out[f"L{i}.{part}.prev_kv"] = state.prev_kv[index].detach().to("cpu").clone()
                out[f"L{i}.{part}.prev_gate"] = state.prev_gate[index].detach().to("cpu").clone()
    return out


def check_state(layout: Layout, n: int, tensors: dict[str, torch.Tensor]) -> None:
    """Raise SnapshotError("state") unless `tensors` is a state a cache can really be in after n
    tokens. Precisely: counters == (n, n // m per compressed layer, 0 for sliding); token ids in
    the vocabulary; logits finite; every cache value finite, except the CSA overlap gates
    (`prev_gate`), which are all -inf while no window has closed (n < m, with `prev_kv` all zero)
    and all finite after; ring slots >= n (n < window) and open-window slots >= n % m zero."""
    def bad(what):
        raise SnapshotError("state", what)

    if not 1 <= n <= layout.max_context:
        bad(f"token count {n} outside [1, max_context {layout.max_context}]")
    tokens = tensors["tokens"]
    if tokens.numel() != n:
        bad(f"{tokens.numel()} token ids for a count of {n}")
    if bool(((tokens < 0) | (tokens >= layout.vocab_size)).any()):
        bad(f"token id outside the vocabulary [0, {layout.vocab_size})")
    if not bool(torch.isfinite(tensors["logits"]).all()):
        bad("logits not finite")
    expected = [n] + [n // r if r else 0 for _, r in layout.layers]
    if tensors["counters"].tolist() != expected:
        bad(f"counters {tensors['counters'].tolist()} != {expected} (positions, rows per layer) for {n} tokens")
    for i, (kind, rate) in enumerate(layout.layers):
        w = tensors[f"L{i}.window"]
        if not bool(torch.isfinite(w).all()):
            bad(f"layer {i} window not finite")
        if n < layout.window and bool(w[n:].any()):
            bad(f"layer {i} window slots >= {n} written")
        if not rate:
            continue
        for part in ("comp", "idx") if kind == "compressed_sparse_attention" else ("comp",):
            p = f"L{i}.{part}"
            for name in ("rows", "open_kv", "open_gate"):
                if not bool(torch.isfinite(tensors[f"{p}.{name}"]).all()):
                    bad(f"{p}.{name} not finite")
            for name in ("open_kv", "open_gate"):
                if bool(tensors[f"{p}.{name}"][n % rate:].any()):
                    bad(f"{p}.{name}: slots past the open window's {n % rate} tokens written")
            if f"{p}.prev_gate" in tensors:
                kv, gate = tensors[f"{p}.prev_kv"], tensors[f"{p}.prev_gate"]
                if n < rate:
                    if bool(kv.any()) or not bool((gate == float("-inf")).all()):
                        bad(f"{p}: overlap set before the first window closed")
                elif not (bool(torch.isfinite(kv).all()) and bool(torch.isfinite(gate).all())):
                    bad(f"{p}: overlap not finite after a window closed")


def encode_snapshot(model_fp: str, layout: Layout, tokens: list[int], logits: torch.Tensor,
                    state: dict[str, torch.Tensor]) -> tuple[bytes, list[memoryview]]:
    """(fixed part + header, section payloads) of a snapshot."""
    n = len(tokens)
    logits = logits.detach().to("cpu").reshape(-1).contiguous()
    tensors = dict(state)
    tensors["tokens"] = torch.tensor(tokens, dtype=torch.int32)
    tensors["logits"] = logits
    tensors["counters"] = torch.tensor([n] + [n // r if r else 0 for _, r in layout.layers], dtype=torch.int64)
    check_state(layout, n, tensors)  # never persist a state that would be rejected on load
    table, payloads = [], []
    for name, dtype, shape in layout.sections(n, _dtype_name(logits.dtype)):
        t = tensors[name]
        if tuple(t.shape) != shape or _dtype_name(t.dtype) != dtype:
            raise SnapshotError("state", f"section {name}: {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
        buf = _tensor_bytes(t)
        payloads.append(buf)
        table.append({"name": name, "dtype": dtype, "shape": list(shape), "nbytes": buf.nbytes, "xxh3": _xxh(buf)})
    header = json.dumps({"model": model_fp, "layout": layout.fingerprint, "n_tokens": n,
                         "tokens_hash": tokens_hash(tokens), "created": time.time(), "checksum": "xxh3_64",
                         "sections": table}, separators=(",", ":")).encode()
    return FIXED.pack(MAGIC, VERSION, len(header), xxhash.xxh3_64_intdigest(header)) + header, payloads


def read_header(f, file_size: int) -> tuple[dict, int]:
    """Parse and check the fixed part and header of an open snapshot: (header, payload offset)."""
    raw = f.read(FIXED.size)
    if len(raw) < FIXED.size:
        raise SnapshotError("truncated", f"{file_size} bytes: shorter than the fixed header")
    magic, version, hlen, hsum = FIXED.unpack(raw)
    if magic != MAGIC:
        raise SnapshotError("magic", f"magic {magic!r} != {MAGIC!r}")
    if version != VERSION:
        raise SnapshotError("version", f"format version {version}, this build reads {VERSION}")
    if hlen > MAX_HEADER:
        raise SnapshotError("header", f"header length {hlen} > {MAX_HEADER}")
    body = f.read(hlen)
    if len(body) < hlen:
        raise SnapshotError("truncated", f"header cut short ({len(body)} of {hlen} bytes)")
    if xxhash.xxh3_64_intdigest(body) != hsum:
        raise SnapshotError("header", "header checksum mismatch")
    try:
        header = json.loads(body)
        n = header["n_tokens"]
        sections = header["sections"]
        assert isinstance(n, int) and isinstance(sections, list) and header["checksum"] == "xxh3_64"
        assert isinstance(header["tokens_hash"], str)
        assert all(isinstance(s["name"], str) and isinstance(s["nbytes"], int) and isinstance(s["dtype"], str)
                   and isinstance(s["xxh3"], str) and isinstance(s["shape"], list)
                   and all(isinstance(d, int) for d in s["shape"]) for s in sections)
    except Exception as e:  # noqa: BLE001 - any malformed header
        raise SnapshotError("header", f"malformed header: {type(e).__name__}: {e}") from None
    return header, FIXED.size + hlen


def check_header(header: dict, file_size: int, payload_at: int, model_fp: str, layout: Layout) -> None:
    if header.get("layout") != layout.fingerprint:
        raise SnapshotError("layout", "written for another cache layout (window, rates, dims, dtype or context)")
    if header.get("model") != model_fp:
        raise SnapshotError("model", "written by another model (config or weights differ)")
    n = header["n_tokens"]
    if not 1 <= n <= layout.max_context:
        raise SnapshotError("header", f"token count {n} outside [1, {layout.max_context}]")
    got = [(s["name"], s["dtype"], tuple(s["shape"])) for s in header["sections"]]
    logits_dtype = got[1][1] if len(got) > 1 else ""
    want = layout.sections(n, logits_dtype)
    if got != want or logits_dtype not in _DTYPES:
        raise SnapshotError("header", "section table does not match the layout")
    for s, (_, dtype, shape) in zip(header["sections"], want):
        if s["nbytes"] != math.prod(shape) * _DTYPES[dtype].itemsize:
            raise SnapshotError("header", f"section {s['name']}: {s['nbytes']} bytes for {shape} {dtype}")
    expected = payload_at + sum(s["nbytes"] for s in header["sections"])
    if file_size < expected:
        raise SnapshotError("truncated", f"{file_size} bytes, the header describes {expected}")
    if file_size > expected:
        raise SnapshotError("size", f"{file_size} bytes, the header describes {expected}")


def _read_section(f, s: dict) -> torch.Tensor:
    buf = bytearray(s["nbytes"])
    if f.readinto(buf) != len(buf):
        raise SnapshotError("truncated", f"section {s['name']} cut short")
    if _xxh(buf) != s["xxh3"]:
        raise SnapshotError("checksum", f"section {s['name']}: checksum mismatch")
    t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return t.view(_DTYPES[s["dtype"]]).reshape(s["shape"])


def read_snapshot(path: str, model_fp: str, layout: Layout, tokens_only: bool = False) -> tuple[dict, dict]:
    """(header, {section: CPU tensor}) of a fully checked snapshot; SnapshotError otherwise.
    `tokens_only` stops after the token ids (for the index at start)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header, at = read_header(f, size)
            check_header(header, size, at, model_fp, layout)
            tensors = {}
            for s in header["sections"]:
                tensors[s["name"]] = _read_section(f, s)
                if s["name"] == "tokens":
                    if tokens_hash(tensors["tokens"].tolist()) != header["tokens_hash"]:
                        raise SnapshotError("token_hash", "the token ids do not match the header's hash")
                    if tokens_only:
                        return header, tensors
    except SnapshotError:
        raise
    except OSError as e:
        raise SnapshotError("io", f"{type(e).__name__}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a header that passed its checksum yet is malformed
        raise SnapshotError("header", f"{type(e).__name__}: {e}") from None
    try:
        check_state(layout, header["n_tokens"], tensors)
    except SnapshotError:
        raise
    except Exception as e:  # noqa: BLE001
        raise SnapshotError("state", f"{type(e).__name__}: {e}") from None
    return header, tensors


# ------------------------------------------------------------------------------ the store
@dataclass
class Entry:
    name: str
    tokens: list[int]
    nbytes: int
    created: float
    last_used: float
    hits: int = 0

    @property
    def n(self) -> int:
        return len(self.tokens)

    def score(self, now: float) -> float:
        """Higher is worth keeping: hit often, used recently, expensive to prefill again."""
        return (1 + self.hits) * self.n / (1 + max(0.0, now - self.last_used) / 600.0)


@dataclass
class _Counts:
    hits: int = 0
    misses: int = 0
    saves: int = 0
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


class KVStore:
    """The engine's `KVStore` on disk. See the module docstring for the format and the rules.

    `model` is fingerprinted once; `ctx` and `dtype` (default: the model's) give the layout of the
    engine's live cache. `every` > 0: `checkpoint` saves every `every` tokens of a growing
    sequence. `min_tokens`: shorter sequences are not worth a file. `registry`: a
    prometheus_client registry for the `ds4_kv_disk_*` metrics (else plain counters only)."""

    def __init__(self, directory, space_mb: float, model, *, ctx: int = 4096, dtype: torch.dtype | None = None,
                 every: int = 0, min_tokens: int = 16, registry=None, quarantine_max: int = 16):
        if not space_mb or space_mb <= 0:
            raise ValueError(f"space_mb must be > 0, got {space_mb!r}")
        self.dir = os.path.abspath(os.fspath(directory))
        self.qdir = os.path.join(self.dir, QUARANTINE)
        self.budget = int(space_mb * 2**20)
        self.every, self.min_tokens, self.quarantine_max = every, min_tokens, quarantine_max
        self.model_fp = model_fingerprint(model)
        self.layout = Layout.of(model.config, ctx, dtype or model.dtype)
        self.prefix = f"{self.model_fp[:12]}-{self.layout.fingerprint[:8]}-"
        self.counts = _Counts()
        self.prom = _PromMetrics(registry) if registry is not None else None
        self.entries: dict[str, Entry] = {}
        self.last_rejection: tuple[str, str, str] | None = None   # (file, reason, detail)
        self._restored: str | None = None       # file of the last restore, until its first step passes
        self._mark = 0                          # tokens of the live sequence at the last save/restore
        self._lock = threading.RLock()
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
        for name in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, name)
            if name.startswith(TMP_PREFIX):
                log.info("kvstore: removing stale temporary file %s", name)
                _unlink(path)
                continue
            if not (name.endswith(SUFFIX) and name.startswith(self.prefix)):
                continue  # another model's or layout's snapshots: kept, counted, evicted first
            try:
                header, tensors = read_snapshot(path, self.model_fp, self.layout, tokens_only=True)
                if name != self._name(tensors["tokens"].tolist()):
                    raise SnapshotError("header", "file name does not match its tokens")
            except SnapshotError as e:
                self._quarantine(name, e)
                continue
            st = os.stat(path)
            s = stats.get(name) if isinstance(stats.get(name), dict) else {}
            self.entries[name] = Entry(name, tensors["tokens"].tolist(), st.st_size, header.get("created", st.st_mtime),
                                       st.st_mtime, hits=int(s.get("hits", 0)))
        self._trim_quarantine()
        self._update_gauges()
        log.info("kvstore: %s: %d snapshots, %.1f of %.1f MiB", self.dir, len(self.entries), self.usage() / 2**20,
                 self.budget / 2**20)

    def close(self) -> None:
        """Write the hit statistics and release the directory."""
        with self._lock:
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
    def restore(self, cache: DS4Cache, prompt_ids: list[int]) -> tuple[int, torch.Tensor] | None:
        """Load the longest stored prefix of `prompt_ids` into sequence 0 of `cache`; return
        (tokens restored, logits of the next token) or None. Snapshots that fail validation are
        quarantined and the next longest is tried; `cache` is only written once one passed."""
        with self._lock:
            self._restored = None
            self._mark = 0
            if not self._check_cache(cache):
                return None
            candidates = sorted((e for e in self.entries.values()
                                 if e.n <= len(prompt_ids) and prompt_ids[:e.n] == e.tokens),
                                key=lambda e: e.n, reverse=True)
            for entry in candidates:
                try:
                    header, tensors = read_snapshot(os.path.join(self.dir, entry.name), self.model_fp, self.layout)
                    if tensors["tokens"].tolist() != entry.tokens:
                        raise SnapshotError("token_hash", "token ids differ from the ones indexed at start")
                    staging = DS4Cache(cache.config, 1, cache.max_context, dtype=cache.dtype, device="cpu")
                    self._fill(staging, entry.n, tensors)
                except SnapshotError as e:
                    self._quarantine(entry.name, e)
                    continue
                except Exception as e:  # noqa: BLE001 - whatever else this file causes, it is not tried again
                    self._quarantine(entry.name, SnapshotError("state", f"{type(e).__name__}: {e}"))
                    continue
                cache.load_sequence(0, staging)
                cache.invalid.discard(0)
                entry.hits += 1
                entry.last_used = time.time()
                _touch(os.path.join(self.dir, entry.name))
                self._restored, self._mark = entry.name, entry.n
                self._count("hits")
                self._count("restored_tokens", entry.n)
                log.info("kvstore: restored %d tokens from %s", entry.n, entry.name)
                return entry.n, tensors["logits"].to(cache.device).clone()
            self._count("misses")
            return None

    def restore_failed(self, error: BaseException | str = "") -> None:
        """The engine's first step after the last restore failed: quarantine that snapshot."""
        with self._lock:
            name, self._restored = self._restored, None
            if name is not None and name in self.entries:
                self._quarantine(name, SnapshotError("restore_failed", f"first step after restore failed: {error}"))

    def restore_ok(self) -> None:
        """The first step after the last restore passed."""
        self._restored = None

    def save(self, cache: DS4Cache, token_ids: list[int], last_logits: torch.Tensor, why: str = "prefill") -> bool:
        """Write a snapshot of sequence 0 of `cache` (holding `token_ids`, `last_logits` the logits
        of the next token) unless it is too short, already stored, or larger than the budget."""
        with self._lock:
            n = len(token_ids)
            self._mark = n
            if n < max(1, self.min_tokens) or last_logits is None or n > self.layout.max_context:
                return False
            name = self._name(token_ids)
            if name in self.entries:
                self.entries[name].last_used = time.time()
                return False
            t0 = time.perf_counter()
            if not self._check_cache(cache):
                return False
            try:
                if int(cache.positions[0]) != n or 0 in cache.invalid:
                    raise SnapshotError("state", f"the cache holds {int(cache.positions[0])} tokens, not {n}")
                head, payloads = encode_snapshot(self.model_fp, self.layout, list(token_ids), last_logits,
                                                 _cache_sections(cache, 0, n))
            except SnapshotError as e:
                log.warning("kvstore: not saving %d tokens: %s", n, e)
                return False
            size = len(head) + sum(p.nbytes for p in payloads)
            if size > self.budget:
                log.info("kvstore: a snapshot of %d tokens (%d bytes) is larger than the budget (%d)", n, size,
                         self.budget)
                return False
            self._make_room(size)
            try:
                self._write(name, head, payloads)
            except OSError as e:
                log.warning("kvstore: cannot write %s: %s", name, e)
                return False
            now = time.time()
            self.entries[name] = Entry(name, list(token_ids), size, now, now)
            self._count("saves")
            self._update_gauges()
            log.info("kvstore: saved %d tokens (%s, %.1f KiB, %.0f ms)", n, why, size / 1024,
                     1000 * (time.perf_counter() - t0))
            return True

    def checkpoint(self, cache: DS4Cache, token_ids: list[int], last_logits: torch.Tensor) -> bool:
        """Called after each decode step: saves every `every` tokens of a growing sequence."""
        if self.every <= 0 or len(token_ids) < self._mark + self.every:
            return False
        self._mark = len(token_ids)
        return self.save(cache, token_ids, last_logits, why="periodic")

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
        return sorted(n for n in os.listdir(self.qdir) if not n.endswith(".why"))

    def stats(self) -> dict:
        c = self.counts
        return {"dir": self.dir, "snapshots": len(self.entries), "bytes": self.usage(), "budget": self.budget,
                "hits": c.hits, "misses": c.misses, "saves": c.saves, "evictions": c.evictions,
                "restored_tokens": c.restored_tokens, "rejected": dict(c.rejected)}

    # ---------------------------------------------------------------- internals
    def _name(self, tokens) -> str:
        return f"{self.prefix}{len(tokens):08d}-{tokens_hash(tokens)}{SUFFIX}"

    def _check_cache(self, cache: DS4Cache) -> bool:
        got = Layout.of_cache(cache)
        if got != self.layout:
            log.error("kvstore: the cache's layout (max_context %d, %s) is not the store's (%d, %s): the store "
                      "is unused; build it with the engine's ctx and dtype", cache.max_context, cache.dtype,
                      self.layout.max_context, self.layout.dtype)
            return False
        return True

    def _fill(self, staging: DS4Cache, n: int, tensors: dict) -> None:
        staging.positions[0] = n
        for i, layer in enumerate(staging.layers):
            layer.window[0].copy_(tensors[f"L{i}.window"])
            for part, state in zip(("comp", "idx"), layer.states):
                p = f"L{i}.{part}"
                state.rows[0, :n // layer.rate].copy_(tensors[f"{p}.rows"])
                state.open_kv[0].copy_(tensors[f"{p}.open_kv"])
                state.open_gate[0].copy_(tensors[f"{p}.open_gate"])
                if state.prev_kv is not None:
                    state.prev_kv[0].copy_(tensors[f"{p}.prev_kv"])
                    state.prev_gate[0].copy_(tensors[f"{p}.prev_gate"])

    def _write(self, name: str, head: bytes, payloads: list[memoryview]) -> None:
        delay = float(os.environ.get(WRITE_DELAY_ENV) or 0)
        tmp = os.path.join(self.dir, f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{name}.part")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                for p in payloads:
                    if delay:
                        f.flush()
                        time.sleep(delay)
                    f.write(p)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.dir, name))
        except BaseException:
            _unlink(tmp)
            raise
        _fsync_dir(self.dir)

    def _make_room(self, size: int) -> None:
        """Delete until `size` more bytes fit: quarantine (oldest first), other models' and
        layouts' snapshots (oldest first), then our snapshots by ascending score."""
        if self.usage() + size <= self.budget:
            return
        now = time.time()
        victims = [os.path.join(self.qdir, n) for n in self._quarantine_files()]
        foreign = [n for n in os.listdir(self.dir) if n.endswith(SUFFIX) and not n.startswith(self.prefix)]
        victims += sorted((os.path.join(self.dir, n) for n in foreign), key=_mtime)
        victims += [os.path.join(self.dir, e.name) for e in sorted(self.entries.values(), key=lambda e: e.score(now))]
        for path in victims:
            if self.usage() + size <= self.budget:
                break
            name = os.path.basename(path)
            _unlink(path)
            if os.path.dirname(path) == self.qdir:
                _unlink(path + ".why")
            elif self.entries.pop(name, None) is not None:
                self._count("evictions")
                log.info("kvstore: evicted %s", name)

    def _quarantine_files(self) -> list[str]:
        """Quarantined snapshots (not their notes), oldest first."""
        names = [n for n in os.listdir(self.qdir) if not n.endswith(".why")]
        return sorted(names, key=lambda n: _mtime(os.path.join(self.qdir, n)))

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
            with open(os.path.join(self.qdir, qname + ".why"), "w") as f:
                json.dump({"file": name, "reason": err.reason, "detail": err.detail, "time": time.time()}, f)
            _fsync_dir(self.dir)
        except OSError as e:
            log.warning("kvstore: cannot quarantine %s (%s); deleting it", name, e)
            _unlink(src)
        self.last_rejection = (name, err.reason, err.detail)
        self.counts.rejected[err.reason] = self.counts.rejected.get(err.reason, 0) + 1
        if self.prom is not None:
            self.prom.rejected.labels(reason=err.reason).inc()
        self._trim_quarantine()
        self._update_gauges()

    def _write_stats(self) -> None:
        blob = json.dumps({e.name: {"hits": e.hits} for e in self.entries.values() if e.hits}).encode()
        self._make_room(2 * len(blob))  # the temporary copy and the file itself
        tmp = os.path.join(self.dir, f"{TMP_PREFIX}{STATS}")
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.dir, STATS))

    def _count(self, what: str, k: int = 1) -> None:
        setattr(self.counts, what, getattr(self.counts, what) + k)
        if self.prom is not None:
            getattr(self.prom, what).inc(k)

    def _update_gauges(self) -> None:
        if self.prom is not None:
            self.prom.bytes.set(self.usage())
            self.prom.snapshots.set(len(self.entries))


def _owned(name: str, in_quarantine: bool) -> bool:
    return in_quarantine or name.endswith(SUFFIX) or name.startswith(TMP_PREFIX) or name in (STATS, LOCK)


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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
