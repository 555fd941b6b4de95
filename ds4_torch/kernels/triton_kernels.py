"""Triton kernels for the DS4 attention ops (same semantics as `reference.py`, the oracle).

Built for a CUDA GPU; on CPU they run under the Triton interpreter (TRITON_INTERPRET=1 must be
set before this module is imported, because `@triton.jit` reads it when the decorator runs).

Kernels and launch grids (B batch, T queries, H heads, D head dim, W window, C compressed rows,
K picks per query, L = K for CSA else C):

- `_attention_partial_kernel`, grid (B*T, cdiv(H, BLOCK_H), splits). One program = one query
  token x a block of heads x one split of that query's key list. The key list of query t is
      n in [0, W):      window position p = t-W+1+n (p >= 0), read from ring slot p % W when
                        p < start, else from chunk row p - start (the chunk's own rows);
      n in [W, W+L):    compressed entry n-W: row n-W (HCA) or row comp_sel[n-W] (CSA),
                        visible iff row < (t+1)//rate; read from comp[b, row], or, paged
                        (PAGED), from pool row comp_slots[b, row] (one int64 load per key).
  All heads share the keys (one KV head, K == V), so heads are the M side of `tl.dot`. Each
  split runs one online softmax (exp2 domain) over its contiguous range of key blocks and
  writes a partial output plus its log-sum-exp (flash-decoding). T == 1 is decode, T > 1 is
  prefill: the same kernel, because the key list above is already per query (a CSA query has
  its own selection, so queries cannot share compressed tiles anyway).
  Batch invariance: where a query's splits begin is a function of that query alone (its own
  key count n_keys and the forward's T): each split takes bps = max(MIN_BLOCKS_PER_SPLIT,
  cdiv(cdiv(n_keys, BLOCK_N), max_splits)) key blocks, max_splits = `attention_max_splits(T)`;
  splits past its keys are empty. So the same query gives the same bits alone and beside any
  other rows (whose positions and capacities only change how many empty splits the launch has).
  Launch sizes depend only on capacities (W, C or K, B, T, H), never on positions: `start` is
  read inside the kernel, visibility is a mask, and HCA stops at the last visible row with a
  device-side bound. The same launch is valid at every decode step (CUDA-graph friendly).
- `_attention_merge_kernel`, grid (B*T, H): merges the splits, in split order (an empty split
  adds an exact 0, so the count of empty ones changes no bit), and adds the per-head sink logit
  to the denominator.
- `_compress_rows_kernel`, grid (B*J,): per-channel online softmax over the S slots of `gate`,
  weights on `kv`, RMSNorm, interleaved RoPE on the last R channels, all fused. Channels are
  handled as (even, odd) pairs so RoPE needs no register shuffle.
- `_indexer_keys_kernel`, grid (B*T, cdiv(C, BLOCK_C)): fp32 scores over all rows (paged: row
  w read from pool row rows_slots[b, w]; rows past the visible count are not read), invisible
  rows -inf, each packed into a unique int64 sort key (order-preserving score bits << 32 |
  (2^31-1 - row)). The top-k itself is `torch.topk` on those keys: keys are unique, so the
  result is deterministic and a tie in score goes to the lower row index (the reference rule).
- `_sinkhorn_kernel`, grid (cdiv(N, BLOCK_M),): BLOCK_M of the N mHC matrices (n x n, fp32) per
  program, held in registers for the whole Sinkhorn loop (`sinkhorn.py`); one launch instead of
  2 * iters - 1 normalisations of two ops each.

Numerics: every load is converted right away to the compute dtype (fp32 under the interpreter,
whose bf16 arithmetic on raw loads is garbage; the input dtype on a GPU so `tl.dot` runs on
tensor cores). Softmaxes, norms and scores accumulate in fp32; fp32 dots are "ieee" (no TF32).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------- attention
@triton.jit
def _attention_partial_kernel(
    q_ptr, ring_ptr, chunk_ptr, start_ptr, comp_ptr, sel_ptr, slots_ptr, o_ptr, lse_ptr,
    T, H, D, W, C, L, rate, scale_log2e, max_splits,
    s_qb, s_qt, s_qh,  # q [B, T, H, D]
    s_rb, s_rw,  # ring [B, W, D]
    s_cb, s_ct,  # chunk_kv [B, T, D]
    s_kb, s_kc,  # comp [B, C, D] (paged: the pool [P, D], s_kb = 0)
    s_sb, s_st, s_sk,  # comp_sel [B, T, K]
    s_pb, s_pw,  # comp_slots [B, C] (paged only)
    s_os, s_oh,  # partial o [B*T, S, H, D] (query stride = S * s_os)
    HAS_SEL: tl.constexpr, PAGED: tl.constexpr, COMPUTE: tl.constexpr, KEY_OFFSET: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MIN_BLOCKS: tl.constexpr,
):
    pid_q, pid_h, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_splits = tl.num_programs(2)
    b, i = pid_q // T, pid_q % T
    # Row offsets in int64: query row i times its stride passes 2^31 at V4-Flash sizes (64 heads x
    # 512 = 32768 per row: from row 65,536 of one forward). The key rows' offsets are vectors: int64
    # (KEY_OFFSET) only when the launcher sees one pass 2^31, as int64 costs registers (fp32 spills).
    b64, i64 = b.to(tl.int64), i.to(tl.int64)
    start = tl.load(start_ptr + b).to(tl.int32)
    t = start + i  # this query's position

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    hmask, dmask = heads < H, dims < D
    q = tl.load(q_ptr + b64 * s_qb + i64 * s_qt + heads[:, None] * s_qh + dims[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0).to(COMPUTE)

    n_visible = (t + 1) // rate  # compressed rows complete before t
    if HAS_SEL:
        n_keys = W + L  # every listed entry may be visible: mask them one by one
    else:
        n_keys = W + tl.minimum(L, n_visible)  # HCA: rows past the visible count are never read
    # This query's own split of its keys (see the module docstring): nothing of the batch.
    blocks_per_split = tl.maximum(MIN_BLOCKS, tl.cdiv(tl.cdiv(n_keys, BLOCK_N), max_splits))
    lo = pid_s * blocks_per_split * BLOCK_N
    hi = tl.minimum(lo + blocks_per_split * BLOCK_N, n_keys)

    # Finite start for the running max, so a split whose keys are all masked stays NaN-free.
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        # Window keys: positions t-W+1 .. t, from the ring (before start) or the chunk.
        in_window = n < W
        p = t - W + 1 + n
        from_ring = p < start
        slot = tl.where(p >= 0, p, 0) % W
        row_ring = ring_ptr + b64 * s_rb + slot.to(KEY_OFFSET) * s_rw
        row_chunk = chunk_ptr + b64 * s_cb + (p - start).to(KEY_OFFSET) * s_ct
        # Compressed keys: entry e of this query's list.
        e = n - W
        in_comp = (n >= W) & (n < hi)
        if HAS_SEL:
            row = tl.load(sel_ptr + b64 * s_sb + i64 * s_st + e.to(KEY_OFFSET) * s_sk, mask=in_comp,
                          other=-1).to(tl.int32)
        else:
            row = e
        comp_ok = in_comp & (row >= 0) & (row < n_visible) & (row < C)
        row = tl.where(comp_ok, row, 0)
        if PAGED:  # the row's place in the pool; KEY_OFFSET covers every pool row's offset
            row = tl.load(slots_ptr + b64 * s_pb + row.to(KEY_OFFSET) * s_pw, mask=comp_ok, other=0)
        row_comp = comp_ptr + b64 * s_kb + row.to(KEY_OFFSET) * s_kc
        valid = (in_window & (p >= 0)) | comp_ok
        rows = tl.where(in_window, tl.where(from_ring, row_ring, row_chunk), row_comp)
        k = tl.load(rows[:, None] + dims[None, :], mask=valid[:, None] & dmask[None, :], other=0.0).to(COMPUTE)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2e  # [BLOCK_H, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(COMPUTE), k, input_precision="ieee")  # K == V
        m_i = m_new

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # log2 units
    o_base = o_ptr + (pid_q.to(tl.int64) * n_splits + pid_s) * s_os
    tl.store(o_base + heads[:, None] * s_oh + dims[None, :], o, mask=hmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + (pid_q.to(tl.int64) * n_splits + pid_s) * H + heads, lse, mask=hmask)


@triton.jit
def _attention_merge_kernel(
    o_ptr, lse_ptr, sinks_ptr, out_ptr,
    H, D, n_splits,
    s_os, s_oh,  # partial o [B*T, S, H, D]
    s_ob, s_oh_out,  # out viewed as [B*T, H, D]
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_q, h = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    smask = splits < n_splits
    lse = tl.load(lse_ptr + (pid_q.to(tl.int64) * n_splits + splits) * H + h, mask=smask, other=float("-inf"))
    sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634  # LOG2E; the sink logit is not scaled
    m = tl.maximum(tl.max(lse, axis=0), sink)  # finite: the sink always takes part (a max is exact)

    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D
    out = tl.zeros([BLOCK_D], tl.float32)
    denom = 0.0
    # One split at a time, in order (a [splits, D] tile would not fit in registers; a tree sum's
    # order would follow the launch's split count): an empty split adds exactly 0 to both sums.
    for s in range(n_splits):
        w = tl.exp2(tl.load(lse_ptr + (pid_q.to(tl.int64) * n_splits + s) * H + h) - m)
        o = tl.load(o_ptr + (pid_q.to(tl.int64) * n_splits + s) * s_os + h * s_oh + dims, mask=dmask, other=0.0)
        denom += w
        out += w * o
    out = out / (denom + tl.exp2(sink - m))
    tl.store(out_ptr + pid_q.to(tl.int64) * s_ob + h * s_oh_out + dims, out.to(out_ptr.dtype.element_ty), mask=dmask)


# --------------------------------------------------------------------------- compressor
@triton.jit
def _compress_rows_kernel(
    kv_ptr, gate_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr,
    J, S, D, R2, eps,  # R2 = rotated pairs (R/2)
    s_kb, s_kj, s_ks,  # kv [B, J, S, D]
    s_gb, s_gj, s_gs,  # gate [B, J, S, D]
    s_cb, s_cj,  # cos, sin [B, J, R/2]
    s_ob, s_oj,  # out [B, J, D]
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b, j = (pid // J).to(tl.int64), (pid % J).to(tl.int64)  # int64: j * s_kj passes 2^31 on long inputs
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D

    # Per-channel online softmax over the slots, S in tiles (HCA has 128 slots of 512 channels).
    m = tl.full([BLOCK_D], -1.0e30, tl.float32)  # finite start: -inf gates (CSA's first window) stay NaN-free
    den = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        mask = (slots < S)[:, None] & dmask[None, :]
        g = tl.load(gate_ptr + b * s_gb + j * s_gj + slots[:, None] * s_gs + dims[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32)
        x = tl.load(kv_ptr + b * s_kb + j * s_kj + slots[:, None] * s_ks + dims[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(g, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(g - m_new[None, :])
        den = den * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * x, axis=0)
        m = m_new
    pooled = tl.where(dmask, acc / tl.where(dmask, den, 1.0), 0.0)

    # RMSNorm over the D channels.
    rstd = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / D + eps)
    y = pooled * rstd * tl.load(weight_ptr + dims, mask=dmask, other=0.0).to(tl.float32)

    # Interleaved RoPE on the last R channels: pair c = (2c, 2c+1) rotates by angle c - (D/2 - R2).
    even, odd = tl.split(tl.reshape(y, [BLOCK_D // 2, 2]))
    pairs = tl.arange(0, BLOCK_D // 2)
    angle = pairs - (D // 2 - R2)
    rot = (angle >= 0) & (pairs < D // 2)
    cos = tl.load(cos_ptr + b * s_cb + j * s_cj + angle, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + b * s_cb + j * s_cj + angle, mask=rot, other=0.0).to(tl.float32)
    out = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), [BLOCK_D])
    tl.store(out_ptr + b * s_ob + j * s_oj + dims, out.to(out_ptr.dtype.element_ty), mask=dmask)


# --------------------------------------------------------------------------- indexer
@triton.jit
def _indexer_keys_kernel(
    q_ptr, hw_ptr, rows_ptr, start_ptr, slots_ptr, keys_ptr,
    T, HI, DI, C, rate, scale,
    s_qb, s_qt, s_qh,  # q [B, T, Hi, dI]
    s_wb, s_wt,  # head_weights [B, T, Hi] (head stride 1)
    s_rb, s_rc,  # rows [B, C, dI] (paged: the pool [P, dI], s_rb = 0)
    s_pb, s_pw,  # rows_slots [B, C] (paged only)
    PAGED: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_DI: tl.constexpr,
):
    pid_q, pid_c = tl.program_id(0), tl.program_id(1)
    b, i = pid_q // T, pid_q % T
    b64, i64 = b.to(tl.int64), i.to(tl.int64)  # int64 row offsets: i * s_qt passes 2^31 (see the attention)
    n_visible = (tl.load(start_ptr + b).to(tl.int32) + i + 1) // rate

    heads = tl.arange(0, BLOCK_HI)
    dims = tl.arange(0, BLOCK_DI)
    hmask, dmask = heads < HI, dims < DI
    q = tl.load(q_ptr + b64 * s_qb + i64 * s_qt + heads[:, None] * s_qh + dims[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0).to(COMPUTE)
    hw = tl.load(hw_ptr + b64 * s_wb + i64 * s_wt + heads, mask=hmask, other=0.0).to(tl.float32)

    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    read = cmask & (cols < n_visible)  # an invisible row's score is replaced below: not read
    row = cols.to(tl.int64)
    if PAGED:  # the row's place in the pool
        row = tl.load(slots_ptr + b64 * s_pb + row * s_pw, mask=read, other=0)
    rows = tl.load(rows_ptr + b64 * s_rb + row[:, None] * s_rc + dims[None, :],
                   mask=read[:, None] & dmask[None, :], other=0.0).to(COMPUTE)
    dots = tl.dot(q, tl.trans(rows), input_precision="ieee")  # [BLOCK_HI, BLOCK_C], fp32
    score = tl.sum(tl.maximum(dots, 0.0) * scale * hw[:, None], axis=0)

    # Unique sort key: order-preserving bits of the score (high word), then 2^31-1 - row (low
    # word), so a larger key is a better score and, among equal scores, a lower row.
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and +0.0 tie in the reference: one key
    score = tl.where(cols < n_visible, score, float("-inf"))
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)
    tl.store(keys_ptr + pid_q.to(tl.int64) * C + cols, key, mask=cmask)


# --------------------------------------------------------------------------- launchers
# True when the decorators above produced interpreter functions (TRITON_INTERPRET=1 at import).
INTERPRETED = not isinstance(_attention_partial_kernel, triton.runtime.JITFunction)
MIN_BLOCKS_PER_SPLIT = 2  # a split shorter than this costs more in merging than it saves
# A forward of T queries splits each query's keys into at most max(1, SPLIT_BUDGET // T) parts:
# decode (T = 1) up to 16, which fills a GPU at long context even for one sequence; a prefill
# chunk none (its many queries fill it). A function of T alone: batch invariant.
SPLIT_BUDGET = 16


def _pow2(n: int, floor: int = 16) -> int:
    """Block size for a dimension of n: a power of two, at least `floor` (tl.dot wants >= 16)."""
    return max(floor, triton.next_power_of_2(n))


def _compute_dtype(dtype: torch.dtype):
    """Dtype of dot operands: fp32 under the interpreter (its bf16 arithmetic is broken) and for
    fp32 inputs; otherwise the input dtype, so dots run on tensor cores with fp32 accumulation."""
    if INTERPRETED or dtype == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def attention_config(H: int, D: int, dtype: torch.dtype) -> dict:
    """Block sizes and warps of the partial kernel. Wide heads (D >= 256, V4-Flash has 512) take
    16-head blocks (the smallest M of a tensor-core dot) and 8 warps: 153 registers, no spills at
    sm_90 in bf16 (4 warps: 213; 64-head blocks reach wgmma but spill; see the compile report).
    fp32 inputs take half the key tile (sm_80 shared memory), 16 warps (8 spilled 4 bytes at
    sm_80) and 2 pipeline stages (3 spilled 12 bytes at sm_90 reading a paged pool; 2: at most 83
    registers in every fp32 variant, no spills)."""
    block_d = _pow2(D)
    if block_d < 256:
        return dict(BLOCK_H=min(64, _pow2(H)), BLOCK_N=16, BLOCK_D=block_d, num_warps=4)
    if dtype == torch.float32:
        return dict(BLOCK_H=16, BLOCK_N=16, BLOCK_D=block_d, num_warps=16, num_stages=2)
    return dict(BLOCK_H=16, BLOCK_N=32, BLOCK_D=block_d, num_warps=8)


def attention_max_splits(T: int) -> int:
    """The most parts a query of a forward of T queries splits its keys into."""
    return max(1, SPLIT_BUDGET // T)


def attention_num_splits(max_splits: int, key_blocks: int) -> int:
    """The launch's splits for queries of at most `key_blocks` key blocks (the capacity), each
    split at most `max_splits` ways: the most any of them uses (each query's own split is
    computed in the kernel, see the module docstring). Depends on capacities only (CUDA-graph
    safe)."""
    return max(1, min(max_splits, triton.cdiv(key_blocks, MIN_BLOCKS_PER_SPLIT)))


def attention(q, ring, chunk_kv, start, comp, comp_sel, rate: int, sinks, scale: float, comp_slots=None,
              num_splits=None):
    """Triton version of `reference.attention` (same arguments; `comp_slots`: `comp` is a paged
    pool, read in place); `num_splits` forces the most splits of a query's keys (tests)."""
    B, T, H, D = q.shape
    paged = comp_slots is not None
    W, C = ring.shape[1], (comp_slots if paged else comp).shape[1]
    # The reference brings every key to the ring's dtype first.
    ring, chunk_kv, comp = (_last_dim_contiguous(x.to(ring.dtype)) for x in (ring, chunk_kv, comp))
    q = _last_dim_contiguous(q)
    has_sel = comp_sel is not None and C > 0
    L = comp_sel.shape[2] if has_sel else C
    sel = comp_sel if has_sel else start  # never read without a selection
    sel_strides = sel.stride() if has_sel else (0, 0, 0)

    config = attention_config(H, D, q.dtype)
    head_blocks = triton.cdiv(H, config["BLOCK_H"])
    key_blocks = triton.cdiv(W + L, config["BLOCK_N"])
    max_splits = num_splits or attention_max_splits(T)
    splits = attention_num_splits(max_splits, key_blocks)

    # A pool's rows are [P, D] with no batch stride; its slots are read where the rows were.
    comp_strides = (0, comp.stride(0)) if paged else (comp.stride(0), comp.stride(1))
    comp_rows = comp.shape[0] if paged else C
    slots = comp_slots if paged else start  # never read unless paged
    slot_strides = comp_slots.stride() if paged else (0, 0)

    # int64 key-row offsets only where one can pass 2^31 (a [1M, 512] cache row stride does not)
    furthest = max((W - 1) * ring.stride(1), (T - 1) * chunk_kv.stride(1), (comp_rows - 1) * comp_strides[1],
                   (L - 1) * sel_strides[2], (C - 1) * slot_strides[1]) + D
    o = torch.empty(B * T, splits, H, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B * T, splits, H, dtype=torch.float32, device=q.device)
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    if B * T == 0:
        return out
    _attention_partial_kernel[(B * T, head_blocks, splits)](
        q, ring, chunk_kv, start, comp, sel, slots, o, lse,
        T, H, D, W, C, L, max(rate, 1), scale * LOG2E, max_splits,
        q.stride(0), q.stride(1), q.stride(2),
        ring.stride(0), ring.stride(1),
        chunk_kv.stride(0), chunk_kv.stride(1),
        *comp_strides,
        *sel_strides,
        *slot_strides,
        o.stride(1), o.stride(2),
        HAS_SEL=has_sel, PAGED=paged, COMPUTE=_compute_dtype(q.dtype), KEY_OFFSET=tl.int64 if furthest >= 2 ** 31 else tl.int32,
        MIN_BLOCKS=MIN_BLOCKS_PER_SPLIT, **config,
    )
    _attention_merge_kernel[(B * T, H)](
        o, lse, sinks, out,
        H, D, splits,
        o.stride(1), o.stride(2),
        H * D, D,
        BLOCK_S=_pow2(splits, 2), BLOCK_D=config["BLOCK_D"], num_warps=4,
    )
    return out


