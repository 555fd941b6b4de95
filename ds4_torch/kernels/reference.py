"""Pure-torch reference implementations of the DS4 attention ops.

These define the semantics every other backend must reproduce (the Triton kernels compare
against them). They work on any device and dtype that torch supports for matmul/softmax, with
fp32 accumulation where it matters (softmaxes, indexer scores).

Shapes (B batch, T queries, H heads, D head dim, W window, C compressed rows, K picks):
- attention(q [B,T,H,D], ring [B,W,D], chunk_kv [B,T,D], start [B], comp [B,C,D], comp_sel,
  rate, sinks [H], scale) -> [B,T,H,D]. Query t = start + i sees, in one softmax with the
  per-head sink logit (which adds to the denominator only; K == V):
  - ring slot r, holding position q_r = start-1 - ((start-1-r) mod W), iff 0 <= q_r and t-W < q_r;
  - chunk row j iff j <= i and i - j < W;
  - compressed row w iff w < (t+1) // rate, and, when `comp_sel` [B,T,K] is given (CSA), only
    the rows it lists (distinct row indices; -1 entries list nothing).
- compress_rows(kv [B,J,S,D], gate [B,J,S,D], norm_weight [D], eps, cos, sin [B,J,R/2])
  -> [B,J,D]: per-channel softmax over the S slots of `gate` (fp32), weights applied to `kv`,
  then RMSNorm (weight in fp32) and interleaved RoPE on the last R channels.
- indexer_topk(q [B,T,Hi,dI], head_weights [B,T,Hi], rows [B,C,dI], start [B], rate, k)
  -> [B,T,min(k,C)] int64: the best visible rows (w < (t+1)//rate) by
  score = sum_h w_h * relu(q_h . row) * dI^-1/2 (w already carries Hi^-1/2), best first; slots
  beyond the visible count hold -1. Tie rule (shared by every backend): among equal scores the
  lower row index wins.

Paged rows (`paged.PagedDS4Cache`): `attention(..., comp_slots=)` and `indexer_topk(...,
rows_slots=)` take, instead of a sequence's own rows [B, C, D], a pool [P, D] shared by every
sequence and slots [B, C] int64: row w of sequence b is pool row slots[b, w] (`gather_rows`). Rows
no sequence holds point at a scratch row; it is never visible, so its value never counts. The
reference gathers the rows and computes as above (the Triton kernels read the pool in place).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# oneDNN's fp32 matmul: 1.2-1.5x the BLAS sgemm for the indexer's [rows, 128] x [128, 64] blocks.
from .linear import ONEDNN_LINEAR


def gather_rows(pool, slots):
    """A paged pool's rows as dense rows: [P, D] indexed by slots [B, C] -> [B, C, D] (row w of
    sequence b is pool[slots[b, w]]). What every gather of paged rows goes through (the cache's
    `CompressorState.visible` too), so a paged cache reads exactly a static cache's values.
    (`index_select`: a third of `pool[slots]`'s time on a CPU.)"""
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, pool.shape[-1])


def cast(x, dtype):
    """`x` in `dtype`, with no call when it already is: a no-op `.to()` still costs a dispatch
    (~1.5 us on a CPU), and a decode step would make hundreds."""
    return x if x.dtype == dtype else x.to(dtype)


def query_positions(start, T: int):
    return start[:, None] + torch.arange(T, device=start.device)  # [B, T]


def window_mask(start, T: int, W: int):
    """[B, T, W+T] bool: which ring slots and chunk rows each query sees: the key positions p with
    0 <= p and t-W < p <= t (ring slot r holds p = last - ((last - r) mod W), last = start-1;
    chunk row j holds start + j)."""
    query_pos = query_positions(start, T)
    last = start[:, None] - 1
    ring_pos = last - (last - torch.arange(W, device=start.device)) % W
    key_pos = torch.cat([ring_pos, query_pos], dim=1)[:, None, :]  # [B, 1, W+T]
    age = query_pos[..., None] - key_pos
    return (key_pos >= 0) & (age >= 0) & (age < W)


