"""Triton kernels (under the interpreter, see conftest) and custom ops vs the torch reference.

Tolerances: fp32 <= 1e-5 absolute on outputs of magnitude ~1; fp16/bf16 within 8 ulps
(8 * eps of the dtype, relative, 1 absolute floor) of the fp32 reference evaluated on the same
(already rounded) inputs: the kernels accumulate in fp32 and round once, so the fp32 reference
is the right target (the low-precision reference itself rounds at every step).
"""

from __future__ import annotations

import sys

import pytest
import torch

from ds4_torch.kernels import attention_ops, kernel_for, reference
from ds4_torch.kernels import triton_kernels as tk
from helpers import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def distinct_selection(B, T, K, C, seed, n_none=1):
    """comp_sel as the indexer makes it: distinct rows per query, -1 in the last n_none slots.
    Rows may be past the visible count: the kernels must mask those too."""
    g = torch.Generator().manual_seed(seed)
    sel = torch.stack([torch.randperm(C, generator=g)[:K] for _ in range(B * T)]).view(B, T, K)
    sel[..., K - n_none:] = -1
    return sel


# --------------------------------------------------------------------------- attention
# (name, B, T, H, D, W, C, rate, starts, K or None for HCA)
ATTENTION_CASES = [
    ("decode_ring_wrap_hca", 1, 1, 3, 16, 5, 9, 2, [13], None),
    ("decode_partial_window_hca", 1, 1, 3, 16, 5, 9, 2, [2], None),
    ("decode_first_token", 1, 1, 2, 16, 4, 4, 2, [0], None),
    ("decode_ring_wrap_csa", 1, 1, 3, 16, 5, 12, 2, [21], 4),
    ("decode_staggered_csa", 3, 1, 2, 16, 4, 10, 2, [0, 5, 19], 3),
    ("decode_none_visible", 2, 1, 2, 16, 4, 6, 4, [1, 2], None),
    ("decode_sliding_only", 2, 1, 2, 16, 6, 0, 0, [3, 40], None),
    ("prefill_staggered_hca", 3, 4, 2, 16, 5, 8, 2, [0, 3, 17], None),
    ("prefill_staggered_csa", 3, 4, 2, 16, 5, 10, 2, [0, 3, 17], 3),
    ("prefill_chunk_longer_than_window", 1, 7, 2, 24, 3, 5, 3, [4], None),
    ("prefill_sliding_only", 2, 5, 3, 16, 4, 0, 0, [0, 9], None),
]


def attention_inputs(B, T, H, D, W, C, rate, starts, K, dtype, seed=0):
    q = randn(B, T, H, D, seed=seed, dtype=dtype)
    ring = randn(B, W, D, seed=seed + 1, dtype=dtype)
    chunk = randn(B, T, D, seed=seed + 2, dtype=dtype)
    comp = randn(B, C, D, seed=seed + 3, dtype=dtype)
    sel = distinct_selection(B, T, K, C, seed + 4) if K else None
    sinks = randn(H, seed=seed + 5)
    return q, ring, chunk, torch.tensor(starts), comp, sel, rate, sinks, D ** -0.5


def upcast(args):
    return [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]


# Every case in fp32; two representative ones in bf16/fp16 (the interpreter is slow).
ATTENTION_PARAMS = [(case, torch.float32) for case in ATTENTION_CASES] + [
    (case, dtype) for case in ATTENTION_CASES for dtype in DTYPES[1:]
    if case[0] in ("decode_ring_wrap_csa", "prefill_staggered_hca")]


@pytest.mark.parametrize("case,dtype", ATTENTION_PARAMS, ids=lambda x: x[0] if isinstance(x, tuple) else str(x))
def test_attention_matches_reference(case, dtype):
    args = attention_inputs(*case[1:], dtype)
    expected = reference.attention(*upcast(args))
    assert_close(tk.attention(*args), expected, dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 9])
def test_attention_split_counts_agree(num_splits):
    """Decode over 100 compressed rows (8 key blocks of 16): every split count, including some
    that leave splits empty, gives the reference's answer."""
    args = attention_inputs(2, 1, 2, 16, 8, 120, 2, [250, 37], None, torch.float32)
    expected = reference.attention(*args)
    assert_close(tk.attention(*args, num_splits=num_splits), expected, torch.float32)


