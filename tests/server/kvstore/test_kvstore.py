"""The disk KV cache (serve/kvstore/store.py, serve/kvstore/snapshot.py) against the default model and real caches: restore
parity, every kind of damaged snapshot (rejected with its reason, quarantined, never tried
again), post-restore failures, the space budget and eviction order."""
from __future__ import annotations

import copy
import errno
import json
import os

import pytest
import torch
import xxhash

from ds4_torch.decode import make_decoder, prefill
from ds4_torch.default_model import build_default_model
from ds4_torch.model import DS4ForCausalLM
from serve.kvstore import snapshot
from serve.kvstore.store import WRITE_DELAY_ENV, KVStore
from serve.kvstore.snapshot import FIXED

CTX = 256


@pytest.fixture(scope="module")
def model():
    return build_default_model()


def ids_for(seed: int, n: int) -> list[int]:
    return torch.randint(2, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def run(model, tokens, cache=None, chunk=16, decode_tail=0):
    """Feed `tokens` (the last `decode_tail` one at a time, like the engine's decode loop) into a
    fresh cache: (cache, logits of the next token)."""
    cache = cache if cache is not None else model.new_cache(1, CTX)
    head = tokens[:len(tokens) - decode_tail]
    logits = prefill(model, cache, torch.tensor([head]), chunk=chunk)[0]
    decoder = make_decoder(model, cache, "eager")
    for t in tokens[len(head):]:
        logits = decoder.step(torch.tensor([t]))[0]
    return cache, logits


@torch.no_grad()
def greedy(model, cache, logits, steps):
    decoder = make_decoder(model, cache, "eager")
    out, all_logits = [], [logits]
    for _ in range(steps):
        t = int(logits.argmax())
        out.append(t)
        logits = decoder.step(torch.tensor([t]))[0]
        all_logits.append(logits)
    return out, torch.stack(all_logits)


@pytest.fixture
def store(tmp_path, model):
    s = KVStore(tmp_path / "kv", 64, model, ctx=CTX, min_tokens=1)
    yield s
    s.close()


def saved(store, model, tokens, **kw):
    cache, logits = run(model, tokens, **kw)
    assert store.save(cache, tokens, logits)
    return os.path.join(store.dir, store._name(tokens)), cache, logits


# --------------------------------------------------------------------------- parity
# 3 < every rate (CSA overlap gates still -inf), 37 (ring wrapped, rows of both rates),
# 137 tokens with the last 9 decoded one by one (stale open-window slots the snapshot zeroes).
@pytest.mark.parametrize("n,decode_tail", [(3, 0), (37, 0), (137, 9)])
def test_restore_parity(store, model, n, decode_tail):
    tokens = ids_for(n, n)
    path, live, logits = saved(store, model, tokens, decode_tail=decode_tail)
    reference = greedy(model, live, logits, 24)

    cache = model.new_cache(1, CTX)
    got = store.restore(cache, tokens + [7, 8])
    assert got is not None and got[0] == n
    assert torch.equal(got[1], logits)
    assert int(cache.positions[0]) == n
    tokens_out, all_logits = greedy(model, cache, got[1], 24)
    assert tokens_out == reference[0]
    assert torch.equal(all_logits, reference[1])
    assert store.counts.hits == 1 and store.counts.restored_tokens == n


def test_restore_then_suffix_prefill_matches(store, model):
    tokens = ids_for(1, 90)
    saved(store, model, tokens[:60])
    live, _ = run(model, tokens[:60])
    ref_logits = prefill(model, live, torch.tensor([tokens[60:]]), chunk=16)[0]

    cache = model.new_cache(1, CTX)
    n, _ = store.restore(cache, tokens)
    assert n == 60
    with torch.no_grad():
        logits = prefill(model, cache, torch.tensor([tokens[60:]]), chunk=16)[0]
    assert torch.equal(logits, ref_logits)


def test_longest_prefix_wins_and_miss(store, model):
    tokens = ids_for(2, 80)
    for n in (20, 50, 70):
        saved(store, model, tokens[:n])
    assert store.restore(model.new_cache(1, CTX), tokens[:60] + [3])[0] == 50
    assert store.restore(model.new_cache(1, CTX), tokens)[0] == 70
    assert store.restore(model.new_cache(1, CTX), [5] + tokens) is None
    assert store.counts.misses == 1 and store.counts.hits == 2


def test_save_skips_duplicates_short_and_invalid(tmp_path, model):
    with KVStore(tmp_path, 64, model, ctx=CTX, min_tokens=16) as s:
        cache, logits = run(model, ids_for(3, 10))
        assert not s.save(cache, ids_for(3, 10), logits)               # shorter than min_tokens
        tokens = ids_for(3, 30)
        cache, logits = run(model, tokens)
        assert s.save(cache, tokens, logits)
        assert not s.save(cache, tokens, logits)                         # already stored
        cache.invalidate([0])
        assert not s.save(cache, tokens + [1], logits)                   # cache is not at 31 / invalid
        bad = logits.clone()
        bad[3] = float("nan")
        cache.reset()
        cache, _ = run(model, tokens[:20], cache)
        assert not s.save(cache, tokens[:20], bad)                       # non-finite logits
        assert s.counts.saves == 1


# --------------------------------------------------------------------------- damaged snapshots
def parse(path):
    data = bytearray(open(path, "rb").read())
    magic, version, hlen, hsum = FIXED.unpack_from(data)
    header = json.loads(bytes(data[FIXED.size:FIXED.size + hlen]))
    offsets, at = {}, FIXED.size + hlen
    for s in header["sections"]:
        offsets[s["name"]] = (at, s["nbytes"])
        at += s["nbytes"]
    return data, header, offsets


def write_header(path, data, header, payload):
    body = json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(FIXED.pack(snapshot.MAGIC, snapshot.VERSION, len(body), xxhash.xxh3_64_intdigest(body)) + body)
        f.write(payload)


def rewrite_section(path, name, fn):
    """Change one section's values and fix every checksum: a structurally valid file."""
    data, header, offsets = parse(path)
    at, nbytes = offsets[name]
    s = next(s for s in header["sections"] if s["name"] == name)
    t = torch.frombuffer(bytearray(data[at:at + nbytes]), dtype=torch.uint8).view(snapshot.DTYPES[s["dtype"]])
    t = t.reshape(s["shape"]).clone()
    fn(t)
    raw = snapshot.tensor_bytes(t).tobytes()
    data[at:at + nbytes] = raw
    s["xxh3"] = xxhash.xxh3_64_hexdigest(raw)
    if name == "tokens":
        header["tokens_hash"] = snapshot.tokens_hash(t.tolist())
    first = min(a for a, _ in offsets.values())
    write_header(path, data, header, bytes(data[first:]))


def expect_rejected(store, model, tokens, reason, detail=None):
    name = store._name(tokens)
    before = store.counts.rejected.get(reason, 0)
    assert store.restore(model.new_cache(1, CTX), tokens) is None   # -> the engine prefills cleanly
    assert store.last_rejection[:2] == (name, reason), store.last_rejection
    if detail:
        assert detail in store.last_rejection[2]
    assert store.counts.rejected[reason] == before + 1
    assert not os.path.exists(os.path.join(store.dir, name))
    assert any(q.startswith(name) and q.endswith("." + reason) for q in store.quarantined())
    # Never tried again: the same prompt is now a plain miss.
    assert store.restore(model.new_cache(1, CTX), tokens) is None
    assert store.counts.rejected[reason] == before + 1


def test_every_section_flipped_byte(store, model):
    tokens = ids_for(4, 41)
    path, cache, logits = saved(store, model, tokens)
    _, header, offsets = parse(path)
    names = [s["name"] for s in header["sections"] if s["nbytes"]]
    assert len(names) > 25
    for name in names:
        if not os.path.exists(path):
            assert store.save(cache, tokens, logits)
        data, _, offsets = parse(path)
        at, nbytes = offsets[name]
        data[at + nbytes // 2] ^= 0x20
        open(path, "wb").write(data)
        expect_rejected(store, model, tokens, "checksum", detail=name)
    # the header itself (the JSON body) and its fixed part
    for pos, reason in ((FIXED.size + 40, "header"), (0, "magic"), (8, "version")):
        assert store.save(cache, tokens, logits)
        data = bytearray(open(path, "rb").read())
        data[pos] ^= 0x01
        open(path, "wb").write(data)
        expect_rejected(store, model, tokens, reason)


@pytest.mark.parametrize("damage,reason", [
    ("truncate_half", "truncated"), ("truncate_header", "truncated"), ("truncate_last_byte", "truncated"),
    ("zero_fill", "magic"), ("empty", "truncated"), ("trailing", "size"), ("token_hash", "token_hash"),
    ("tokens_swapped", "token_hash"),
])
def test_damaged_file(store, model, damage, reason):
    tokens = ids_for(5, 45)
    path, _, _ = saved(store, model, tokens)
    data = open(path, "rb").read()
    if damage == "truncate_half":
        data = data[:len(data) // 2]
    elif damage == "truncate_header":
        data = data[:30]
    elif damage == "truncate_last_byte":
        data = data[:-1]
    elif damage == "zero_fill":
        data = bytes(len(data))
    elif damage == "empty":
        data = b""
    elif damage == "trailing":
        data = data + b"\0"
    if damage == "token_hash":
        data, header, offsets = parse(path)
        header["tokens_hash"] = "0123456789abcdef"
        first = min(a for a, _ in offsets.values())
        write_header(path, data, header, bytes(data[first:]))
    elif damage == "tokens_swapped":  # other token ids, section checksum fixed, header hash not
        data, header, offsets = parse(path)
        at, nbytes = offsets["tokens"]
        t = torch.frombuffer(bytearray(data[at:at + nbytes]), dtype=torch.int32).flip(0).clone()
        data[at:at + nbytes] = snapshot.tensor_bytes(t).tobytes()
        header["sections"][0]["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(data[at:at + nbytes]))
        write_header(path, data, header, bytes(data[at:]))
    else:
        open(path, "wb").write(data)
    expect_rejected(store, model, tokens, reason)


@pytest.mark.parametrize("section,fn,detail", [
    ("layers.0.window", lambda t: t.view(-1).__setitem__(5, float("nan")), "window not finite"),
    ("layers.1.compressor.rows", lambda t: t.view(-1).__setitem__(0, float("inf")), "rows not finite"),
    ("layers.1.indexer.rows", lambda t: t.view(-1).__setitem__(0, float("nan")), "indexer.rows not finite"),
    ("position", lambda t: t.add_(1), "position 42 != 41"),
    ("position", lambda t: t.sub_(1), "position 40 != 41"),
    ("layers.1.compressor.prev_gate", lambda t: t.view(-1).__setitem__(0, float("-inf")), "overlap not finite"),
    ("layers.2.compressor.open_kv", lambda t: t[-1].fill_(1.0), "slots past the open window"),
    ("logits", lambda t: t.__setitem__(0, float("nan")), "logits"),
])
def test_structurally_valid_but_unusable_state(store, model, section, fn, detail):
    tokens = ids_for(6, 41)  # 41 % 4 = 1, 41 % 16 = 9: open slots past the count exist
    path, _, _ = saved(store, model, tokens)
    rewrite_section(path, section, fn)
    expect_rejected(store, model, tokens, "state", detail)


@pytest.mark.parametrize("delta", [-1, 1])
def test_compressed_row_count_must_be_tokens_over_rate(store, model, delta):
    """A file whose rows section holds one row fewer or more than N // m, every size and
    checksum fixed, is refused by its section table."""
    tokens = ids_for(6, 41)
    path, _, _ = saved(store, model, tokens)
    data, header, offsets = parse(path)
    s = next(s for s in header["sections"] if s["name"] == "layers.1.compressor.rows")
    at, nbytes = offsets[s["name"]]
    row = nbytes // s["shape"][0]
    assert s["shape"][0] == 41 // model.config.compress_rate(1)
    raw = bytes(data[at:at + nbytes - row]) if delta < 0 else bytes(data[at:at + nbytes]) + bytes(data[at:at + row])
    s["shape"][0] += delta
    s["nbytes"], s["xxh3"] = len(raw), xxhash.xxh3_64_hexdigest(raw)
    first = min(a for a, _ in offsets.values())
    write_header(path, data, header, bytes(data[first:at]) + raw + bytes(data[at + nbytes:]))
    expect_rejected(store, model, tokens, "header", "section table does not match the layout")


def test_state_rules_before_first_window(store, model):
    tokens = ids_for(7, 3)  # no window closed: CSA overlap gates must be exactly -inf, kv zero
    path, _, _ = saved(store, model, tokens)
    _, header, _ = parse(path)
    assert any(s["name"] == "layers.1.compressor.prev_gate" for s in header["sections"])
    rewrite_section(path, "layers.1.compressor.prev_gate", lambda t: t.view(-1).__setitem__(0, 0.0))
    expect_rejected(store, model, tokens, "state", "overlap set before the first window closed")
    path, _, _ = saved(store, model, tokens)
    rewrite_section(path, "layers.0.window", lambda t: t[10].fill_(0.5))  # ring slot 10 of a 3-token sequence
    expect_rejected(store, model, tokens, "state", "window slots >= 3 written")


def other_store(tmp_path, model, name, **kw):
    return KVStore(tmp_path / name, 64, model, ctx=kw.pop("ctx", CTX), min_tokens=1, **kw)


def test_snapshot_of_another_model(store, model, tmp_path):
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).view(-1)[0] += 1e-3  # other weights, same shapes and config
    other.checkpoint_fingerprint = "a retrained checkpoint"  # as from_pretrained of other files would set
    tokens = ids_for(8, 33)
    path, _, _ = saved(store, model, tokens)
    with other_store(tmp_path, other, "b") as b:
        assert b.model_fp != store.model_fp and b.layout == store.layout
        cache, logits = run(other, tokens)
        assert b.save(cache, tokens, logits)
        os.replace(os.path.join(b.dir, b._name(tokens)), path)  # planted under our name
    expect_rejected(store, model, tokens, "model")


@pytest.mark.parametrize("change", ["window", "rates", "ctx"])
def test_snapshot_of_another_layout(store, model, tmp_path, change):
    tokens = ids_for(9, 33)
    path, _, _ = saved(store, model, tokens)
    ctx = CTX
    if change == "ctx":
        other, ctx = model, 2 * CTX
    else:
        cfg = model.config
        cfg = cfg.replace(sliding_window=16) if change == "window" else cfg.replace(
            compress_rates={k: v * 2 for k, v in cfg.compress_rates.items()})
        other = DS4ForCausalLM(cfg)
        state = model.state_dict()
        # position biases are [rate, width]: other rates mean other shapes; keep what fits
        other.load_state_dict({k: v for k, v in state.items() if other.state_dict()[k].shape == v.shape},
                              strict=False)
        other._init_buffers()
        other.eval()
    with other_store(tmp_path, other, "c", ctx=ctx) as c:
        assert c.layout != store.layout
        cache = other.new_cache(1, ctx)
        _, logits = run(other, tokens, cache=cache)
        assert c.save(cache, tokens, logits)
        os.replace(os.path.join(c.dir, c._name(tokens)), path)
    expect_rejected(store, model, tokens, "layout")


def test_damaged_file_found_at_start_is_quarantined(tmp_path, model):
    tokens = ids_for(10, 40)
    with other_store(tmp_path, model, "kv") as s:
        path, _, _ = saved(s, model, tokens)
        saved(s, model, tokens[:20])
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0xFF  # not in the header or the tokens: found only when restored
    open(path, "wb").write(data)
    tokens_path = os.path.join(os.path.dirname(path), s._name(tokens[:20]))
    open(tokens_path, "r+b").truncate(100)  # header damage: found at start
    with other_store(tmp_path, model, "kv") as s2:
        assert s2.counts.rejected == {"truncated": 1}
        assert len(s2.entries) == 1
        assert s2.restore(model.new_cache(1, CTX), tokens) is None
        assert s2.counts.rejected == {"truncated": 1, "checksum": 1}
        assert len(s2.quarantined()) == 2 and not s2.entries


def test_files_of_the_previous_format_version_are_quarantined_at_start(tmp_path, model):
    tokens = ids_for(17, 40)
    with other_store(tmp_path, model, "kv") as s:
        path, _, _ = saved(s, model, tokens)
    data, header, offsets = parse(path)
    body = json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:  # version 1 wrote other section names under the same file name
        f.write(FIXED.pack(snapshot.MAGIC, snapshot.VERSION - 1, len(body), xxhash.xxh3_64_intdigest(body)) + body)
        f.write(bytes(data[min(a for a, _ in offsets.values()):]))
    with other_store(tmp_path, model, "kv") as s2:
        assert s2.counts.rejected == {"version": 1} and not s2.entries
        assert s2.last_rejection[:2] == (s2._name(tokens), "version")
        assert s2.quarantined()[0].endswith(".version")
        assert s2.restore(model.new_cache(1, CTX), tokens) is None


def test_snapshots_belong_to_their_tenant(tmp_path, model):
    """Each tenant's lookups see only its own snapshots (and untagged files are no tenant's),
    across a restart; the file names a hash of the tenant, and a file renamed to another
    tenant's name is rejected at start."""
    tokens = ids_for(12, 40)
    cache, logits = run(model, tokens)
    with other_store(tmp_path, model, "kv") as s:
        assert s.save(cache, tokens, logits, tenant="tenant-a")
        short, short_logits = run(model, tokens[:30])
        assert s.save(short, tokens[:30], short_logits)  # no tenant
        assert s.stored_prefix(tokens, tenant="tenant-a") == 40 and s.stored_prefix(tokens) == 30
        assert s.stored_prefix(tokens, tenant="tenant-b") == 0
        assert s.load(tokens, tenant="tenant-b") is None
        assert s.restore(model.new_cache(1, CTX), tokens, tenant="tenant-b") is None
    names = sorted(os.listdir(tmp_path / "kv"))
    assert not any("tenant-a" in n for n in names)
    tagged = s._name(tokens, snapshot.tenant_tag("tenant-a"))
    assert tagged in names and s._name(tokens) not in names
    with other_store(tmp_path, model, "kv") as s2:
        assert s2.restore(model.new_cache(1, CTX), tokens, tenant="tenant-b") is None
        assert s2.restore(model.new_cache(1, CTX), tokens)[0] == 30
        assert s2.restore(model.new_cache(1, CTX), tokens, tenant="tenant-a")[0] == 40
    d = tmp_path / "kv"
    os.replace(d / tagged, d / s._name(tokens, snapshot.tenant_tag("tenant-b")))  # moved to b's name
    with other_store(tmp_path, model, "kv") as s3:
        assert s3.counts.rejected == {"header": 1}
        assert s3.stored_prefix(tokens, tenant="tenant-b") == 0 and s3.stored_prefix(tokens, tenant="tenant-a") == 0


def test_a_read_is_shared_and_counted_until_released(tmp_path, model):
    """`load` holds one host copy, counted in `loaded_bytes` (the tensors' bytes) until the last
    reference goes; `share` gives another prompt of the same tenant the same tensors with its
    own count, and nothing to another tenant or to a prompt it cannot serve."""
    tokens = ids_for(13, 40)
    cache, logits = run(model, tokens)
    with other_store(tmp_path, model, "kv") as s:
        assert s.save(cache, tokens, logits, tenant="a")
        assert s.first_choice(tokens + [9], tenant="a") == s._name(tokens, snapshot.tenant_tag("a"))
        assert s.first_choice(tokens + [9], tenant="b") is None and s.loaded_bytes == 0
        loaded = s.load(tokens + [9], tenant="a")
        snap = loaded.snapshot
        size = snap.logits.nbytes + sum(t.nbytes for t in snap.state.values())
        assert s.loaded_bytes == size and s.counts.reads == 1
        other = s.share(loaded, tokens + [3, 4], tenant="a")
        assert other.snapshot is snap and other.count == 40
        assert s.share(loaded, tokens + [3], tenant="b") is None
        assert s.share(loaded, tokens[:20] + [1], tenant="a") is None   # diverges, no checkpoint there
        assert s.apply(model.new_cache(1, CTX), other)[0] == 40
        del loaded, other, snap
        assert s.loaded_bytes == 0 and s.counts.reads == 1


# --------------------------------------------------------------------------- KV row formats
@torch.no_grad()
def test_fp8_rows_round_trip_through_disk_and_another_row_format_refuses_them(tmp_path, model):
    """A store of fp8 rows (RoPE kept) writes the stored parts and the format in the header; a
    restore goes on exactly as the live cache; the same file is refused (reason `layout`, naming
    both formats) by a store of full rows, also when it carries that store's file name; and a
    bad scale byte (255: 2^128) is a state that is not finite."""
    fmt, tokens = "fp8-keep-rope", ids_for(40, 137)
    with KVStore(tmp_path / "kv", 64, model, ctx=CTX, min_tokens=1, kv_rows=fmt) as s:
        live, logits = run(model, tokens, cache=model.new_cache(1, CTX, kv_rows=fmt), decode_tail=9)
        assert s.save(live, tokens, logits)
        path = os.path.join(s.dir, s._name(tokens))
        _, header, _ = parse(path)
        assert header["kv_rows"] == fmt
        dtypes = {x["name"]: x["dtype"] for x in header["sections"]}
        assert dtypes["layers.1.compressor.rows"] == "float8_e4m3fn"
        assert dtypes["layers.1.compressor.row_scales"] == "uint8" and dtypes["layers.1.compressor.row_rope"] == "float32"
        reference = greedy(model, live, logits, 12)
        cache = model.new_cache(1, CTX, kv_rows=fmt)
        got = s.restore(cache, tokens + [7])
        assert got is not None and got[0] == 137
        assert greedy(model, cache, got[1], 12)[0] == reference[0]
        assert s.restore(model.new_cache(1, CTX), tokens) is None  # a cache of full rows: not this store's
        fp, fp8_layout = s.model_fp, s.layout
    full = snapshot.Layout.of(model.config, CTX, model.dtype)
    with pytest.raises(snapshot.SnapshotError, match=f"stored as '{fmt}', this cache's as 'full'") as e:
        snapshot.read_snapshot(path, fp, full)
    assert e.value.reason == "layout"
    with KVStore(tmp_path / "kv", 64, model, ctx=CTX, min_tokens=1) as s2:
        assert not s2.entries and s2.restore(model.new_cache(1, CTX), tokens) is None  # other layouts' files: unread
    os.replace(path, os.path.join(tmp_path / "kv", snapshot.file_name(fp, full, tokens)))  # a full store's name
    with KVStore(tmp_path / "kv", 64, model, ctx=CTX, min_tokens=1) as s3:
        assert s3.counts.rejected == {"layout": 1} and not s3.entries
        assert s3.restore(model.new_cache(1, CTX), tokens) is None

    with KVStore(tmp_path / "kv8", 64, model, ctx=CTX, min_tokens=1, kv_rows=fmt) as s4:
        path = saved(s4, model, tokens[:40], cache=model.new_cache(1, CTX, kv_rows=fmt))[0]
        rewrite_section(path, "layers.1.compressor.row_scales", lambda t: t.view(-1).__setitem__(0, 255))
        with pytest.raises(snapshot.SnapshotError, match="layers.1.compressor.rows not finite"):
            snapshot.read_snapshot(path, fp, fp8_layout)


# --------------------------------------------------------------------------- post-restore failure
def test_restore_failed_quarantines_once_and_across_restarts(tmp_path, model):
    tokens = ids_for(11, 50)
    with other_store(tmp_path, model, "kv") as s:
        saved(s, model, tokens)
        saved(s, model, tokens[:25])
        cache = model.new_cache(1, CTX)
        assert s.restore(cache, tokens)[0] == 50
        s.restore_failed(RuntimeError("injected"))
        s.restore_failed(RuntimeError("again"))  # no restore pending: nothing more happens
        assert s.counts.rejected == {"restore_failed": 1}
        assert s.last_rejection[:2] == (s._name(tokens), "restore_failed")
        assert s.restore(model.new_cache(1, CTX), tokens)[0] == 25  # the shorter one still serves
        s.restore_ok()
        s.restore_failed("late")  # the first step passed: a later failure is not the snapshot's
        assert s.counts.rejected == {"restore_failed": 1}
    with other_store(tmp_path, model, "kv") as s2:
        assert s2.restore(model.new_cache(1, CTX), tokens)[0] == 25
        assert s2.counts.rejected == {} and len(s2.quarantined()) == 1


# --------------------------------------------------------------------------- files and budget
def test_atomic_write_stale_temp_and_lock(tmp_path, model, monkeypatch):
    d = tmp_path / "kv"
    with other_store(tmp_path, model, "kv") as s:
        with pytest.raises(RuntimeError, match="in use by another process"):
            other_store(tmp_path, model, "kv")
        tokens = ids_for(12, 30)
        cache, logits = run(model, tokens)

        def crash(*a):
            raise OSError("disk on fire")
        monkeypatch.setattr(os, "replace", crash)
        assert not s.save(cache, tokens, logits)  # the write failed: nothing left behind
        monkeypatch.undo()
        assert sorted(os.listdir(d)) == [".lock", "quarantine"]
    assert sorted(os.listdir(d)) == [".lock", "quarantine", "stats.json"]
    (d / ".tmp-0123-half-written.ds4kv").write_bytes(b"x" * 1000)
    (d / "not-ours.txt").write_bytes(b"keep me")
    with other_store(tmp_path, model, "kv"):
        assert sorted(os.listdir(d)) == [".lock", "not-ours.txt", "quarantine", "stats.json"]


def test_budget_holds_and_eviction_order(tmp_path, model):
    per = None
    with KVStore(tmp_path / "kv", 0.25, model, ctx=CTX, min_tokens=1) as s:
        keep = ids_for(100, 60)
        saved(s, model, keep)
        per = os.path.getsize(os.path.join(s.dir, s._name(keep)))
        for i in range(24):
            tokens = ids_for(200 + i, 20 + (i * 7) % 60)
            cache, logits = run(model, tokens)
            s.save(cache, tokens, logits)
            assert s.usage() <= s.budget
            if i % 3 == 0:  # the conversation everyone shares keeps being hit
                assert s.restore(model.new_cache(1, CTX), keep + [1])[0] == 60
        assert s.counts.evictions > 5 and s.counts.saves == 25
        assert s._name(keep) in s.entries  # hit often: never evicted
        assert s.usage() <= s.budget
        assert 3 <= len(s.entries) <= s.budget // (per // 2)
        before = dict(s.entries)
    # hit counts survive a restart
    with KVStore(tmp_path / "kv", 0.25, model, ctx=CTX, min_tokens=1) as s2:
        assert s2.entries[s._name(keep)].hits == 8
        assert set(s2.entries) == set(before)


def test_too_large_for_budget_and_quarantine_counts(tmp_path, model):
    with KVStore(tmp_path / "kv", 0.02, model, ctx=CTX, min_tokens=1) as s:  # ~20 KiB
        tokens = ids_for(13, 200)
        cache, logits = run(model, tokens, chunk=64)
        assert not s.save(cache, tokens, logits)
        assert not [n for n in os.listdir(s.dir) if n.endswith(".ds4kv") or n.startswith(".tmp")]
    with KVStore(tmp_path / "kv2", 0.2, model, ctx=CTX, min_tokens=1, quarantine_max=3) as s:
        for i in range(6):  # quarantined files count toward the budget and are capped
            tokens = ids_for(400 + i, 40)
            path, _, _ = saved(s, model, tokens)
            open(path, "r+b").truncate(50)
            assert s.restore(model.new_cache(1, CTX), tokens) is None
            assert s.usage() <= s.budget
        assert len(s.quarantined()) == 3 and s.counts.rejected == {"truncated": 6}


def test_periodic_checkpoint(store, model):
    store.every = 16
    tokens = ids_for(14, 20)
    cache, logits = run(model, tokens)
    store.save(cache, tokens, logits)
    decoder = make_decoder(model, cache, "eager")
    written, saved_at = [], len(tokens)
    with torch.no_grad():
        for step in range(40):
            t = int(logits.argmax())
            logits = decoder.step(torch.tensor([t]))[0]
            tokens.append(t)
            if store.checkpoint_due(len(tokens), saved_at):
                saved_at = len(tokens)
                assert store.save(cache, tokens, logits, why="periodic")
                written.append(len(tokens))
    assert written == [36, 52]
    assert all(store.restore(model.new_cache(1, CTX), tokens[:n])[0] == n for n in written)


def test_prometheus_metrics(tmp_path, model):
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    with KVStore(tmp_path / "kv", 8, model, ctx=CTX, min_tokens=1, registry=reg) as s:
        tokens = ids_for(15, 40)
        path, _, _ = saved(s, model, tokens)
        s.restore(model.new_cache(1, CTX), tokens)
        s.restore(model.new_cache(1, CTX), [9] + tokens)
        open(path, "r+b").truncate(80)
        s.restore(model.new_cache(1, CTX), tokens)
        v = lambda name, **labels: reg.get_sample_value(name, labels or None)  # noqa: E731
        assert v("ds4_kv_disk_saves_total") == 1 and v("ds4_kv_disk_hits_total") == 1
        assert v("ds4_kv_disk_misses_total") == 2
        assert v("ds4_kv_disk_rejected_total", reason="truncated") == 1
        assert v("ds4_kv_disk_rejected_total", reason="checksum") == 0
        assert v("ds4_kv_disk_bytes") == s.usage() > 0
        assert b"ds4_kv_disk_rejected_total" in generate_latest(reg)


def test_restore_parity_bf16(tmp_path):
    model = build_default_model(dtype=torch.bfloat16)
    tokens = ids_for(16, 45)
    with KVStore(tmp_path / "kv", 8, model, ctx=CTX, min_tokens=1) as s:
        assert s.layout.dtype == "bfloat16"
        path, live, logits = saved(s, model, tokens, decode_tail=3)
        reference = greedy(model, live, logits, 12)
        cache = model.new_cache(1, CTX)
        n, got = s.restore(cache, tokens)
        assert n == 45 and got.dtype == logits.dtype and torch.equal(got, logits)
        out = greedy(model, cache, got, 12)
        assert out[0] == reference[0] and torch.equal(out[1], reference[1])


# --------------------------------------------------------------------------- crash safety
def fill_to_budget(s, model):
    """Snapshots of 30 tokens until one more would not fit: {name: (tokens, logits)}."""
    kept = {}
    for i in range(40):
        tokens = ids_for(500 + i, 30)
        cache, logits = run(model, tokens)
        assert s.save(cache, tokens, logits)
        kept[s._name(tokens)] = (tokens, logits)
        per = os.path.getsize(os.path.join(s.dir, s._name(tokens)))
        if s.usage() + per > s.budget:
            return kept
    raise AssertionError("the budget never filled")


@pytest.mark.parametrize("failure", ["fsync", "mid_write"])
def test_failed_write_evicts_nothing(tmp_path, model, monkeypatch, failure):
    """The store is full, so the next snapshot needs room; its write fails (a full disk at the
    fsync, an error between sections): every snapshot is still there and restores exactly, no
    temporary file is left; the same save without the failure then evicts."""
    with KVStore(tmp_path / "kv", 0.1, model, ctx=CTX, min_tokens=1) as s:
        kept = fill_to_budget(s, model)
        assert len(kept) >= 2 and s.counts.evictions == 0
        files = sorted(os.listdir(s.dir))
        tokens = ids_for(999, 30)
        cache, logits = run(model, tokens)

        def disk_full(*a):
            raise OSError(errno.ENOSPC, "No space left on device")
        if failure == "fsync":
            monkeypatch.setattr(os, "fsync", disk_full)
        else:
            calls = []
            monkeypatch.setenv(WRITE_DELAY_ENV, "0.001")
            monkeypatch.setattr(snapshot.time, "sleep", lambda _: calls.append(1) or len(calls) < 5 or disk_full())
        assert not s.save(cache, tokens, logits)
        monkeypatch.undo()
        assert sorted(os.listdir(s.dir)) == files and set(s.entries) == set(kept)
        assert s.counts.evictions == 0 and s.counts.saves == len(kept)
        for name, (t, want) in kept.items():
            got = s.restore(model.new_cache(1, CTX), t)
            assert got is not None and got[0] == len(t) and torch.equal(got[1], want), name
        assert s.save(cache, tokens, logits)
        assert s.counts.evictions >= 1 and s.usage() <= s.budget


def test_stats_and_quarantine_note_writes_are_crash_safe(tmp_path, model, monkeypatch):
    d = tmp_path / "kv"
    tokens, bad = ids_for(20, 30), ids_for(21, 30)
    with other_store(tmp_path, model, "kv") as s:
        saved(s, model, tokens)
        for _ in range(2):
            assert s.restore(model.new_cache(1, CTX), tokens)[0] == 30
    old_stats = (d / "stats.json").read_bytes()
    assert json.loads(old_stats) == {s._name(tokens): {"hits": 2}}

    real_replace = os.replace

    def replace_failing_for(suffix):
        def replace(src, dst):
            if os.fspath(dst).endswith(suffix):
                raise OSError(errno.EIO, "injected rename failure")
            return real_replace(src, dst)
        return replace

    with other_store(tmp_path, model, "kv") as s:
        assert s.restore(model.new_cache(1, CTX), tokens)[0] == 30  # 3 hits, never written below
        path, _, _ = saved(s, model, bad)
        open(path, "r+b").truncate(100)
        monkeypatch.setattr(os, "replace", replace_failing_for(".why"))
        assert s.restore(model.new_cache(1, CTX), bad) is None       # quarantined, its note not written
        assert s.quarantined() and s.last_rejection[:2] == (s._name(bad), "truncated")
        monkeypatch.setattr(os, "replace", replace_failing_for("stats.json"))
        s.close()                                                      # the stats write fails
        monkeypatch.undo()
        assert not [n for n in os.listdir(d) + os.listdir(d / "quarantine") if n.startswith(".tmp-")]
        assert not [n for n in os.listdir(d / "quarantine") if n.endswith(".why")]
    assert (d / "stats.json").read_bytes() == old_stats                # the old file, intact
    # a crash mid-write leaves temporary files: the next start removes them and reads the old stats
    (d / ".tmp-0123456789ab-stats.json.part").write_bytes(b'{"half')
    (d / "quarantine" / ".tmp-0123456789ab-x.why.part").write_bytes(b'{"half')
    with other_store(tmp_path, model, "kv") as s:
        assert s.entries[s._name(tokens)].hits == 2
        assert len(s.quarantined()) == 1 and s.quarantined()[0].startswith(s._name(bad))
        assert not [n for n in os.listdir(d) + os.listdir(d / "quarantine") if n.startswith(".tmp-")]
        assert s.restore(model.new_cache(1, CTX), tokens)[0] == 30


# --------------------------------------------------------------------------- model fingerprint
def test_fingerprint_uses_the_checkpoint_fingerprint_when_set(model, monkeypatch):
    """With `checkpoint_fingerprint` no weight byte is read: a perturbed copy carrying the same
    one gets the same fingerprint, another checkpoint or dtype a different one."""
    a = copy.deepcopy(model)
    a.checkpoint_fingerprint = "ckpt-A"
    fp = snapshot.model_fingerprint(a)

    def no_weights(*_):
        raise AssertionError("weights hashed although the checkpoint has a fingerprint")
    monkeypatch.setattr(snapshot, "_weights_digest", no_weights)
    perturbed = copy.deepcopy(a)
    with torch.no_grad():
        next(perturbed.parameters()).view(-1)[0] += 1.0
    assert snapshot.model_fingerprint(perturbed) == fp
    other = copy.deepcopy(a)
    other.checkpoint_fingerprint = "ckpt-B"
    assert snapshot.model_fingerprint(other) != fp
    bf16 = copy.deepcopy(a).to(torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and snapshot.model_fingerprint(bf16) != fp
    monkeypatch.undo()
    assert snapshot.model_fingerprint(copy.deepcopy(model)) != fp  # the weight-hash branch differs


@pytest.mark.parametrize("attribute", [None, ""])
def test_fingerprint_hashes_the_weights_without_a_checkpoint_fingerprint(model, attribute):
    a = copy.deepcopy(model)
    if attribute is None:
        vars(a).pop("checkpoint_fingerprint", None)  # a model built in memory has none
    else:
        a.checkpoint_fingerprint = attribute
    b = copy.deepcopy(a)
    assert snapshot.model_fingerprint(a) == snapshot.model_fingerprint(b)  # separate objects, same bytes
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1e-3
    c = copy.deepcopy(b)  # a fresh object: nothing cached
    assert snapshot.model_fingerprint(c) != snapshot.model_fingerprint(a)


# --------------------------------------------------------------------------- checkpoints (format version 3)
@torch.no_grad()
def checkpointed(model, tokens, at):
    """A fresh cache fed `tokens` in pieces ending at each position of `at`, a checkpoint taken at
    each: (cache, logits of the next token, {position: checkpoint})."""
    cache, checkpoints, start = model.new_cache(1, CTX), {}, 0
    for c in list(at) + [len(tokens)]:
        logits = prefill(model, cache, torch.tensor([tokens[start:c]]), chunk=16)[0]
        if c < len(tokens):
            checkpoints[c] = cache.take_checkpoint(0)
        start = c
    return cache, logits, checkpoints


def test_checkpoints_go_to_disk_and_branch_after_restore(store, model):
    """A snapshot with two checkpoints: restored, they equal the ones taken, and a sequence that
    diverges after the second one, branched from the restored slot, continues like a cold run."""
    tokens = ids_for(8, 70)
    cache, logits, checkpoints = checkpointed(model, tokens, (17, 48))
    assert store.save(cache, tokens, logits, checkpoints=checkpoints)
    restored = model.new_cache(2, CTX)
    assert store.restore(restored, tokens + [5])[0] == 70
    assert list(store.restored_checkpoints) == [17, 48]
    for c, checkpoint in checkpoints.items():
        got = store.restored_checkpoints[c]
        assert got.keys() == checkpoint.keys() and all(torch.equal(got[k], t) for k, t in checkpoint.items())
    other = tokens[:50] + ids_for(9, 12)
    restored.branch_from_checkpoint(1, 0, restored.import_checkpoint(store.restored_checkpoints[48]))
    with torch.no_grad():
        got = prefill(model, restored.slot(1), torch.tensor([other[48:]]), chunk=16)[0]
    assert (got - checkpointed(model, other, (17, 48))[1]).abs().max() <= 1e-5
    # A prompt diverging inside the snapshot (here: ending) is rewound to the checkpoint below the
    # divergence, with the checkpoints up to it, and continues like a cold run.
    short = model.new_cache(1, CTX)
    assert store.restore(short, tokens[:30]) == (17, None) and list(store.restored_checkpoints) == [17]
    with torch.no_grad():
        got = prefill(model, short, torch.tensor([tokens[17:30]]), chunk=16)[0]
    assert (got - checkpointed(model, tokens[:30], (17,))[1]).abs().max() <= 1e-5
    assert store.stored_prefix(tokens[:30]) == 17 and store.stored_prefix(tokens[:10]) == 0
    assert store.restore(model.new_cache(1, CTX), tokens[:10]) is None and store.restored_checkpoints == {}


@pytest.mark.parametrize("section,fn,detail", [
    ("checkpoints.20.layers.2.compressor.open_kv", lambda t: t[-1].fill_(1.0), "checkpoint at 20: "),
    ("checkpoints.20.position", lambda t: t.add_(1), "checkpoint at 20 holds position 21"),
    ("checkpoints.20.row_counts", lambda t: t.add_(1), "row_counts"),
    ("checkpoints.20.layers.0.window", lambda t: t.view(-1).__setitem__(0, float("nan")), "not finite"),
    ("checkpoints.20.layers.1.indexer.prev_gate", lambda t: t.fill_(float("-inf")), "overlap"),
])
def test_unusable_checkpoints_are_rejected(store, model, section, fn, detail):
    tokens = ids_for(6, 41)
    cache, logits, checkpoints = checkpointed(model, tokens, (20,))
    assert store.save(cache, tokens, logits, checkpoints=checkpoints)
    rewrite_section(os.path.join(store.dir, store._name(tokens)), section, fn)
    expect_rejected(store, model, tokens, "state", detail)


@pytest.mark.parametrize("positions,detail", [([41], "within [1, 41)"), ([20, 20], "increase strictly"),
                                              ([20.5], "list of integers"), ("20", "malformed header"),
                                              (None, "malformed header")])
def test_a_bad_checkpoint_list_is_a_header_error(store, model, positions, detail):
    tokens = ids_for(6, 41)
    cache, logits, checkpoints = checkpointed(model, tokens, (20,))
    assert store.save(cache, tokens, logits, checkpoints=checkpoints)
    path = os.path.join(store.dir, store._name(tokens))
    data, header, offsets = parse(path)
    if positions is None:
        del header["checkpoints"]
    else:
        header["checkpoints"] = positions
    write_header(path, data, header, bytes(data[min(a for a, _ in offsets.values()):]))
    expect_rejected(store, model, tokens, "header", detail)


def test_a_checkpoint_that_cannot_be_read_back_is_not_written(store, model):
    tokens = ids_for(6, 41)
    cache, logits, checkpoints = checkpointed(model, tokens, (20,))
    assert not store.save(cache, tokens, logits, checkpoints={41: checkpoints[20]})   # not below the count
    bad = dict(checkpoints[20], position=torch.tensor(24))                          # row counts disagree
    assert not store.save(cache, tokens, logits, checkpoints={24: bad})
    assert store.counts.saves == 0 and not store.entries


def test_common_prefix_matches_a_token_walk():
    """The block-wise common prefix (the store compares every snapshot with every prompt) equals
    a token-by-token walk, at any block size."""
    import random

    from serve.kvstore.store import _common_prefix

    rng = random.Random(3)
    for _ in range(500):
        a = [rng.randint(0, 3) for _ in range(rng.randint(0, 300))]
        b = a[:rng.randint(0, len(a))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 20))]
        want = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        for block in (1, 3, 64, 2048):
            assert _common_prefix(a, b, block) == _common_prefix(b, a, block) == want


def test_a_paged_cache_saves_and_restores_as_the_static_one(store, model):
    """The store reads and writes a paged cache's sequences (through views, as the server holds
    them) as it does a static cache's: a snapshot saved from a paged cache restores into a paged
    and a static cache, and both decode as the live static cache does, bit for bit."""
    from ds4_torch.paged import PagedDS4Cache

    tokens = ids_for(12, 70)
    static, logits = run(model, tokens, decode_tail=5)
    paged = PagedDS4Cache(model.config, 2, CTX, block_tokens=16)
    run(model, ids_for(13, 20), cache=paged.slot(0))
    _, paged_logits = run(model, tokens, cache=paged.slot(1), decode_tail=5)
    assert torch.equal(paged_logits, logits)
    assert store.save(paged.slot(1), tokens, logits)
    reference = greedy(model, static, logits, 12)
    paged_target = PagedDS4Cache(model.config, 2, CTX, block_tokens=16)
    for target in (paged_target.slot(1), model.new_cache(1, CTX)):
        assert store.restore(target, tokens + [5])[0] == 70
        out, all_logits = greedy(model, target, logits, 12)
        assert out == reference[0] and torch.equal(all_logits, reference[1])
    assert paged_target.table(1).num_tokens == 70 + 12 and paged_target.table(0).blocks == []
