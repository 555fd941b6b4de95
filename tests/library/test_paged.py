"""The paged KV bookkeeping (`ds4_torch.paged`) against a naive reference of the same rules.

The reference keys a cached block by its tenant and the whole token prefix it ends (no digests,
no heaps, linear scans), so the pool's hash chain, free heap and LRU order are checked against
an independent statement of the semantics. Every random step compares the block ids and copies
both hand out; a shadow of each physical block's content (the copies applied, then the writes)
checks that no sequence ever sees another's tokens, and the invariants (reference counts equal
the tables' holdings, never negative; free, cached and held blocks disjoint and covering the
pool) are checked after every step."""
from __future__ import annotations

import math
import random

import pytest

from ds4_torch.paged import BlockPool, BlockTable, PoolExhausted, chain_digest


class RefPool:
    def __init__(self, n, bt):
        self.n, self.bt = n, bt
        self.ref = [0] * n
        self.key = [None] * n        # (tenant, prefix tuple) of a registered block
        self.released = [None] * n   # clock when its count last fell to 0 (registered blocks)
        self.clock = 0
        self.evictions = 0

    def available(self):
        return sum(1 for b in range(self.n) if self.ref[b] == 0)

    def allocate(self):
        free = [b for b in range(self.n) if self.ref[b] == 0 and self.key[b] is None]
        cached = [b for b in range(self.n) if self.ref[b] == 0 and self.key[b] is not None]
        if free:
            b = min(free)
        elif cached:
            b = min(cached, key=lambda c: self.released[c])
            self.key[b] = None
            self.evictions += 1
        else:
            raise PoolExhausted
        self.ref[b] = 1
        return b

    def decref(self, b):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.clock += 1
            self.released[b] = self.clock

    def find(self, key):
        return next((b for b in range(self.n) if self.key[b] == key), None)

    def lookup(self, tenant, tokens):
        out = []
        for k in range(len(tokens) // self.bt):
            b = self.find((tenant, tuple(tokens[:(k + 1) * self.bt])))
            if b is None:
                break
            out.append(b)
        return out


class RefTable:
    def __init__(self, pool, tenant):
        self.pool, self.tenant, self.blocks, self.tokens = pool, tenant, [], []
        self.offered = 0  # full blocks offered for registration so far (their tokens final and known)

    def from_prefix(self, tokens):
        self.blocks = self.pool.lookup(self.tenant, tokens)
        for b in self.blocks:
            self.pool.ref[b] += 1
        self.tokens = list(tokens[:len(self.blocks) * self.pool.bt])
        self.offered = len(self.blocks)

    def own(self, k):
        p = self.pool
        if k < len(self.blocks) and (p.ref[self.blocks[k]] > 1 or p.key[self.blocks[k]] is not None):
            new = p.allocate()
            p.decref(self.blocks[k])
            old, self.blocks[k] = self.blocks[k], new
            return [(old, new)]
        return []

    def append(self, tokens, tentative=False):
        p, bt, n = self.pool, self.pool.bt, len(self.tokens)
        k = n // bt
        shared = n < len(self.blocks) * bt and (p.ref[self.blocks[k]] > 1 or p.key[self.blocks[k]] is not None)
        need = math.ceil((n + len(tokens)) / bt) - len(self.blocks) + (1 if tokens and shared else 0)
        if need > p.available():
            raise PoolExhausted
        copies = self.own(k) if tokens else []
        self.tokens += tokens
        while len(self.blocks) * bt < len(self.tokens):
            self.blocks.append(p.allocate())
        self.register((n if tentative else len(self.tokens)) // bt)
        return copies

    def register(self, full):  # a tentative append's blocks wait until final; an unknown id stops the chain
        p, bt = self.pool, self.pool.bt
        for k in range(self.offered, full):
            if None in self.tokens[k * bt:(k + 1) * bt]:
                return
            key = (self.tenant, tuple(self.tokens[:(k + 1) * bt]))
            b = self.blocks[k]
            if p.key[b] is None and p.find(key) is None:
                p.key[b] = key
            self.offered = k + 1

    def drop(self, n):
        p, keep = self.pool, len(self.tokens) - n
        k = keep // p.bt
        released = sum(1 for b in self.blocks[math.ceil(keep / p.bt):] if p.ref[b] == 1)
        if keep % p.bt and (p.ref[self.blocks[k]] > 1 or p.key[self.blocks[k]] is not None) \
                and p.available() + released < 1:
            raise PoolExhausted
        self.truncate(keep)
        return self.own(keep // self.pool.bt) if keep % self.pool.bt else []

    def fork(self):
        other = RefTable(self.pool, self.tenant)
        other.blocks, other.tokens, other.offered = list(self.blocks), list(self.tokens), self.offered
        for b in self.blocks:
            self.pool.ref[b] += 1
        return other

    def truncate(self, n):
        keep = math.ceil(n / self.pool.bt)
        for b in reversed(self.blocks[keep:]):
            self.pool.decref(b)
        del self.blocks[keep:], self.tokens[n:]
        self.offered = min(self.offered, n // self.pool.bt)


def check_invariants(pool: BlockPool, tables, content):
    held = [0] * pool.num_blocks
    for t in tables:
        for b in t.blocks:
            held[b] += 1
    assert [pool.refcount(b) for b in range(pool.num_blocks)] == held
    free, cached = set(pool.free_blocks()), set(pool.cached_blocks())
    referenced = {b for b in range(pool.num_blocks) if held[b]}
    assert not free & cached and not free & referenced and not cached & referenced
    assert free | cached | referenced == set(range(pool.num_blocks))
    assert pool.num_available == len(free) + len(cached)
    assert all(pool.digest(b) is not None for b in cached) and all(pool.digest(b) is None for b in free)
    bt = pool.block_tokens
    for t in tables:  # what each sequence reads is its own tokens
        assert len(t.blocks) == math.ceil(len(t.tokens) / bt)
        seen = [content[b][i] for k, b in enumerate(t.blocks) for i in range(bt) if k * bt + i < len(t.tokens)]
        assert seen == t.tokens
        for k, d in enumerate(t.digests):
            assert d == chain_digest(t.digests[k - 1] if k else None, t.tenant, t.tokens[k * bt:(k + 1) * bt])
    for b in range(pool.num_blocks):  # a registered block holds the tokens it is registered under
        if pool.digest(b) is not None:
            assert None not in content[b]


class Mirror:
    """A `PoolListener` keeping what a subscriber to the pool's events would know: the digests
    stored and not removed, each checked against `chain_digest` of what the event says it covers."""

    def __init__(self):
        self.held: set[bytes] = set()
        self.stored_count = self.removed_count = 0

    def stored(self, digest, parent, tokens, tenant):
        assert digest not in self.held, "a digest announced twice without its removal between"
        assert digest == chain_digest(parent, tenant, tokens)
        self.held.add(digest)
        self.stored_count += 1

    def removed(self, digest):
        self.held.remove(digest)  # (KeyError: removed without having been stored)
        self.removed_count += 1


def write(content, table: BlockTable, start, copies):
    for src, dst in copies:
        content[dst] = list(content[src])
    bt = table.pool.block_tokens
    for j in range(start, len(table.tokens)):
        content[table.blocks[j // bt]][j % bt] = table.tokens[j]


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_the_reference(seed):
    rng = random.Random(seed)
    bt, n = rng.choice([(2, 12), (4, 10), (3, 16)])
    pool, ref = BlockPool(n, bt), RefPool(n, bt)
    pool.listener = mirror = Mirror()
    content = [[None] * bt for _ in range(n)]
    live: list[tuple[BlockTable, RefTable]] = []
    stems = [[rng.randrange(3) for _ in range(20)] for _ in range(3)]  # shared prefixes, divergent tails
    tenants = [None, None, "a", "b"]
    hits = evicted = cows = spec = 0
    for step in range(500):
        op = rng.random()
        if op < 0.25 and len(live) < 6:  # a new sequence, from the cache's longest prefix
            tenant = rng.choice(tenants)
            prompt = rng.choice(stems)[:rng.randrange(21)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
            assert pool.lookup(prompt, tenant) == ref.lookup(tenant, prompt)
            t, r = BlockTable.from_prefix(pool, prompt, tenant), RefTable(ref, tenant)
            r.from_prefix(prompt)
            hits += len(t.blocks)
            live.append((t, r))
        elif op < 0.5 and live:  # extend
            t, r = rng.choice(live)
            extra = [rng.randrange(3) for _ in range(rng.randrange(1, 2 * bt + 2))]
            start = len(t.tokens)
            try:
                copies = t.append(extra)
            except PoolExhausted:
                with pytest.raises(PoolExhausted):
                    r.append(extra)
                continue
            assert copies == r.append(extra)
            cows += len(copies)
            write(content, t, start, copies)
        elif op < 0.6 and live:  # a speculative step: unknown ids, some taken back, the rest named
            t, r = rng.choice(live)
            k, start = rng.randrange(1, bt + 2), len(t.tokens)
            try:
                copies = t.append([None] * k, tentative=True)
            except PoolExhausted:
                with pytest.raises(PoolExhausted):
                    r.append([None] * k, tentative=True)
                continue
            assert copies == r.append([None] * k, tentative=True)
            write(content, t, start, copies)
            dropped = rng.randrange(k + 1)
            copies = t.drop(dropped)
            assert copies == r.drop(dropped)
            write(content, t, len(t.tokens), copies)
            ids = [rng.randrange(3) for _ in range(k - dropped)]
            t.name_tokens(ids)
            r.tokens[start:] = ids
            write(content, t, start, [])  # (the rows there are now known to be those of `ids`)
            spec += 1
        elif op < 0.65 and live:  # a later trim: give back a tail
            t, r = rng.choice(live)
            dropped = rng.randrange(len(t.tokens) + 1)
            try:
                copies = t.drop(dropped)
            except PoolExhausted:
                with pytest.raises(PoolExhausted):
                    r.drop(dropped)
                continue
            assert copies == r.drop(dropped)
            write(content, t, len(t.tokens), copies)
        elif op < 0.7 and live:  # fork
            t, r = rng.choice(live)
            live.append((t.fork(), r.fork()))
        elif op < 0.8 and live:  # rewind
            t, r = rng.choice(live)
            k = rng.randrange(len(t.tokens) + 1)
            t.truncate(k)
            r.truncate(k)
        elif live:  # finish
            i = rng.randrange(len(live))
            t, r = live.pop(i)
            t.free()
            r.truncate(0)
        for t, r in live:
            assert (t.blocks, t.tokens) == (r.blocks, r.tokens)
        assert pool.evictions == ref.evictions
        for b in range(n):
            assert (pool.digest(b) is not None) == (ref.key[b] is not None)
        # the events told exactly the registered digests
        assert mirror.held == {pool.digest(b) for b in range(n) if pool.digest(b) is not None}
        check_invariants(pool, [t for t, _ in live], content)
    evicted = pool.evictions
    assert hits and evicted and cows and spec, (hits, evicted, cows, spec)  # sharing, reclaiming, copies, speculation
    assert mirror.removed_count == evicted and mirror.stored_count > evicted


def test_shared_prefix_is_stored_once_and_copied_only_where_written():
    pool = BlockPool(8, 4)
    a = BlockTable(pool)
    assert a.append(list(range(10))) == []  # blocks 0, 1 full (registered), 2 partial
    assert a.blocks == [0, 1, 2] and pool.num_cached == 0
    b = BlockTable.from_prefix(pool, list(range(9)) + [99, 98])  # same first 9 tokens: 2 full blocks
    assert b.blocks == [0, 1] and b.num_tokens == 8 and pool.refcount(0) == 2
    assert b.append([8, 99, 98]) == []  # a new block of its own, nothing copied
    assert b.blocks == [0, 1, 3]
    c = a.fork()  # shares the partial block 2 too
    assert c.append([7]) == [(2, 4)] and c.blocks == [0, 1, 4]  # the first writer copies
    assert a.append([5]) == [] and a.blocks == [0, 1, 2]         # the last holder writes in place


def test_tenants_never_share_blocks():
    pool = BlockPool(8, 4)
    a = BlockTable(pool, tenant="alice")
    a.append(list(range(8)))
    assert pool.lookup(list(range(8)), "alice") == a.blocks
    assert pool.lookup(list(range(8)), "bob") == [] and pool.lookup(list(range(8))) == []
    b = BlockTable(pool, tenant="bob")
    b.append(list(range(8)))
    assert set(b.blocks).isdisjoint(a.blocks)


def test_unreferenced_blocks_stay_cached_and_are_reclaimed_least_recent_first_tail_first():
    pool = BlockPool(4, 2)
    a = BlockTable(pool)
    a.append([1, 2, 3, 4])       # blocks 0, 1
    a.free()                      # released tail first: 1 then 0
    assert pool.cached_blocks() == [1, 0] and pool.num_free == 2
    b = BlockTable(pool)
    b.append([9, 9, 9, 9])        # the two free blocks first: the cache survives
    assert b.blocks == [2, 3] and pool.lookup([1, 2, 3, 4]) == [0, 1]
    c = BlockTable(pool)
    c.append([7, 7])              # nothing free: reclaims block 1, the tail of the cached chain
    assert c.blocks == [1] and pool.evictions == 1
    assert pool.lookup([1, 2, 3, 4]) == [0]  # the head of the chain still serves
    again = BlockTable.from_prefix(pool, [1, 2, 3, 4])
    assert again.blocks == [0] and pool.num_cached == 0  # taken back: no longer a reclaim candidate
    with pytest.raises(PoolExhausted):
        c.append([7, 7, 7])
    assert c.tokens == [7, 7] and c.blocks == [1] and pool.num_available == 0  # nothing changed


def test_rewind_into_a_registered_block_copies_it_before_writing():
    pool = BlockPool(4, 4)
    a = BlockTable(pool)
    a.append([1, 2, 3, 4, 5])
    a.truncate(2)                 # keeps block 0 (registered, full of 1 2 3 4), drops block 1
    assert a.blocks == [0] and pool.num_free == 3
    copies = a.append([8])        # writing position 2 would change a cached block: copy first
    assert copies == [(0, 1)] and a.blocks == [1]
    assert pool.lookup([1, 2, 3, 4]) == [0]  # the cached block still holds 1 2 3 4


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="block_tokens"):
        BlockPool(4, 0)
    pool = BlockPool(2, 2)
    t = BlockTable(pool)
    t.append([1])
    with pytest.raises(ValueError, match="truncate"):
        t.truncate(2)
    with pytest.raises(ValueError, match="free"):
        pool.incref(1)
    t.free()
    with pytest.raises(ValueError, match="not held"):
        pool.decref(0)


# --------------------------------------------------------------------------- the paged cache
import dataclasses  # noqa: E402

import torch  # noqa: E402

from ds4_torch import DS4ForCausalLM  # noqa: E402
from ds4_torch.cache import DS4Cache  # noqa: E402
from ds4_torch.config import DS4Config  # noqa: E402
from ds4_torch.kernels import attention_ops  # noqa: E402
from ds4_torch.kv_format import row_format  # noqa: E402
from ds4_torch.paged import PagedDS4Cache  # noqa: E402

SMALL = dict(
    vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
    head_dim=16, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=6,
    layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], index_n_heads=8, index_head_dim=8, index_topk=3,
    n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=5,
)


@pytest.fixture(scope="module")
def small_model():
    from oracle import randomise

    m = DS4ForCausalLM(DS4Config.from_dict(SMALL))
    randomise(m, 5)
    return m.eval()


def assert_slots_follow_tables(cache):
    """Each sequence's slot map is what its table says, row by row (kept up to date incrementally)."""
    bt = cache.pool.block_tokens
    for rate, slots in cache._slots.items():
        per_block, scratch = bt // rate, cache.pool.num_blocks * (bt // rate)
        for b in range(cache.batch_size):
            blocks = cache.table(b).blocks
            want = [blocks[w // per_block] * per_block + w % per_block if w // per_block < len(blocks) else scratch
                    for w in range(slots.shape[1] - 1)] + [scratch]  # (row C: always the scratch row)
            assert slots[b].tolist() == want, (rate, b)


class Pair:
    """The same operations on a static and a paged cache; every forward's logits compared bit
    for bit. Every attention and top-k call of the paged forwards must read the pool in place
    (get the slots), except over fp8 rows, which are gathered. `kernels="triton"`: the paged
    forwards' attention and top-k run the Triton kernels (the interpreter; the rest of the model
    stays on the reference: it is not what is tested here, and slow there), and their logits match
    the static cache's (the reference) within `atol` instead."""

    def __init__(self, model, batch, context, kv_rows="full", kernels=None, atol=0.0, **paged):
        self.model, self.atol = model, atol
        self.ops = model.ops
        if kernels == "triton":
            triton = attention_ops("triton")
            self.ops = dataclasses.replace(model.ops, attention=triton.attention, indexer_topk=triton.indexer_topk)
        self.static = DS4Cache(model.config, batch, context, kv_rows=kv_rows)
        self.paged = PagedDS4Cache(model.config, batch, context, kv_rows=kv_rows, **paged)
        self.in_place = not row_format(kv_rows).fp8
        self.forwards = 0

    def _paged_forward(self, ids):
        """The paged forward, checking what its ops were given."""
        ops, calls = self.ops, []

        def attention(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale, comp_slots=None):
            if rate:  # (sliding layers have no rows)
                calls.append(comp_slots is not None)
            return ops.attention(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale, comp_slots)

        def indexer_topk(q, head_weights, rows, start, rate, k, rows_slots=None):
            calls.append(rows_slots is not None)
            return ops.indexer_topk(q, head_weights, rows, start, rate, k, rows_slots)

        own = self.model.ops
        self.model.ops = dataclasses.replace(ops, attention=attention, indexer_topk=indexer_topk)
        try:
            got = self.model(ids, self.paged)
        finally:
            self.model.ops = own
        assert calls and calls == [self.in_place] * len(calls), calls
        return got

    def forward(self, ids):
        ids = torch.as_tensor(ids)
        with torch.inference_mode():
            want = self.model(ids, self.static)
            self.paged.append_tokens(ids)
            got = self._paged_forward(ids)
        if self.atol:
            err = (got - want).abs().max().item()
            assert err <= self.atol, f"forward {self.forwards}: {err} from the reference"
        else:
            assert torch.equal(got, want), f"forward {self.forwards}: max diff {(got - want).abs().max()}"
        assert_slots_follow_tables(self.paged)
        self.forwards += 1

    def run(self, ids, chunk):  # [B, T] in chunks, then returns
        for s in range(0, ids.shape[1], chunk):
            self.forward(ids[:, s:s + chunk])


@pytest.mark.parametrize("which,kv_rows", [("embedded", "full"), ("small", "full"), ("small", "fp8"),
                                           ("small", "fp8-keep-rope")])
def test_paged_rows_give_the_static_caches_logits_bit_for_bit(which, kv_rows, model, small_model):
    m = model if which == "embedded" else small_model
    bt = 16 if which == "embedded" else 8  # a multiple of every rate
    g = torch.Generator().manual_seed(7)
    pair = Pair(m, 2, 160, kv_rows, block_tokens=bt, num_blocks=2 * 160 // bt + 4)
    ids = torch.randint(2, m.config.vocab_size, (2, 124), generator=g)
    pair.run(ids[:, :100], chunk=24)          # prefill chunks across block and emit boundaries
    for t in range(100, 124):                 # decode steps (through an emit of every rate)
        pair.forward(ids[:, t:t + 1])
    # the pool really holds the rows: scribbling on blocks no table holds changes nothing,
    # scribbling on held ones changes the logits
    paged, nxt = pair.paged, ids[:, -1:]

    def scribble(block, value):
        for layer in paged.layers:
            for state in layer.states:
                per_block = bt // layer.rate
                for part in state.row_parts().values():  # fp8 values and scales: their bytes moved
                    rows = part[block * per_block:(block + 1) * per_block]
                    if part.dtype in (torch.float8_e4m3fn, torch.uint8):
                        rows.view(torch.uint8).add_(1)
                    else:
                        rows += value

    for block in paged.pool.free_blocks():
        scribble(block, 1e3)
    pair.forward(nxt)
    scribble(paged.tables[0].blocks[0], 1.0)
    with torch.inference_mode():
        paged.append_tokens(nxt)
        assert not torch.equal(m(nxt, paged), m(nxt, pair.static))


@pytest.mark.parametrize("kv_rows", ["full", "fp8-keep-rope"])  # fp8: every row part copied on write
def test_two_sequences_share_a_prefix_and_stay_exact(small_model, kv_rows):
    m, bt = small_model, 8
    g = torch.Generator().manual_seed(11)
    vocab = m.config.vocab_size
    pair = Pair(m, 2, 200, kv_rows, block_tokens=bt, num_blocks=40)
    prefix = torch.randint(2, vocab, (1, 61), generator=g).expand(2, -1)  # 7 full blocks and 5 tokens
    pair.run(prefix[:, :48], chunk=24)
    ck = {"static": pair.static.take_checkpoint(0), "paged": pair.paged.take_checkpoint(0)}  # at 6 blocks
    pair.run(prefix[:, 48:], chunk=13)
    # slot 1 continues from slot 0's state: static copies it, paged shares its blocks
    pair.static.copy_sequence(1, 0)
    pair.paged.fork(1, 0)
    paged, pool = pair.paged, pair.paged.pool
    assert paged.tables[1].blocks == paged.tables[0].blocks
    assert all(pool.refcount(b) == 2 for b in paged.tables[0].blocks)
    pair.run(torch.randint(2, vocab, (2, 30), generator=g), chunk=7)  # the two diverge
    t0, t1 = paged.tables
    assert t0.blocks[:7] == t1.blocks[:7] and t0.blocks[7] != t1.blocks[7]  # the partial block was copied
    # a third history on slot 1 from the pool's cached blocks of the prefix and the checkpoint at 48
    for c in (pair.static, paged):
        c.reset(1)
    assert paged.cached_tokens(prefix[0].tolist()) == 56
    pair.static.branch_from_checkpoint(1, 0, ck["static"])
    paged.start_from_cache(1, prefix[0].tolist(), ck["paged"])
    assert paged.tables[1].blocks == t0.blocks[:6]
    pair.run(torch.randint(2, vocab, (2, 20), generator=g), chunk=5)
    assert paged.tables[1].blocks[:6] == paged.tables[0].blocks[:6]
    held = {b for t in paged.tables for b in t.blocks}
    assert len(held) < len(paged.tables[0].blocks) + len(paged.tables[1].blocks)  # stored once
    # a rewind in place: back to the checkpoint, then on
    for name, c in (("static", pair.static), ("paged", paged)):
        c.restore_checkpoint(0, ck[name])
    assert paged.tables[0].num_tokens == 48
    pair.run(torch.randint(2, vocab, (2, 12), generator=g), chunk=12)
    # a forward given no append_tokens takes its tokens itself (the model's forward, prefill, decoders)
    nxt = torch.randint(2, vocab, (2, 1), generator=g)
    assert torch.equal(m(nxt, paged), m(nxt, pair.static))
    assert [t.num_tokens for t in paged.tables] == paged.positions.tolist()
    with pytest.raises(ValueError, match="whole blocks"):
        paged.start_from_cache(1, [1, 2, 3], ck["paged"])
    for b in range(2):  # a paged sequence exports the static one's state: names, order, values
        want, got = pair.static.export_sequence(b), paged.export_sequence(b)
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_triton_kernels_read_the_pool_in_place(small_model):
    """The Triton kernels (interpreter) reading a paged cache's pool give the reference's logits
    over the static cache within the kernels' tolerance (as
    test_kernels.test_model_triton_backend_equals_torch; test_kernels checks the kernels give
    bit for bit their dense answer), through prefill chunks and decode steps
    across block and emit boundaries, two sequences sharing blocks (a fork), then diverging into
    tables of their own."""
    m, bt = small_model, 8
    g = torch.Generator().manual_seed(3)
    pair = Pair(m, 2, 64, kernels="triton", atol=1e-4, block_tokens=bt, num_blocks=20)
    ids = torch.randint(2, m.config.vocab_size, (2, 34), generator=g)
    pair.run(ids[:, :21], chunk=7)
    pair.static.copy_sequence(1, 0)
    pair.paged.fork(1, 0)  # both sequences now read the same blocks (2 full, one partial)
    for t in range(21, 34):  # through emits of both rates (positions 23, 27, 31) and two block ends
        pair.forward(ids[:, t:t + 1])
    t0, t1 = pair.paged.tables
    assert t0.blocks[:2] == t1.blocks[:2] and t0.blocks[2:] != t1.blocks[2:]
    assert pair.paged.positions.tolist() == [34, 34]


def test_the_documented_example_shares_a_prompt_and_matches_two_static_sequences(model):
    """The example of `ds4_torch.paged`'s docstring, at a small block size, against a static
    cache taking the same steps (bit for bit) and each sequence alone."""
    prompt = torch.randint(2, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(5))
    cache = PagedDS4Cache(model.config, batch_size=2, max_context=128, block_tokens=16)
    with torch.inference_mode():
        first = cache.slot(0)
        first.append_tokens(prompt)
        model(prompt, first)
        cache.fork(1, 0)
        nxt = torch.tensor([[5], [9]])
        cache.append_tokens(nxt)
        logits = model(nxt, cache)
        static = DS4Cache(model.config, 2, 128)  # the same steps, the rows copied
        model(prompt, static.slot(0))
        static.copy_sequence(1, 0)
        assert torch.equal(logits, model(nxt, static))
        for b in range(2):  # and each is what its sequence alone gives (another batch: to rounding)
            alone = DS4Cache(model.config, 1, 128)
            model(prompt, alone)
            torch.testing.assert_close(logits[b], model(nxt[b:b + 1], alone)[0], rtol=0, atol=1e-4)
    t0, t1 = cache.tables
    assert t0.blocks[:4] == t1.blocks[:4] and t0.blocks[4] != t1.blocks[4]  # 4 full blocks shared, the 5th copied
    assert cache.pool.num_blocks - cache.pool.num_available == 6


def test_a_tenant_finds_only_its_own_cached_blocks(small_model):
    m = small_model
    cache = PagedDS4Cache(m.config, 2, 64, block_tokens=8)
    cache.new_sequence(0, tenant="alice")
    cache.new_sequence(1, tenant="bob")
    ids = torch.randint(2, m.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2)).expand(2, -1)
    with torch.inference_mode():
        cache.append_tokens(ids)
        m(ids, cache)
    a, b = cache.tables
    assert set(a.blocks).isdisjoint(b.blocks)
    tokens = ids[0].tolist()
    assert cache.pool.lookup(tokens, "alice") == a.blocks and cache.pool.lookup(tokens, "bob") == b.blocks
    assert cache.cached_tokens(tokens) == 0 and cache.cached_tokens(tokens, "carol") == 0


# --------------------------------------------------------------------------- whole sequences
def assert_same_state(got, want):
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_export_import_and_copy_round_trip_against_the_static_cache(small_model):
    """A paged sequence exports what the static cache does after the same forwards; a state
    imported (into this pool, another pool, or the static cache) continues bit for bit as the
    static cache's import does; copies within a pool (across views of it too) share blocks."""
    m, bt = small_model, 8
    g = torch.Generator().manual_seed(3)
    vocab = m.config.vocab_size
    pair = Pair(m, 4, 120, block_tokens=bt, num_blocks=40)
    static, paged = pair.static, pair.paged
    pair.run(torch.randint(2, vocab, (4, 37), generator=g), chunk=11)  # 4 full blocks and 5 tokens
    for b in range(4):
        assert_same_state(paged.export_sequence(b), static.export_sequence(b))
    tokens0 = list(paged.table(0).tokens)
    state0 = static.export_sequence(0, device="cpu")
    # into this pool, with its tokens (their digests are taken by sequence 0's blocks: private copies)
    static.import_sequence(3, state0)
    paged.import_sequence(3, state0, tokens=tokens0)
    assert set(paged.table(3).blocks).isdisjoint(paged.table(0).blocks)
    # across views of one cache (a server's "resident" and "batch" caches): a fork, blocks shared
    resident, batch = paged._view(0, 2), paged._view(2, 2)
    batch.copy_sequence(0, 1, source=resident)   # global 2 <- global 1
    static.copy_sequence(2, 1)
    assert paged.table(2).blocks == paged.table(1).blocks
    assert all(paged.pool.refcount(b) == 2 for b in paged.table(1).blocks)
    pair.run(torch.randint(2, vocab, (4, 9), generator=g), chunk=9)
    ck = {"static": static.take_checkpoint(1), "paged": resident.take_checkpoint(1)}
    pair.run(torch.randint(2, vocab, (4, 6), generator=g), chunk=3)
    static.branch_from_checkpoint(2, 1, ck["static"])
    batch.branch_from_checkpoint(0, 1, ck["paged"], source=resident)
    assert paged.table(2).blocks[:5] == paged.table(1).blocks[:5]
    ids = torch.randint(2, vocab, (1, 6), generator=g)
    with torch.inference_mode():
        assert torch.equal(m(ids, paged.slot(2)), m(ids, static.slot(2)))
    pair.run(torch.randint(2, vocab, (4, 5), generator=g), chunk=5)
    for b in range(4):
        assert_same_state(paged.export_sequence(b), static.export_sequence(b))

    # into another pool: with tokens its full blocks are found by a later prefix, without they stay private
    n = int(static.positions[0])
    state0, tokens0 = static.export_sequence(0), list(paged.table(0).tokens)
    other = Pair(m, 2, 120, block_tokens=bt, num_blocks=20)
    other.static.import_sequence(0, state0)
    other.static.import_sequence(1, state0)
    other.paged.import_sequence(0, state0, tokens=tokens0, tenant="t")
    other.paged.copy_sequence(1, 0, source=static)  # from a static cache: export + import, private
    pool = other.paged.pool
    assert pool.lookup(tokens0, "t") == other.paged.table(0).blocks[:n // bt] and pool.lookup(tokens0) == []
    assert all(pool.digest(b) is None for b in other.paged.table(1).blocks) and not other.paged.table(1).digests
    assert_same_state(other.paged.export_sequence(1), state0)
    other.run(torch.randint(2, vocab, (2, 12), generator=g), chunk=7)  # continued: equal to the static import's
    ck = {"static": other.static.take_checkpoint(0), "paged": other.paged.take_checkpoint(0)}
    other.run(torch.randint(2, vocab, (2, 8), generator=g), chunk=7)
    assert not other.paged.table(1).digests  # (nor later: a digest would cover the unknown tokens)
    # from a paged cache into a static one and into another pool: a copy, and a branch from a checkpoint
    static.copy_sequence(3, 1, source=other.paged)
    paged.copy_sequence(3, 1, source=other.paged)
    static.branch_from_checkpoint(2, 0, ck["static"], source=other.paged)
    paged.branch_from_checkpoint(2, 0, ck["paged"], source=other.paged)
    assert int(paged.positions[2]) == int(ck["paged"]["position"]) < int(paged.positions[3])
    ids = torch.randint(2, vocab, (1, 8), generator=g)  # sequence 2 alone, then with the others
    with torch.inference_mode():
        assert torch.equal(m(ids, paged.slot(2)), m(ids, static.slot(2)))
    pair.run(torch.randint(2, vocab, (4, 4), generator=g), chunk=4)
    for b in range(4):
        assert_same_state(paged.export_sequence(b), static.export_sequence(b))
    assert_slots_follow_tables(other.paged)


def test_pool_exhausted_changes_nothing(small_model):
    """`append_tokens` and `import_sequence` check the whole need before taking a block: a
    refusal leaves every table and the pool as they were. `blocks_needed` counts a shared block
    written by several sequences of the batch exactly (copied by all but the last writer)."""
    m, bt = small_model, 8
    cache = PagedDS4Cache(m.config, 3, 64, block_tokens=bt, num_blocks=7)
    ids = torch.randint(2, m.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        m(ids, cache.slot(0))                  # 2 blocks, the second partial
    cache.fork(1, 0)
    cache.fork(2, 0)                            # three tables share both blocks
    pool = cache.pool

    def snapshot():
        return ([(list(t.blocks), list(t.tokens), list(t.digests)) for t in cache.tables],
                pool.free_blocks(), pool.cached_blocks(), [pool.refcount(b) for b in range(pool.num_blocks)])

    # one token each: the partial block is copied twice; the last writer keeps it
    assert cache.blocks_needed(1) == 2 and cache.blocks_needed(1, n=1) == 1
    # 5 tokens each: each sequence also grows into a new block
    assert cache.blocks_needed(5) == 2 + 3
    assert cache.blocks_needed([0, 5, 1]) == 1 + 2  # (sequence 0 still holds the shared block: both writers copy)
    before = snapshot()
    with pytest.raises(PoolExhausted):
        cache.append_tokens(torch.ones(3, 13, dtype=torch.long))  # 2 copies + 6 new blocks > 5 available
    assert snapshot() == before
    state = cache.export_sequence(0)
    big = DS4Cache(m.config, 1, 64)
    with torch.inference_mode():
        m(torch.ones(1, 60, dtype=torch.long), big)
    with pytest.raises(PoolExhausted):
        cache.import_sequence(2, big.export_sequence(0))  # 8 blocks; 5 free (+0: its table's are shared)
    assert snapshot() == before
    with pytest.raises(ValueError, match="tokens"):
        cache.import_sequence(2, state, tokens=[1, 2, 3])
    assert snapshot() == before
    assert cache.blocks_needed(5) == pool.num_available == 5
    cache.append_tokens(torch.ones(3, 5, dtype=torch.long))  # exactly what is available: fits
    assert pool.num_available == 0 and len({b for t in cache.tables for b in t.blocks}) == 1 + 3 + 3
