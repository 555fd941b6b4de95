"""The disk KV snapshot file format: encode, read and validate one sequence's state.

A snapshot holds what a decode step needs to continue a sequence of N tokens: the cache's
`export_sequence` state (window rings, the N // m compressed and indexer rows written so far,
the compressor frontier, the position; its size follows N, not `--ctx`), the token ids and the
logits of the next token. The store (`serve.kvstore.store`) decides when to write, keep and delete.

File format (`<model>-<layout>-[<tenant>-]<N>-<tokens hash>.ds4kv`, version 4, little endian)::

    magic  b"DS4KVSNP"  | version u32 | header length u32 | xxh3_64 of the header u64
    header: UTF-8 JSON  {model, layout, kv_rows, n_tokens, tokens_hash, created, checksum: "xxh3_64",
                         [tenant,] checkpoints: [c, ...], sections: [{name, dtype, shape, nbytes, xxh3}, ...]}
    sections, back to back, in the header's order: `tokens` int32 [N], `logits` [vocab], then
    the cache state under the cache's own names, in `ds4_torch.cache.sequence_spec` order, then
    for each checkpoint position c (strictly increasing, 1 <= c < N) the checkpoint of the
    sequence's first c tokens (`DS4Cache.take_checkpoint`, without logits) as
    `checkpoints.{c}.{name}`, in `ds4_torch.cache.checkpoint_spec` order

Version 4 adds `kv_rows`, the KV row format of the compressed rows (`ds4_torch.kv_format`: "full",
"fp8", "fp8-keep-rope"; fp8 rows are the sections `rows` float8_e4m3fn, `row_scales` uint8 and
`row_rope`, as `sequence_spec` lists them); version 3 added the checkpoints (a file may hold
none); files of versions 1-3 are rejected as `version`.

- `tenant` (absent: no tenant, as in files written before it) is the tag of the API key whose
  conversation it holds (`tenant_tag`, a hash, never the key): a snapshot is only restored for
  the same tenant, and its name carries the tag so two tenants' equal conversations are two files.
- `model` fingerprints the model (`model_fingerprint`); `layout` fingerprints the cache layout
  (window, layer kinds and rates, dims, vocabulary, dtype, KV row format, capacities,
  max_context). A snapshot whose `kv_rows` is not the cache's is rejected as `layout`.
- `write_atomically` writes to a temporary file (`.tmp-*`) that is fsynced, renamed into place,
  and the directory fsynced: a crash leaves either the old file or the whole new one.

Validation on read (`read_snapshot`; every failure is a `SnapshotError` whose `reason` is one of
REASONS): size (`truncated`/`size`), magic, version, header checksum and structure (`header`:
the section table must be exactly the layout's for N tokens), layout, model, every section's
checksum (`checksum`), the token hash (`token_hash`), and the state itself (`state`,
`check_state`): the position equals the token count, every value is finite except the CSA
overlap gates, which are -inf exactly while no window has closed (N < m) and finite after; ring
slots and open-window slots past the count are zero; every checkpoint passes
`ds4_torch.cache.check_checkpoint` at its own position.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
import time
import uuid
import weakref
from dataclasses import dataclass, field

import torch
import xxhash

from ds4_torch.cache import DS4Cache, check_checkpoint, checkpoint_spec, sequence_spec
from ds4_torch.config import CSA
from ds4_torch.kv_format import ROW_PARTS, row_format, rows_from_parts

MAGIC = b"DS4KVSNP"
VERSION = 4
FIXED = struct.Struct("<8sIIQ")      # magic, version, header length, xxh3_64(header)
MAX_HEADER = 16 * 2**20
SUFFIX = ".ds4kv"
TMP_PREFIX = ".tmp-"
REPLAY_FILE = "replay.sqlite3"  # the exact-replay records (serve.http.replay) share the directory

# Why a snapshot was rejected: the metric label. `restore_failed` and `io` come from the store.
CHECKPOINTS = "checkpoints."  # the prefix of checkpoint sections

REASONS = ("truncated", "size", "magic", "version", "header", "layout", "model", "checksum", "token_hash",
           "state", "restore_failed", "io")

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
    torch.float8_e4m3fn, torch.uint8)}  # (the last two: fp8 rows and their scales)


class SnapshotError(Exception):
    """A snapshot that must not be used: `reason` is the metric label, `detail` says what."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _xxh(buf) -> str:
    return xxhash.xxh3_64_hexdigest(buf)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t` (moved to the host, made contiguous)."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def tokens_hash(tokens) -> str:
    return _xxh(struct.pack(f"<{len(tokens)}i", *tokens))


# ------------------------------------------------------------------------------ fingerprints
_WEIGHT_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def model_fingerprint(model) -> str:
    """sha256 naming the model that wrote a snapshot: its config, its dtype, every weight's name,
    shape and dtype, and either the checkpoint's own fingerprint (`model.checkpoint_fingerprint`,
    set by `from_pretrained` from checkpoint metadata: cheap) or, for a model without one (built
    in memory), an xxh3_64 of every weight's bytes. The weight hash is computed once per model
    object (a copy is fingerprinted anew; weights changed in place later are not noticed)."""
    h = hashlib.sha256()
    cfg = dataclasses.asdict(model.config) if dataclasses.is_dataclass(model.config) else vars(model.config)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    # The same checkpoint in another dtype (or quantization) computes, and caches, other values.
    h.update(f"\ndtype {getattr(model, 'dtype', None)}".encode())
    state = sorted(model.state_dict().items())
    for name, t in state:
        h.update(f"\n{name}|{tuple(t.shape)}|{t.dtype}".encode())
    checkpoint = getattr(model, "checkpoint_fingerprint", None)
    if isinstance(checkpoint, str) and checkpoint:
        h.update(f"\ncheckpoint {checkpoint}".encode())
    else:
        h.update(f"\nweights {_weights_digest(model, state)}".encode())
    return h.hexdigest()


def _weights_digest(model, state) -> str:
    cached = _WEIGHT_FINGERPRINTS.get(model)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    for name, t in state:
        digest = xxhash.xxh3_64()
        flat = t.detach().reshape(-1)
        step = max(1, (64 * 2**20) // max(1, t.element_size()))  # device tensors go to the host in pieces
        for a in range(0, flat.numel(), step):
            digest.update(tensor_bytes(flat[a:a + step]))
        h.update(f"{name}|{digest.hexdigest()}\n".encode())
    _WEIGHT_FINGERPRINTS[model] = fp = h.hexdigest()
    return fp


@dataclass(frozen=True)
class Layout:
    """What a snapshot's shape depends on; `fingerprint` names it. `config` only supplies the
    cache's state spec: two layouts with equal fields have the same spec."""
    window: int
    head_dim: int
    index_head_dim: int
    vocab_size: int
    layers: tuple[tuple[str, int], ...]     # (kind, rate) per layer
    dtype: str
    max_context: int
    capacities: tuple[int, ...]
    kv_rows: str = "full"                   # the KV row format (`ds4_torch.kv_format`)
    config: object = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, config, max_context: int, dtype: torch.dtype, kv_rows: str = "full") -> "Layout":
        layers = tuple((config.layer_types[i], config.compress_rate(i)) for i in range(config.num_hidden_layers))
        return cls(config.sliding_window, config.head_dim, config.index_head_dim, config.vocab_size, layers,
                   dtype_name(dtype), max_context,
                   tuple(math.ceil(max_context / r) if r else 0 for _, r in layers), row_format(kv_rows).name, config)

    @classmethod
    def of_cache(cls, cache: DS4Cache) -> "Layout":
        return cls.of(cache.config, cache.max_context, cache.dtype, cache.kv_rows.name)

    @property
    def fingerprint(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    def sections(self, n: int, logits_dtype: str, checkpoints=()) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every section of a snapshot of `n` tokens with checkpoints at
        the positions `checkpoints`, in file order."""
        state = sequence_spec(self.config, n, DTYPES[self.dtype], self.kv_rows)
        checkpoint = checkpoint_spec(self.config, DTYPES[self.dtype])
        return [("tokens", "int32", (n,)), ("logits", logits_dtype, (self.vocab_size,))] + [
            (name, dtype_name(dtype), shape) for name, dtype, shape in state] + [
            (f"{CHECKPOINTS}{c}.{name}", dtype_name(dtype), shape) for c in checkpoints
            for name, dtype, shape in checkpoint]


def name_prefix(model_fp: str, layout: Layout) -> str:
    """What every snapshot file of this model and layout is named with first."""
    return f"{model_fp[:12]}-{layout.fingerprint[:8]}-"


def tenant_tag(tenant) -> str | None:
    """What names `tenant` (a request's tenant: an id derived from its API key, or None) on disk:
    a hash of it, so neither the key nor the server's tenant id is written."""
    if tenant is None:
        return None
    return hashlib.sha256(f"ds4kv-tenant\0{tenant}".encode()).hexdigest()[:16]


def file_name(model_fp: str, layout: Layout, tokens, tag: str | None = None) -> str:
    """The file of a snapshot of `tokens` for the tenant tagged `tag` (`tenant_tag`; None: no tenant)."""
    tenant = "" if tag is None else f"{tag}-"
    return f"{name_prefix(model_fp, layout)}{tenant}{len(tokens):08d}-{tokens_hash(tokens)}{SUFFIX}"


# ------------------------------------------------------------------------------ validation
def check_state(layout: Layout, n: int, tensors: dict[str, torch.Tensor]) -> None:
    """Raise SnapshotError("state") unless `tensors` (the file's sections) is a state a cache can
    really be in after n tokens. Precisely: position == n; token ids in the vocabulary; logits
    finite; every cache value finite, except the CSA overlap gates (`prev_gate`), which are all
    -inf while no window has closed (n < m, with `prev_kv` all zero) and all finite after; ring
    slots >= n (n < window) and open-window slots >= n % m zero."""
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
    if int(tensors["position"]) != n:
        bad(f"position {int(tensors['position'])} != {n} tokens")
    for i, (kind, rate) in enumerate(layout.layers):
        w = tensors[f"layers.{i}.window"]
        if not bool(torch.isfinite(w).all()):
            bad(f"layer {i} window not finite")
        if n < layout.window and bool(w[n:].any()):
            bad(f"layer {i} window slots >= {n} written")
        if not rate:
            continue
        for part in ("compressor", "indexer") if kind == CSA else ("compressor",):
            p = f"layers.{i}.{part}"
            # the rows as a step reads them: an fp8 NaN code or a scale byte 255 (2^128) is not finite
            parts = {name: tensors[f"{p}.{name}"] for name in ROW_PARTS if f"{p}.{name}" in tensors}
            if not bool(torch.isfinite(rows_from_parts(parts, DTYPES[layout.dtype])).all()):
                bad(f"{p}.rows not finite")
            for name in ("open_kv", "open_gate"):
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
    for c, checkpoint in split_checkpoints(tensors).items():
        try:
            position = check_checkpoint(layout.config, DTYPES[layout.dtype], layout.max_context, checkpoint)
        except ValueError as e:
            bad(f"checkpoint at {c}: {e}")
        if position != c:
            bad(f"checkpoint at {c} holds position {position}")


def split_checkpoints(tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """The `checkpoints.{c}.{name}` sections of `tensors` as {c: {name: tensor}}."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith(CHECKPOINTS):
            c, name = key[len(CHECKPOINTS):].split(".", 1)
            out.setdefault(int(c), {})[name] = t
    return out


def check_checkpoint_positions(positions, n: int) -> str | None:
    """Why checkpoint `positions` cannot go with a snapshot of `n` tokens (None: they can)."""
    if not (isinstance(positions, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in positions)):
        return "checkpoints must be a list of integers"
    if any(not 1 <= c < n for c in positions) or positions != sorted(set(positions)):
        return f"checkpoint positions {positions[:5]} must increase strictly within [1, {n})"
    return None


# ------------------------------------------------------------------------------ encode
def encode_snapshot(model_fp: str, layout: Layout, tokens: list[int], logits: torch.Tensor,
                    state: dict[str, torch.Tensor], checkpoints: dict | None = None, tag: str | None = None
                    ) -> tuple[bytes, list[memoryview]]:
    """(fixed part + header, section payloads) of a snapshot of `state` (a cache's
    `export_sequence`) holding `tokens`, `logits` the next token's, and `checkpoints` ({position:
    `take_checkpoint` of the sequence there}; their logits are not written), for the tenant
    tagged `tag` (None: no tenant). Raises
    SnapshotError("state") for a state that would be rejected on read: nothing unusable is ever
    persisted."""
    n = len(tokens)
    checkpoints = dict(sorted((checkpoints or {}).items()))
    why = check_checkpoint_positions(list(checkpoints), n)
    if why is not None:
        raise SnapshotError("state", why)
    tensors = {"tokens": torch.tensor(tokens, dtype=torch.int32),
               "logits": logits.detach().to("cpu").reshape(-1).contiguous(), **state}
    for c, checkpoint in checkpoints.items():
        tensors.update({f"{CHECKPOINTS}{c}.{name}": t.detach().to("cpu") for name, t in checkpoint.items()
                        if name != "logits"})
    want = layout.sections(n, dtype_name(tensors["logits"].dtype), list(checkpoints))
    if set(tensors) != {name for name, _, _ in want}:
        raise SnapshotError("state", f"the state's sections {sorted(set(tensors) ^ {w[0] for w in want})[:5]} "
                                     f"do not match the layout")
    for name, dtype, shape in want:
        t = tensors[name]
        if tuple(t.shape) != shape or dtype_name(t.dtype) != dtype:
            raise SnapshotError("state", f"section {name}: {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
    check_state(layout, n, tensors)
    table, payloads = [], []
    for name, dtype, shape in want:
        buf = tensor_bytes(tensors[name])
        payloads.append(buf)
        table.append({"name": name, "dtype": dtype, "shape": list(shape), "nbytes": buf.nbytes, "xxh3": _xxh(buf)})
    fields = {"model": model_fp, "layout": layout.fingerprint, "kv_rows": layout.kv_rows, "n_tokens": n,
              "tokens_hash": tokens_hash(tokens),
              "created": time.time(), "checksum": "xxh3_64", **({} if tag is None else {"tenant": tag}),
              "checkpoints": list(checkpoints), "sections": table}
    header = json.dumps(fields, separators=(",", ":")).encode()
    return FIXED.pack(MAGIC, VERSION, len(header), xxhash.xxh3_64_intdigest(header)) + header, payloads


# ------------------------------------------------------------------------------ read
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
        assert isinstance(header["tokens_hash"], str) and isinstance(header["checkpoints"], list)
        assert isinstance(header["kv_rows"], str)
        assert isinstance(header.get("tenant"), (str, type(None)))
        assert all(isinstance(s["name"], str) and isinstance(s["nbytes"], int) and isinstance(s["dtype"], str)
                   and isinstance(s["xxh3"], str) and isinstance(s["shape"], list)
                   and all(isinstance(d, int) for d in s["shape"]) for s in sections)
    except Exception as e:  # noqa: BLE001 - any malformed header
        raise SnapshotError("header", f"malformed header: {type(e).__name__}: {e}") from None
    return header, FIXED.size + hlen


def check_header(header: dict, file_size: int, payload_at: int, model_fp: str, layout: Layout) -> None:
    """The header belongs to this model and layout, its section table is exactly the layout's
    for its token count, and the file is exactly as long as the table says."""
    if header.get("kv_rows") != layout.kv_rows:  # (the layout fingerprint covers it: this says why)
        raise SnapshotError("layout", f"its compressed rows are stored as {header.get('kv_rows')!r}, this "
                                      f"cache's as {layout.kv_rows!r}")
    if header.get("layout") != layout.fingerprint:
        raise SnapshotError("layout", "written for another cache layout (window, rates, dims, dtype, KV rows or "
                                      "context)")
    if header.get("model") != model_fp:
        raise SnapshotError("model", "written by another model (config or weights differ)")
    n = header["n_tokens"]
    if not 1 <= n <= layout.max_context:
        raise SnapshotError("header", f"token count {n} outside [1, {layout.max_context}]")
    why = check_checkpoint_positions(header["checkpoints"], n)
    if why is not None:
        raise SnapshotError("header", why)
    got = [(s["name"], s["dtype"], tuple(s["shape"])) for s in header["sections"]]
    logits_dtype = got[1][1] if len(got) > 1 else ""
    want = layout.sections(n, logits_dtype, header["checkpoints"])
    if got != want or logits_dtype not in DTYPES:
        raise SnapshotError("header", "section table does not match the layout")
    for s, (_, dtype, shape) in zip(header["sections"], want):
        if s["nbytes"] != math.prod(shape) * DTYPES[dtype].itemsize:
            raise SnapshotError("header", f"section {s['name']}: {s['nbytes']} bytes for {shape} {dtype}")
    expected = payload_at + sum(s["nbytes"] for s in header["sections"])
    if file_size < expected:
        raise SnapshotError("truncated", f"{file_size} bytes, the header describes {expected}")
    if file_size > expected:
        raise SnapshotError("size", f"{file_size} bytes, the header describes {expected}")


def read_section(f, s: dict) -> torch.Tensor:
    """The next section of an open snapshot, its checksum verified."""
    buf = bytearray(s["nbytes"])
    if f.readinto(buf) != len(buf):
        raise SnapshotError("truncated", f"section {s['name']} cut short")
    if _xxh(buf) != s["xxh3"]:
        raise SnapshotError("checksum", f"section {s['name']}: checksum mismatch")
    t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return t.view(DTYPES[s["dtype"]]).reshape(s["shape"])


@dataclass
class Snapshot:
    header: dict
    tokens: list[int]
    logits: torch.Tensor | None                       # None when read with tokens_only
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # for `DS4Cache.import_sequence`
    checkpoints: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # position -> checkpoint


def read_snapshot(path: str, model_fp: str, layout: Layout, tokens_only: bool = False) -> Snapshot:
    """A fully checked snapshot (CPU tensors); SnapshotError otherwise. `tokens_only` stops after
    the token ids (for the index at start)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header, at = read_header(f, size)
            check_header(header, size, at, model_fp, layout)
            tensors = {}
            for s in header["sections"]:
                tensors[s["name"]] = read_section(f, s)
                if s["name"] == "tokens":
                    if tokens_hash(tensors["tokens"].tolist()) != header["tokens_hash"]:
                        raise SnapshotError("token_hash", "the token ids do not match the header's hash")
                    if tokens_only:
                        return Snapshot(header, tensors["tokens"].tolist(), None)
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
    tokens, logits = tensors.pop("tokens").tolist(), tensors.pop("logits")
    checkpoints = split_checkpoints(tensors)
    state = {k: t for k, t in tensors.items() if not k.startswith(CHECKPOINTS)}
    return Snapshot(header, tokens, logits, state, checkpoints)


# ------------------------------------------------------------------------------ crash-safe writes
def write_atomically(path: str, chunks, pause: float = 0.0) -> int:
    """Write `chunks` (bytes-like) to `path` so that a crash leaves the old file or the whole new
    one: a temporary file beside it (`.tmp-*`, removed on failure), fsynced, renamed over
    `path`, then the directory fsynced. `pause`: seconds slept between chunks (a test hook, to
    kill a process mid-write). Returns the bytes written."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{name}.part")
    size = 0
    try:
        with open(tmp, "wb") as f:
            for i, chunk in enumerate(chunks):
                if pause and i:
                    f.flush()
                    time.sleep(pause)
                size += f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)
    return size


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
