"""The disk KV cache (serve/kvstore.py) against the default model and real caches: restore
parity, every kind of damaged snapshot (rejected with its reason, quarantined, never tried
again), post-restore failures, the space budget and eviction order."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import xxhash

from ds4_torch.decode import make_decoder, prefill
from ds4_torch.default_model import build_default_model
from ds4_torch.model import DS4ForCausalLM
from serve import kvstore
from serve.kvstore import FIXED, KVStore

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
        f.write(FIXED.pack(kvstore.MAGIC, kvstore.VERSION, len(body), xxhash.xxh3_64_intdigest(body)) + body)
        f.write(payload)


def rewrite_section(path, name, fn):
    """Change one section's values and fix every checksum: a structurally valid file."""
    data, header, offsets = parse(path)
    at, nbytes = offsets[name]
    s = next(s for s in header["sections"] if s["name"] == name)
    t = torch.frombuffer(bytearray(data[at:at + nbytes]), dtype=torch.uint8).view(kvstore._DTYPES[s["dtype"]])
    t = t.reshape(s["shape"]).clone()
    fn(t)
    raw = kvstore._tensor_bytes(t).tobytes()
    data[at:at + nbytes] = raw
    s["xxh3"] = xxhash.xxh3_64_hexdigest(raw)
    if name == "tokens":
        header["tokens_hash"] = kvstore.tokens_hash(t.tolist())
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
        data[at:at + nbytes] = kvstore._tensor_bytes(t).tobytes()
        header["sections"][0]["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(data[at:at + nbytes]))
        write_header(path, data, header, bytes(data[at:]))
    else:
        open(path, "wb").write(data)
    expect_rejected(store, model, tokens, reason)


@pytest.mark.parametrize("section,fn,detail", [
    ("L0.window", lambda t: t.view(-1).__setitem__(5, float("nan")), "window not finite"),
    ("L1.comp.rows", lambda t: t.view(-1).__setitem__(0, float("inf")), "rows not finite"),
    ("counters", lambda t: t.__setitem__(0, t[0] + 1), "counters"),
    ("counters", lambda t: t.__setitem__(2, t[2] + 1), "counters"),
    ("L1.comp.prev_gate", lambda t: t.view(-1).__setitem__(0, float("-inf")), "overlap not finite"),
    ("L2.comp.open_kv", lambda t: t[-1].fill_(1.0), "slots past the open window"),
    ("logits", lambda t: t.__setitem__(0, float("nan")), "logits"),
])
def test_structurally_valid_but_unusable_state(store, model, section, fn, detail):
    tokens = ids_for(6, 41)  # 41 % 4 = 1, 41 % 16 = 9: open slots past the count exist
    path, _, _ = saved(store, model, tokens)
    rewrite_section(path, section, fn)
    expect_rejected(store, model, tokens, "state", detail)


def test_state_rules_before_first_window(store, model):
    tokens = ids_for(7, 3)  # no window closed: CSA overlap gates must be exactly -inf, kv zero
    path, _, _ = saved(store, model, tokens)
    _, header, _ = parse(path)
    assert any(s["name"] == "L1.comp.prev_gate" for s in header["sections"])
    rewrite_section(path, "L1.comp.prev_gate", lambda t: t.view(-1).__setitem__(0, 0.0))
    expect_rejected(store, model, tokens, "state", "overlap set before the first window closed")
    path, _, _ = saved(store, model, tokens)
    rewrite_section(path, "L0.window", lambda t: t[10].fill_(0.5))  # ring slot 10 of a 3-token sequence
    expect_rejected(store, model, tokens, "state", "window slots >= 3 written")


def other_store(tmp_path, model, name, **kw):
    return KVStore(tmp_path / name, 64, model, ctx=kw.pop("ctx", CTX), min_tokens=1, **kw)


def test_snapshot_of_another_model(store, model, tmp_path):
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).view(-1)[0] += 1e-3  # other weights, same shapes and config
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
    written = []
    with torch.no_grad():
        for step in range(40):
            t = int(logits.argmax())
            logits = decoder.step(torch.tensor([t]))[0]
            tokens.append(t)
            if store.checkpoint(cache, tokens, logits):
                written.append(len(tokens))
    assert written == [36, 52]


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
