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
"""

from __future__ import annotations

import torch


def query_positions(start, T: int):
    return start[:, None] + torch.arange(T, device=start.device)  # [B, T]


def window_mask(start, T: int, W: int):
    """[B, T, W+T] bool: which ring slots and chunk rows each query sees."""
    steps = torch.arange(T, device=start.device)
    query_pos = query_positions(start, T)
    last = start[:, None] - 1
    ring_pos = last - (last - torch.arange(W, device=start.device)) % W  # position held by each slot
    ring = (ring_pos[:, None, :] >= 0) & (ring_pos[:, None, :] > query_pos[..., None] - W)
    chunk = (steps[None, :] <= steps[:, None]) & (steps[:, None] - steps[None, :] < W)
    return torch.cat([ring, chunk.expand(start.shape[0], T, T)], dim=2)


def visible_rows(start, T: int, C: int, rate: int):
    """[B, T, C] bool: compressed rows complete before each query (w < (t+1)//rate)."""
    return torch.arange(C, device=start.device) < ((query_positions(start, T) + 1) // rate)[..., None]


def attention_probs(q, ring, chunk_kv, start, comp, comp_sel, rate: int, sinks, scale: float):
    """The softmax of `attention` made explicit: probabilities [B,H,T,W+T+C+1] over ring slots,
    chunk rows, compressed rows and (last) the sink; and the keys [B,W+T+C,D] they weight."""
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


def attention(q, ring, chunk_kv, start, comp, comp_sel, rate: int, sinks, scale: float):
    T, C = q.shape[1], comp.shape[1]
    if comp_sel is not None and T * comp_sel.shape[-1] < C:
        return _attention_picked(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale)
    probs, keys = attention_probs(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale)
    return torch.einsum("bhts,bsd->bthd", probs[..., :-1].to(keys.dtype), keys)


def _attention_picked(q, ring, chunk_kv, start, comp, comp_sel, rate: int, sinks, scale: float):
    """The same softmax when the indexer's picks are few next to the compressed rows (decode at long
    context): gather the K picked rows per query instead of masking all C, so the cost grows with
    the window and top-k, not with the context."""
    B, T, H, D = q.shape
    K = comp_sel.shape[-1]
    window_keys = torch.cat([ring, chunk_kv.to(ring.dtype)], dim=1).to(q.dtype)  # [B, W+T, D]
    window_logits = torch.einsum("bthd,bsd->bhts", q, window_keys) * scale
    window_logits = window_logits.masked_fill(~window_mask(start, T, ring.shape[1])[:, None], float("-inf"))
    rows = comp.gather(1, comp_sel.clamp(min=0).reshape(B, T * K, 1).expand(-1, -1, D)).view(B, T, K, D)
    rows = rows.to(q.dtype)
    visible = (comp_sel >= 0) & (comp_sel < ((query_positions(start, T) + 1) // rate)[..., None])
    picked_logits = torch.einsum("bthd,btkd->bhtk", q, rows) * scale
    picked_logits = picked_logits.masked_fill(~visible[:, None], float("-inf"))
    sink = sinks.to(q.dtype).view(1, -1, 1, 1).expand(B, -1, T, 1)
    combined = torch.cat([window_logits, picked_logits, sink], dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)
    S = window_keys.shape[1]
    return (torch.einsum("bhts,bsd->bthd", probs[..., :S], window_keys)
            + torch.einsum("bhtk,btkd->bthd", probs[..., S:S + K], rows))


def rms_norm(x, weight, eps: float):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def apply_rope(x, cos, sin):
    """Rotate interleaved pairs of the trailing channels of x [..., S, (H,) D]; cos/sin
    [..., S, R/2] give the angle of each pair; the first D - R channels pass through."""
    if x.dim() == cos.dim() + 1:  # a heads axis sits between positions and channels
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated_half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def compress_rows(kv, gate, norm_weight, eps: float, cos, sin):
    weights = torch.softmax(gate, dim=-2, dtype=torch.float32).to(kv.dtype)
    pooled = (kv * weights).sum(dim=-2)
    return apply_rope(rms_norm(pooled, norm_weight, eps), cos, sin)


def indexer_scores(q, head_weights, rows):
    scores = torch.einsum("bthd,bcd->bthc", q.float(), rows.float())
    scores = torch.relu(scores) * q.shape[-1] ** -0.5
    return (scores * head_weights.float().unsqueeze(-1)).sum(dim=2)  # [B, T, C]


def indexer_topk(q, head_weights, rows, start, rate: int, k: int):
    T, C = q.shape[1], rows.shape[1]
    visible = visible_rows(start, T, C, rate)
    scores = indexer_scores(q, head_weights, rows).masked_fill(~visible, float("-inf"))
    k = min(k, C)
    # A stable descending sort keeps equal scores in index order: the lower index wins a tie.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.where(visible.gather(-1, order), order, -1)