def visible_rows(start, T: int, C: int, rate: int):
    """[B, T, C] bool: compressed rows complete before each query (w < (t+1)//rate)."""
    return torch.arange(C, device=start.device) < ((query_positions(start, T) + 1) // rate)[..., None]


def attention_probs(q, ring, chunk_kv, start, comp, comp_sel, rate: int, sinks, scale: float, comp_slots=None):
    """The softmax of `attention` made explicit: probabilities [B,H,T,W+T+C+1] over ring slots,
    chunk rows, compressed rows and (last) the sink; and the keys [B,W+T+C,D] they weight."""
    if comp_slots is not None:
        comp = gather_rows(comp, comp_slots)
    B, T = q.shape[:2]
    W, C = ring.shape[1], comp.shape[1]
    keys = torch.cat([ring, chunk_kv.to(ring.dtype), comp.to(ring.dtype)], dim=1).to(q.dtype)
    comp_mask = visible_rows(start, T, C, rate) if C else comp.new_zeros(B, T, 0, dtype=torch.bool)
    if comp_sel is not None and C:
        picked = torch.zeros(B, T, C + 1, dtype=torch.bool, device=q.device)
        picked.scatter_(-1, torch.where(comp_sel >= 0, comp_sel, C), True)  # -1 -> a dropped column
        comp_mask = comp_mask & picked[..., :C]
    mask = torch.cat([window_mask(start, T, W), comp_mask], dim=2)
    logits = torch.einsum("bthd,bsd->bhts", q, keys) * scale
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(B, -1, T, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    return torch.softmax(combined, dim=-1), keys


def additive_mask(mask, dtype):
    """0 where `mask` holds, -inf elsewhere: added to logits it masks them (faster than a masked
    fill with a broadcast boolean mask, and exact: x + 0 = x, x + -inf = -inf)."""
    return cast(torch.where(mask, 0.0, float("-inf")), dtype)


def attention(q, ring, chunk_kv, start, comp, comp_sel, rate: int, sinks, scale: float, comp_slots=None):
    """The softmax of `attention_probs`, computed by parts. Window: query t's keys are positions
    t-W+1 .. t, a sliding window over the ring (in position order) followed by the chunk, so each
    query scores W keys, not W+T. Compressed rows: with few indexer picks next to the rows (decode
    at long context) each query gathers its K picked rows instead of masking all C, so the cost
    grows with the window and top-k, not with the context; otherwise the rows are read in place,
    never copied. The parts meet only in the softmax. Logits are [B*T, H, keys]: every matmul is a
    plain bmm, and masks are added (-inf) by the matmul itself where the layout allows.
    Compressed rows a sequence does not see are zeroed before either matmul: such a row may be
    another sequence's (a pool's stale or scratch row) and hold NaN or inf, which a -inf mask
    (NaN + -inf) or a zero probability (0 x inf) would carry into this sequence's output.
    `comp_slots`: `comp` is a paged pool (see the module docstring): the picked rows, or all
    rows, gathered from it."""
    B, T, H, D = q.shape
    W, C = ring.shape[1], (comp if comp_slots is None else comp_slots).shape[1]
    dtype = q.dtype
    queries = q.reshape(B * T, H, D)
    query_pos = query_positions(start, T)
    steps = torch.arange(W, device=q.device)
    ring_order = ((start[:, None] + steps) % W)[..., None].expand(-1, -1, D)  # slots of start-W .. start-1
    ordered = cast(torch.cat([ring.gather(1, ring_order), cast(chunk_kv, ring.dtype)], dim=1), dtype)  # [B, W+T, D]
    window = ordered.unfold(1, W, 1)[:, 1:].transpose(-1, -2).reshape(B * T, W, D)  # query i: rows i+1 .. i+W
    window_bias = additive_mask(query_pos[..., None] - (W - 1) + steps >= 0, dtype).view(B * T, 1, W)
    window_logits = torch.baddbmm(window_bias, queries, window.transpose(1, 2), alpha=scale)

    picked = comp_sel is not None and C and T * comp_sel.shape[-1] < C
    n_visible = ((query_pos + 1) // rate)[..., None] if C else None  # [B, T, 1]
    if picked:
        K = comp_sel.shape[-1]
        if comp_slots is None:
            rows = comp.gather(1, comp_sel.clamp(min=0).reshape(B, T * K, 1).expand(-1, -1, D))
        else:  # straight from the pool: the picked rows only
            rows = gather_rows(comp, comp_slots.gather(1, comp_sel.clamp(min=0).reshape(B, T * K)))
        seen = ((comp_sel >= 0) & (comp_sel < n_visible)).view(B * T, K, 1)
        rows = torch.where(seen, cast(cast(rows, ring.dtype), dtype).view(B * T, K, D), 0)  # (why: below)
        comp_logits = torch.baddbmm(additive_mask(seen, dtype).view(B * T, 1, K), queries, rows.transpose(1, 2),
                                    alpha=scale)
    else:
        if comp_slots is not None:
            comp = gather_rows(comp, comp_slots)
        rows = cast(cast(comp, ring.dtype), dtype)  # [B, C, D]
        if C:  # (why: below) the rows no query of the sequence sees
            rows = torch.where((torch.arange(C, device=q.device) < n_visible[:, -1]).view(B, C, 1), rows, 0)
        visible = torch.arange(C, device=q.device) < n_visible if C else q.new_zeros(B, T, 0, dtype=torch.bool)
        if comp_sel is not None and C:
            chosen = torch.zeros(B, T, C + 1, dtype=torch.bool, device=q.device)
            chosen.scatter_(-1, torch.where(comp_sel >= 0, comp_sel, C), True)  # -1 -> a dropped column
            visible = visible & chosen[..., :C]
        comp_logits = torch.bmm(q.reshape(B, T * H, D), rows.transpose(1, 2)).view(B, T, H, C) * scale
        comp_logits = (comp_logits + additive_mask(visible, dtype)[:, :, None]).view(B * T, H, C)
    L = comp_logits.shape[-1]
    sink = cast(sinks, dtype).view(1, H, 1).expand(B * T, H, 1)
    combined = torch.cat([window_logits, comp_logits, sink], dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)
    out = torch.bmm(probs[..., :W], window)
    if picked:
        out = out + torch.bmm(probs[..., W:W + L], rows)
    else:
        out = out + torch.bmm(probs[..., W:W + L].reshape(B, T * H, L), rows).view(B * T, H, D)
    return out.view(B, T, H, D)


def rms_norm(x, weight, eps: float):
    """RMSNorm computed in fp32 with an fp32 weight, cast back to x's dtype (transformers' order:
    x * rsqrt(mean(x^2) + eps), then the weight)."""
    return cast(F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps), x.dtype)


def rope_tables(cos, sin):
    """What `rotate` multiplies by, from the angles' cos/sin [..., R/2] (one per channel pair):
    cos [..., R/2, 1] and (-sin, +sin) [..., R/2, 2]. Built once, they serve every rotation at
    those positions (a forward's queries, keys and outputs)."""
    return cos.unsqueeze(-1), torch.stack((-sin, sin), dim=-1)


def rotate(x, tables):
    """Interleaved RoPE on the trailing R channels of x [..., S, (H,) D] with `rope_tables` of
    the S positions: pair (e, o) -> (e cos - o sin, o cos + e sin), in fp32; the first D - R
    channels pass through."""
    c, s = tables
    R = 2 * c.shape[-2]
    pairs = x[..., -R:].float().unflatten(-1, (-1, 2))
    if pairs.dim() == c.dim() + 1:  # a heads axis sits between positions and channels
        c, s = c.unsqueeze(-3), s.unsqueeze(-3)
    rotated = torch.addcmul(pairs * c, pairs.flip(-1), s).flatten(-2)
    return torch.cat([x[..., :-R], cast(rotated, x.dtype)], dim=-1)


def apply_rope(x, cos, sin):
    """Rotate interleaved pairs of the trailing channels of x [..., S, (H,) D]; cos/sin
    [..., S, R/2] give the angle of each pair; the first D - R channels pass through."""
    return rotate(x, rope_tables(cos, sin))


def compress_rows(kv, gate, norm_weight, eps: float, cos, sin):
    weights = cast(torch.softmax(gate, dim=-2, dtype=torch.float32), kv.dtype)
    pooled = (kv * weights).sum(dim=-2)
    return apply_rope(rms_norm(pooled, norm_weight, eps), cos, sin)


# Rows of compressed keys scored per block: the block's [rows, queries x heads] fp32 scores (1 MiB)
# stay in cache between the matmul, the relu and the head-weighted sum.
SCORE_BLOCK_BYTES = 1 << 20
def _relu_dots(rows, queries):
    """relu(rows . queries) in fp32: [B, c, dI] x [B, Q, dI] -> [B, c, Q]; big blocks through
    oneDNN with the relu fused (small ones: its call costs more than the BLAS one)."""
    if (ONEDNN_LINEAR is not None and rows.device.type == "cpu" and not torch.is_grad_enabled()
            and rows.shape[1] * queries.shape[1] >= 1 << 16):
        dots = [ONEDNN_LINEAR(r, qb, None, "relu", [], "") for r, qb in zip(rows, queries)]
        return dots[0][None] if len(dots) == 1 else torch.stack(dots)
    return torch.bmm(rows, queries.transpose(1, 2)).relu_()


def indexer_scores(q, head_weights, rows):
    """[B, T, C] fp32: sum_h head_weights_h * relu(q_h . row) * dI^-1/2, over blocks of rows.
    Each block of rows is read once in its own dtype (bf16 rows: converted a block at a time,
    never all at once) and computed in fp32."""
    B, T, Hi, dI = q.shape
    C = rows.shape[1]
    fp32 = torch.float32
    queries = cast(q, fp32).reshape(B, T * Hi, dI)
    weights = cast(head_weights, fp32)  # [B, T, Hi]
    block = max(64, SCORE_BLOCK_BYTES // (4 * T * Hi))
    parts = []
    for c0 in range(0, C, block):
        block_rows = rows if C <= block else rows[:, c0:c0 + block]
        dots = _relu_dots(cast(block_rows, fp32), queries)  # [B, c, T*Hi]
        parts.append(torch.einsum("bcth,bth->btc", dots.view(B, -1, T, Hi), weights))
    if not parts:
        return q.new_zeros(B, T, 0, dtype=fp32)
    scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return scores * dI ** -0.5


def topk_lower_index_wins(scores, k: int):
    """Indices of the k largest fp32 scores along the last dim, best first; among equal scores
    the lower index wins (the rule every backend shares). Each score becomes a unique int64 key,
    order-preserving score bits above (2^31-1 - index), so one partial selection (`topk`), not a
    sort of every score, decides, and decides the same on every run."""
    index = torch.arange(scores.shape[-1], device=scores.device)
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 and +0.0 tie
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    keys = ordered * (1 << 32) + (0x7FFFFFFF - index)
    return keys.topk(k, dim=-1, sorted=True).indices


def indexer_topk(q, head_weights, rows, start, rate: int, k: int, rows_slots=None):
    if rows_slots is not None:  # a paged pool (see the module docstring)
        rows = gather_rows(rows, rows_slots)
    T, C = q.shape[1], rows.shape[1]
    n_visible = ((query_positions(start, T) + 1) // rate)[..., None]  # [B, T, 1]
    visible = torch.arange(C, device=q.device) < n_visible
    scores = torch.where(visible, indexer_scores(q, head_weights, rows), float("-inf"))
    picks = topk_lower_index_wins(scores, min(k, C))
    return torch.where(picks < n_visible, picks, -1)  # rows 0 .. n_visible-1 are the visible ones