def compress_rows(kv, gate, norm_weight, eps: float, cos, sin):
    """Triton version of `reference.compress_rows`."""
    B, J, S, D = kv.shape
    kv, gate = _last_dim_contiguous(kv), _last_dim_contiguous(gate)  # gate keeps its dtype: fp32 softmax
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(B, J, D, dtype=kv.dtype, device=kv.device)
    if B * J == 0:
        return out
    block_d = _pow2(D)
    _compress_rows_kernel[(B * J,)](
        kv, gate, norm_weight, cos, sin, out,
        J, S, D, cos.shape[-1], eps,
        kv.stride(0), kv.stride(1), kv.stride(2),
        gate.stride(0), gate.stride(1), gate.stride(2),
        cos.stride(0), cos.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_S=min(_pow2(S, 2), max(2, 4096 // block_d)), BLOCK_D=block_d, num_warps=4,
    )
    return out


def indexer_keys(q, head_weights, rows, start, rate: int, rows_slots=None):
    """[B, T, C] int64 unique sort keys (see `_indexer_keys_kernel`); `rows_slots`: `rows` is a
    paged pool, read in place."""
    B, T, HI, DI = q.shape
    paged = rows_slots is not None
    C = (rows_slots if paged else rows).shape[1]
    q, rows = _last_dim_contiguous(q), _last_dim_contiguous(rows)
    head_weights = _last_dim_contiguous(head_weights)
    keys = torch.empty(B, T, C, dtype=torch.int64, device=q.device)
    if B * T * C == 0:
        return keys
    block_c = 64
    _indexer_keys_kernel[(B * T, triton.cdiv(C, block_c))](
        q, head_weights, rows, start, rows_slots if paged else start, keys,
        T, HI, DI, C, rate, DI ** -0.5,
        q.stride(0), q.stride(1), q.stride(2),
        head_weights.stride(0), head_weights.stride(1),
        *((0, rows.stride(0)) if paged else (rows.stride(0), rows.stride(1))),
        *(rows_slots.stride() if paged else (0, 0)),
        PAGED=paged, COMPUTE=_compute_dtype(q.dtype), BLOCK_HI=_pow2(HI), BLOCK_C=block_c, BLOCK_DI=_pow2(DI), num_warps=4,
    )
    return keys


def indexer_topk(q, head_weights, rows, start, rate: int, k: int, rows_slots=None):
    """Triton version of `reference.indexer_topk`: scores and keys in Triton, then `torch.topk`
    over the unique keys (deterministic; lower index wins a tie), -1 past the visible count."""
    B, T = q.shape[:2]
    C = (rows if rows_slots is None else rows_slots).shape[1]
    k = min(k, C)
    if k == 0:
        return torch.empty(B, T, 0, dtype=torch.int64, device=q.device)
    keys = indexer_keys(q, head_weights, rows, start, rate, rows_slots)
    picks = torch.topk(keys, k, dim=-1, sorted=True).indices
    n_visible = (start[:, None] + torch.arange(T, device=q.device) + 1) // rate  # [B, T]
    return torch.where(picks < n_visible[..., None], picks, -1)


# --------------------------------------------------------------------------- mHC Sinkhorn
@triton.jit
def _sinkhorn_kernel(x_ptr, out_ptr, N, n, iters, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.arange(0, BLOCK_N)
    offs = m.to(tl.int64)[:, None, None] * (n * n) + i[None, :, None] * n + i[None, None, :]
    mask = (m[:, None, None] < N) & (i[None, :, None] < n) & (i[None, None, :] < n)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # padding is 0: it adds nothing to a sum
    x = x / (tl.sum(x, axis=1)[:, None, :] + eps)  # columns (sums over i)
    for _ in range(iters - 1):
        x = x / (tl.sum(x, axis=2)[:, :, None] + eps)  # rows (sums over j)
        x = x / (tl.sum(x, axis=1)[:, None, :] + eps)
    tl.store(out_ptr + offs, x, mask=mask)


def sinkhorn(comb, iters: int, eps: float):
    """Triton version of `sinkhorn.sinkhorn_torch` (fp32 [..., n, n])."""
    n = comb.shape[-1]
    x = comb.contiguous()
    out = torch.empty_like(x)
    N = x.numel() // (n * n) if n else 0
    if N == 0:
        return out
    block_n = triton.next_power_of_2(n)
    block_m = max(1, 256 // (block_n * block_n))  # 256 values a program: 16 matrices of 4 x 4
    _sinkhorn_kernel[(triton.cdiv(N, block_m),)](x, out, N, n, iters, eps, BLOCK_M=block_m, BLOCK_N=block_n,
                                                 num_warps=4)
    return out