def test_attention_default_split_count_changes_with_size():
    """The split count follows capacity (and a prefill chunk of many queries splits none);
    these sizes cross its steps and stay correct."""
    seen = {}
    block_n = tk.attention_config(2, 16, torch.float32)["BLOCK_N"]
    for C in (4, 40, 200, 2000):
        args = attention_inputs(1, 1, 2, 16, 8, C, 2, [3 * C], None, torch.float32, seed=C)
        seen[C] = tk.attention_num_splits(tk.attention_max_splits(1), -(-(8 + C) // block_n))
        assert_close(tk.attention(*args), reference.attention(*args), torch.float32)
    assert seen[4] == 1 and seen[4] < seen[40] < seen[200] < seen[2000] == tk.SPLIT_BUDGET, seen
    assert tk.attention_num_splits(tk.attention_max_splits(64), 2000) == 1


@pytest.mark.parametrize("rate,K", [(2, None), (2, 60)], ids=["hca", "csa"])
@pytest.mark.parametrize("T", [1, 3])
def test_attention_row_is_bit_identical_alone_and_in_any_batch(rate, K, T):
    """A row's output does not depend on the other rows of its launch (batch invariance, what
    makes a served request's greedy tokens equal its tokens alone): the same query, ring, chunk
    and compressed rows give the same bits alone (its own capacity) and in batches of 2 to 5
    beside longer rows (more compressed rows passed, as a step holding a longer sequence
    passes), however the launcher would split the keys."""
    H, D, W = 2, 16, 8
    own_c, start = 100, 180  # the row sees (start + 1) // rate compressed rows (seven key blocks with the window)
    g = torch.Generator().manual_seed(9)
    q, ring, chunk = randn(1, T, H, D, seed=1), randn(1, W, D, seed=2), randn(1, T, D, seed=3)
    comp = randn(1, own_c, D, seed=4)
    sel = distinct_selection(1, T, K, own_c, seed=5) if K else None
    sinks = randn(H, seed=6)
    alone = tk.attention(q, ring, chunk, torch.tensor([start]), comp, sel, rate, sinks, D ** -0.5)
    for B, big_c, at in ((2, 120, 0), (4, 200, 2), (5, 400, 4)):
        others = [randn(1, T, H, D, seed=10 + B), randn(1, W, D, seed=20 + B), randn(1, T, D, seed=30 + B)]
        qs, rings, chunks = (torch.cat([x if b == at else o.expand_as(x) for b in range(B)])
                             for x, o in zip((q, ring, chunk), others))
        comps = randn(B, big_c, D, seed=40 + B)
        comps[at, :own_c] = comp[0]
        starts = torch.tensor([start if b == at else 2 * big_c - 1 - b for b in range(B)])
        sels = None
        if K:
            sels = distinct_selection(B, T, K, big_c, seed=50 + B)
            sels[at] = sel[0]
        got = tk.attention(qs, rings, chunks, starts, comps, sels, rate, sinks, D ** -0.5)
        assert torch.equal(got[at], alone[0]), (B, big_c, (got[at] - alone[0]).abs().max().item())


def test_attention_no_compressed_rows_with_selection():
    """C == 0 with an (empty) selection: the sliding window alone."""
    args = list(attention_inputs(1, 2, 2, 16, 4, 0, 2, [6], None, torch.float32))
    args[5] = torch.empty(1, 2, 0, dtype=torch.int64)
    assert_close(tk.attention(*args), reference.attention(*args), torch.float32)


# --------------------------------------------------------------------------- compressor
# (name, B, J, S, D, R, first-half gates -inf)
COMPRESS_CASES = [
    ("hca_rate3", 2, 3, 3, 16, 8, False),
    ("csa_overlap_first_window", 1, 2, 8, 16, 8, True),
    ("odd_width_many_slots", 2, 2, 37, 20, 8, False),  # D not a power of two, S over several tiles
    ("no_rows", 2, 0, 4, 16, 8, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", COMPRESS_CASES, ids=lambda c: c[0])
def test_compress_rows_matches_reference(case, dtype):
    _, B, J, S, D, R, masked = case
    kv = randn(B, J, S, D, seed=1, dtype=dtype)
    gate = randn(B, J, S, D, seed=2, dtype=dtype)
    if masked:  # CSA's first window: the overlap slots of the previous window do not exist
        gate[..., : S // 2, : D // 2] = float("-inf")
    weight = 1 + 0.2 * randn(D, seed=3, dtype=dtype)
    angles = randn(B, J, R // 2, seed=4) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    args = (kv, gate, weight, 1e-6, cos, sin)
    expected = reference.compress_rows(*upcast(args))
    assert_close(tk.compress_rows(*args), expected, dtype)


# --------------------------------------------------------------------------- indexer
# (name, B, T, Hi, dI, C, rate, starts, k)
INDEXER_CASES = [
    ("fewer_visible_than_k", 1, 1, 8, 16, 10, 4, [9], 4),
    ("many_more_rows_than_k", 1, 2, 8, 16, 90, 2, [170], 3),  # two row tiles of 64
    ("k_above_capacity", 2, 1, 8, 8, 3, 2, [4, 30], 5),
    ("no_rows", 1, 2, 8, 16, 0, 2, [5], 3),
    ("none_visible", 2, 1, 8, 16, 6, 4, [0, 2], 3),
    ("prefill_staggered", 3, 4, 8, 16, 12, 2, [0, 5, 20], 3),
]


def indexer_inputs(B, T, Hi, dI, C, rate, starts, k, dtype, seed=0):
    q = randn(B, T, Hi, dI, seed=seed, dtype=dtype)
    weights = randn(B, T, Hi, seed=seed + 1) * Hi ** -0.5
    rows = randn(B, C, dI, seed=seed + 2, dtype=dtype)
    return q, weights, rows, torch.tensor(starts), rate, k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", INDEXER_CASES, ids=lambda c: c[0])
def test_indexer_topk_matches_reference(case, dtype):
    args = indexer_inputs(*case[1:], dtype)
    expected = reference.indexer_topk(*upcast(args))
    # Random scores: no near-tie at the k-th place among visible rows, so the picks are well defined.
    q, w, rows, start, rate, k = upcast(args)
    visible = reference.visible_rows(start, q.shape[1], rows.shape[1], rate)
    scores = reference.indexer_scores(q, w, rows).masked_fill(~visible, float("-inf"))
    scores = scores.sort(dim=-1, descending=True).values
    if 0 < k < rows.shape[1]:
        assert ((scores[..., k - 1] - scores[..., k] > 1e-4) | ~torch.isfinite(scores[..., k])).all()
    actual = tk.indexer_topk(*args)
    assert actual.dtype == torch.int64
    assert actual.tolist() == expected.tolist()


def test_indexer_boundary_tie_lower_index_wins():
    """Equal scores at the k-th place (identical rows 4, 7, 8) and a run of exact zeros (relu)
    resolve to the lower row index in both backends."""
    dI, Hi = 16, 8
    u = randn(dI, seed=0).abs() + 0.5
    q = (u + 0.01 * randn(1, 1, Hi, dI, seed=1)).contiguous()  # every head agrees with u
    weights = torch.full((1, 1, Hi), Hi ** -0.5)
    rows = -u.expand(10, dI).clone()  # relu -> score exactly 0
    rows[1], rows[5] = 3 * u, 2 * u
    rows[4] = rows[7] = rows[8] = u
    rows = rows[None]
    start = torch.tensor([40])
    for k, expected in ((3, [1, 5, 4]), (4, [1, 5, 4, 7]), (6, [1, 5, 4, 7, 8, 0]), (8, [1, 5, 4, 7, 8, 0, 2, 3])):
        for fn in (reference.indexer_topk, tk.indexer_topk):
            assert fn(q, weights, rows, start, 2, k)[0, 0].tolist() == expected, (fn, k)


# --------------------------------------------------------------------------- offsets past 2^31
WIDE = 2 ** 30 + 16  # a row stride: row 2 starts 2^31 + 32 elements in, past what int32 holds


def spread(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`x` as a view whose dimension `dim` has the stride WIDE (the others packed inside a row),
    without allocating gigabytes: the storage is an anonymous MAP_NORESERVE mapping of which only
    the written pages ever take memory. The view starts 2^31 elements into it, so an offset that
    wraps in int32 (2^32 too low) still lands in mapped (zero) memory: a kernel that overflows reads
    wrong values (a clean mismatch) instead of crashing."""
    mmap = pytest.importorskip("mmap")
    if not hasattr(mmap, "MAP_ANONYMOUS") or not sys.platform.startswith("linux"):
        pytest.skip("needs Linux's anonymous MAP_NORESERVE mappings")
    inner = x[(0,) * (dim + 1)].numel() if dim + 1 < x.dim() else 1
    assert inner <= WIDE
    strides, step = [0] * x.dim(), 1
    for d in reversed(range(x.dim())):
        strides[d] = WIDE if d == dim else step
        step = strides[d] * x.shape[d]
    offset = 2 ** 31
    numel = offset + sum((n - 1) * st for n, st in zip(x.shape, strides)) + 1
    try:
        buffer = mmap.mmap(-1, numel * x.element_size(),
                           flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000))
    except OSError as e:  # e.g. vm.overcommit_memory = 2 refuses it
        pytest.skip(f"cannot map {numel * x.element_size() >> 30} GiB of address space: {e}")
    view = torch.frombuffer(buffer, dtype=x.dtype).as_strided(x.shape, strides, offset)
    return view.copy_(x)


@pytest.mark.parametrize("wide", ["q", "ring", "chunk", "comp", "sel"])
def test_attention_rows_past_int32_offsets(wide):
    """One input's rows (queries, window ring, chunk, compressed cache, CSA selection) at offsets
    past 2^31 elements (a V4-Flash forward of >= 65,536 query rows, 32,768 elements each; a
    1M-token cache): the reference's output on the compact inputs. Start 4: the ring's row 2 is read."""
    names = ["q", "ring", "chunk", "start", "comp", "sel", "rate", "sinks", "scale"]
    args = list(attention_inputs(1, 3, 2, 16, 3, 3, 1, [4], 2 if wide == "sel" else None, torch.float32))
    want = reference.attention(*args)
    args[names.index(wide)] = spread(args[names.index(wide)], 1)
    assert args[names.index(wide)].stride(1) == WIDE
    assert_close(tk.attention(*args), want, torch.float32)


@pytest.mark.parametrize("wide", ["kv", "gate"])
def test_compress_rows_past_int32_offsets(wide):
    """The compressor's window rows (kv, gate) at offsets past 2^31 elements."""
    kv, gate = randn(1, 3, 4, 16, seed=1), randn(1, 3, 4, 16, seed=2)
    angles = randn(1, 3, 4, seed=3)
    args = [kv, gate, 1 + 0.2 * randn(16, seed=4), 1e-6, angles.cos(), angles.sin()]
    want = reference.compress_rows(*args)
    args[["kv", "gate"].index(wide)] = spread(args[["kv", "gate"].index(wide)], 1)
    assert_close(tk.compress_rows(*args), want, torch.float32)


@pytest.mark.parametrize("wide", ["q", "weights", "rows"])
def test_indexer_rows_past_int32_offsets(wide):
    """The indexer's query, head-weight and cache rows at offsets past 2^31 elements."""
    names = ["q", "weights", "rows", "start", "rate", "k"]
    args = list(indexer_inputs(1, 3, 8, 16, 3, 1, [2], 3, torch.float32))
    want = reference.indexer_topk(*args)
    assert (want >= 0).all()  # every row visible and ranked
    args[names.index(wide)] = spread(args[names.index(wide)], 1)
    assert tk.indexer_topk(*args).tolist() == want.tolist()


# --------------------------------------------------------------------------- paged rows
def paged_rows(tables, per_block, C, D, seed, dtype=torch.float32):
    """A pool and slots [B, C+1] as `PagedDS4Cache` lays them out for block tables `tables` (each
    sequence's pool blocks, in order): row w of sequence b at pool row tables[b][w // per_block] *
    per_block + w % per_block; every row past a sequence's blocks (and column C) at the scratch
    row, the pool's last, which holds 1e3: read for a visible row, it would swamp the result. One
    block is held by no table (stale rows)."""
    blocks = max(max(t) for t in tables) + 2
    pool = randn(blocks * per_block + 1, D, seed=seed, dtype=dtype)
    scratch = pool.shape[0] - 1
    pool[scratch] = 1e3
    slots = torch.full((len(tables), C + 1), scratch, dtype=torch.int64)
    for b, table in enumerate(tables):
        for w in range(min(C, len(table) * per_block)):
            slots[b, w] = table[w // per_block] * per_block + w % per_block
    return pool, slots


# Three sequences, 3 rows a block (rows cross block boundaries), blocks in no particular order;
# sequences 0 and 1 share their first block (a shared prefix); 1 and 2 hold fewer rows than the
# capacity C = 10, so their last slots point at the scratch row; starts keep every visible row
# inside a sequence's blocks, as a cache does.
PAGED_TABLES, PAGED_PER_BLOCK = [[4, 0, 2, 6], [4, 1], [3]], 3
# (name, T, starts, K or None for HCA)
PAGED_CASES = [
    ("decode_hca", 1, [19, 11, 5], None),
    ("decode_csa", 1, [19, 11, 5], 4),
    ("prefill_hca", 3, [15, 8, 2], None),
    ("prefill_csa", 3, [15, 8, 2], 4),
]


def paged_attention_inputs(T, starts, K, dtype, seed=0):
    B, H, D, W, C, rate = len(PAGED_TABLES), 2, 16, 4, 10, 2
    q, ring, chunk, start, _, sel, rate, sinks, scale = attention_inputs(B, T, H, D, W, C, rate, starts, K, dtype,
                                                                        seed)
    pool, slots = paged_rows(PAGED_TABLES, PAGED_PER_BLOCK, C, D, seed + 7, dtype)
    assert ((start + T) // rate <= torch.tensor([len(t) * PAGED_PER_BLOCK for t in PAGED_TABLES])).all()
    # the slots as the model passes them: the first C columns of the cache's [B, C+1] (a strided view)
    return (q, ring, chunk, start, pool, sel, rate, sinks, scale), slots[:, :C]


@pytest.mark.parametrize("case,dtype", [(c, torch.float32) for c in PAGED_CASES] + [(PAGED_CASES[3], torch.bfloat16)],
                         ids=lambda x: x[0] if isinstance(x, tuple) else str(x))
def test_attention_reads_paged_rows_in_place(case, dtype):
    """The pool read through the slots gives what the same rows gathered into dense rows give:
    the reference bit for bit, the Triton kernel within tolerance of the fp32 reference and bit
    for bit its own dense answer (the same keys in the same order)."""
    _, T, starts, K = case
    (q, ring, chunk, start, pool, sel, rate, sinks, scale), slots = paged_attention_inputs(T, starts, K, dtype)
    dense = reference.gather_rows(pool, slots)
    dense_args = (q, ring, chunk, start, dense, sel, rate, sinks, scale)
    want = reference.attention(*dense_args)
    assert torch.equal(reference.attention(*dense_args[:4], pool, *dense_args[5:], slots), want)
    got = tk.attention(*dense_args[:4], pool, *dense_args[5:], slots)
    assert_close(got, reference.attention(*upcast(dense_args)), dtype)
    assert torch.equal(got, tk.attention(*dense_args))


@pytest.mark.parametrize("T,starts", [(1, [19, 11, 5]), (3, [15, 8, 2])], ids=["decode", "prefill"])
def test_indexer_topk_reads_paged_rows_in_place(T, starts):
    """The CSA indexer's top-k over a paged pool picks what it picks over the gathered rows."""
    B, C, dI, rate, k = len(PAGED_TABLES), 10, 16, 2, 4
    q, weights, _, start, _, _ = indexer_inputs(B, T, 8, dI, C, rate, starts, k, torch.float32)
    pool, slots = paged_rows(PAGED_TABLES, PAGED_PER_BLOCK, C, dI, seed=9)
    slots = slots[:, :C]
    want = reference.indexer_topk(q, weights, reference.gather_rows(pool, slots), start, rate, k)
    assert (want[:, -1, 0] >= 0).all()  # every sequence sees rows
    assert torch.equal(reference.indexer_topk(q, weights, pool, start, rate, k, slots), want)
    assert tk.indexer_topk(q, weights, pool, start, rate, k, slots).tolist() == want.tolist()


def test_paged_pool_rows_past_int32_offsets():
    """Pool rows at offsets past 2^31 elements (a pool of more than 2^31 / D rows): the
    attention (HCA and CSA) and the indexer read them through the int64 variant."""
    (q, ring, chunk, start, _, sel, rate, sinks, scale) = attention_inputs(1, 2, 2, 16, 3, 3, 1, [4], 2,
                                                                           torch.float32)
    pool, slots = paged_rows([[1, 0]], 2, 3, 16, seed=3)  # rows 0, 1 in pool rows 2, 3; row 2 in 0
    slots = slots[:, :3]
    dense = reference.gather_rows(pool, slots)
    wide = spread(pool, 0)
    for s in (None, sel):
        want = reference.attention(q, ring, chunk, start, dense, s, rate, sinks, scale)
        assert_close(tk.attention(q, ring, chunk, start, wide, s, rate, sinks, scale, slots), want, torch.float32)
    qi, weights, _, start, rate, k = indexer_inputs(1, 3, 8, 16, 3, 1, [2], 3, torch.float32)
    want = reference.indexer_topk(qi, weights, dense, start, rate, k)
    assert tk.indexer_topk(qi, weights, wide, start, rate, k, slots).tolist() == want.tolist()


# --------------------------------------------------------------------------- custom ops
def small_opcheck_inputs():
    attn_hca = attention_inputs(1, 2, 2, 16, 4, 6, 2, [5], None, torch.float32)
    attn_csa = attention_inputs(2, 1, 2, 16, 4, 6, 2, [3, 9], 2, torch.float32)
    kv, gate = randn(1, 2, 4, 16, seed=1), randn(1, 2, 4, 16, seed=2)
    angles = randn(1, 2, 4, seed=3)
    compress = (kv, gate, torch.ones(16), 1e-6, angles.cos(), angles.sin())
    indexer = indexer_inputs(1, 2, 8, 16, 7, 2, [6], 3, torch.float32)
    return {"attention": [attn_hca, attn_csa], "compress_rows": [compress], "indexer_topk": [indexer]}


@pytest.mark.parametrize("name", ["attention", "compress_rows", "indexer_topk"])
@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_custom_ops_pass_opcheck(name, backend):
    op = getattr(torch.ops.ds4, name).default
    for args in small_opcheck_inputs()[name]:
        torch.library.opcheck(op, (*args, backend))


def paged_opcheck_inputs():
    """(op name, args, kwargs) of the ops over a paged pool: CSA attention, HCA attention, top-k."""
    args, slots = paged_attention_inputs(1, [19, 11, 5], 4, torch.float32)
    hca = (*args[:5], None, *args[6:])
    q, weights, _, start, rate, k = indexer_inputs(3, 1, 8, 16, 10, 2, [19, 11, 5], 4, torch.float32)
    pool, rows_slots = paged_rows(PAGED_TABLES, PAGED_PER_BLOCK, 10, 16, seed=9)
    return [("attention", args, {"comp_slots": slots}), ("attention", hca, {"comp_slots": slots}),
            ("indexer_topk", (q, weights, pool, start, rate, k), {"rows_slots": rows_slots[:, :10]})]


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_paged_ops_pass_opcheck(backend):
    for name, args, kwargs in paged_opcheck_inputs():
        torch.library.opcheck(getattr(torch.ops.ds4, name).default, (*args, backend), kwargs)


def test_paged_ops_compile_fullgraph():
    """torch.compile(fullgraph=True) of the top-k then the attention over a paged pool (the
    fakes give the shapes: C from the slots, not the pool): one graph, the eager answer."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    (_, args, kwargs), _, (_, topk_args, topk_kwargs) = paged_opcheck_inputs()
    ops = attention_ops("triton")

    def step(attn_args, comp_slots, topk_args, rows_slots):
        sel = ops.indexer_topk(*topk_args, rows_slots=rows_slots)
        return ops.attention(*attn_args[:5], sel, *attn_args[6:], comp_slots=comp_slots)

    inputs = (args, kwargs["comp_slots"], topk_args, topk_kwargs["rows_slots"])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*inputs), step(*inputs))
    assert not counters["graph_break"]


def test_one_op_per_function_with_a_cuda_kernel():
    """Each function is one op: CUDA has its own registered kernel (Triton); CPU and MPS take the
    default (the reference), and tracing the fake."""
    for name in ("attention", "compress_rows", "indexer_topk"):
        op = getattr(torch.ops.ds4, name).default
        for key in ("CUDA", "CompositeExplicitAutograd", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), (name, key)
    assert not any(n.endswith("_triton") for n in dir(torch.ops.ds4))


@pytest.mark.parametrize("name", ["attention", "compress_rows", "indexer_topk"])
def test_backend_bundles_agree(name):
    for args in small_opcheck_inputs()[name]:
        a = getattr(attention_ops("torch"), name)(*args)
        b = getattr(attention_ops("triton"), name)(*args)
        if a.is_floating_point():
            assert_close(b, a, torch.float32)
        else:
            assert torch.equal(a, b)


def test_custom_ops_trace_as_single_nodes():
    from torch.fx.experimental.proxy_tensor import make_fx

    args = small_opcheck_inputs()["attention"][1]
    graph = make_fx(attention_ops("triton").attention, tracing_mode="fake")(*args)
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.ds4.attention.default]


# --------------------------------------------------------------------------- backends
def test_kernel_for(monkeypatch):
    from ds4_torch.kernels import backend_name

    monkeypatch.delenv("DS4_TORCH_ATTN_BACKEND", raising=False)
    assert kernel_for("auto", "cpu") == "torch"
    assert kernel_for("auto", "mps") == "torch"
    assert kernel_for("auto", "cuda") == "triton"
    assert kernel_for("torch", "cuda") == "torch"
    assert kernel_for("triton", torch.device("cpu")) == "triton"  # TRITON_INTERPRET=1 here
    with pytest.raises(ValueError, match="mps"):
        kernel_for("triton", "mps")
    with pytest.raises(ValueError, match="auto, torch, triton"):
        backend_name("flash")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA GPU, or TRITON_INTERPRET=1"):
        kernel_for("triton", "cpu")
    monkeypatch.setenv("DS4_TORCH_ATTN_BACKEND", "torch")  # the environment overrides the argument
    assert backend_name("triton") == "torch"


def test_forced_backend_the_device_cannot_run_is_a_clear_error(monkeypatch):
    """A model told to use Triton on a CPU without the interpreter fails before computing."""
    import copy

    from ds4_torch import DS4Config, DS4ForCausalLM

    monkeypatch.delenv("DS4_TORCH_ATTN_BACKEND", raising=False)
    model = DS4ForCausalLM(DS4Config.from_dict(copy.deepcopy(MODEL_CONFIG)), attn_backend="triton").eval()
    assert model.attn_backend == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        model(torch.zeros(1, 2, dtype=torch.long))
    model.attn_backend = "auto"  # switching needs no rebuild
    assert model(torch.zeros(1, 2, dtype=torch.long)).shape == (1, 2, 64)
    model.attn_backend = "torch"  # the MoE op follows the same choice
    assert {layer.mlp.experts.backend for layer in model.model.layers} == {"torch"}


# --------------------------------------------------------------------------- whole model
MODEL_CONFIG = dict(
    vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
    head_dim=16, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=5,
    layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 3},
    mlp_layer_types=["hash_moe", "moe", "moe"], index_n_heads=8, index_head_dim=8, index_topk=3,
    n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=5,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 128},
)


@torch.no_grad()
def test_model_triton_backend_equals_torch():
    """Chunked prefill of two staggered prompts, then 18 batched decode steps (three ring wraps of
    the 5-token window, every emit phase of rates 2 and 3, the indexer choosing 3 of up to 15 CSA
    rows): the triton backend's logits match the torch backend's."""
    import copy

    from ds4_torch import DS4Config, DS4ForCausalLM
    from ds4_torch.decode import prefill
    from oracle import randomise

    models = {}
    for backend in ("torch", "triton"):
        models[backend] = DS4ForCausalLM(DS4Config.from_dict(copy.deepcopy(MODEL_CONFIG)), attn_backend=backend).eval()
    randomise(models["torch"], 5)
    models["triton"].load_state_dict(models["torch"].state_dict())
    assert models["triton"].attn_backend == "triton" and models["torch"].attn_backend == "torch"

    prompt_lens, steps, chunk = (13, 6), 18, 4
    logits, caches = {}, {}
    for backend, model in models.items():
        cache, first = model.new_cache(2, 64), []
        for i, n in enumerate(prompt_lens):
            single = model.new_cache(1, 64)
            ids = torch.randint(2, 64, (1, n), generator=torch.Generator().manual_seed(n))
            first.append(prefill(model, single, ids, chunk))
            cache.copy_sequence(i, 0, single)
        logits[backend], caches[backend] = [torch.cat(first)], cache
    for _ in range(steps):  # both backends decode the torch backend's greedy tokens
        nxt = logits["torch"][-1].argmax(-1)
        for backend, model in models.items():
            logits[backend].append(model(nxt[:, None], cache=caches[backend])[:, -1])
    a, b = torch.stack(logits["torch"]), torch.stack(logits["triton"])
    assert (a - b).abs().max().item() <= 1e-4
    assert caches["torch"].positions.tolist() == [13 + steps, 6 + steps]
