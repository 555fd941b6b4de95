"""Pure-torch reference implementations of the DS4 attention ops.

These define the semantics every other backend must reproduce (the Triton kernels compare
against them). They work on any device and dtype that torch supports for matmul/softmax, with
fp32 accumulation where it matters (softmaxes, indexer scores).

Shapes (B batch, T queries, H heads, D head dim, S window keys, C compressed rows):
- attention: q [B,T,H,D], window_kv [B,S,D], window_mask [B,T,S] bool, comp_kv [B,C,D],
  comp_mask [B,T,C] bool, sinks [H] -> [B,T,H,D]. One softmax over the window keys, the
  compressed keys and the per-head sink logit (the sink adds to the denominator only). K == V.
- compress_pool: kv [..., S, D], gate [..., S, D] -> [..., D]: per-channel softmax over the S
  slots of `gate`, weights applied to `kv`.
- indexer_select: q [B,T,Hi,dI], head_weights [B,T,Hi], rows [B,C,dI], visible [B,T,C],
  k -> selected [B,T,C] bool: the k best visible rows by score
  sum_h w_h * relu(q_h . row) * dI^-1/2 (w already carries Hi^-1/2).
  Tie rule (shared by every backend): among equal scores the lower row index wins.
"""

from __future__ import annotations

import torch


def attention(q, window_kv, window_mask, comp_kv, comp_mask, sinks, scale: float):
    keys = torch.cat([window_kv, comp_kv], dim=1)  # [B, S+C, D]; K == V
    mask = torch.cat([window_mask, comp_mask], dim=2)  # [B, T, S+C]
    logits = torch.einsum("bthd,bsd->bhts", q, keys) * scale
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(logits.shape[0], -1, logits.shape[2], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("bhts,bsd->bthd", probs.to(keys.dtype), keys)


def compress_pool(kv, gate):
    weights = torch.softmax(gate, dim=-2, dtype=torch.float32).to(kv.dtype)
    return (kv * weights).sum(dim=-2)


def indexer_scores(q, head_weights, rows):
    scores = torch.einsum("bthd,bcd->bthc", q.float(), rows.float())
    scores = torch.relu(scores) * q.shape[-1] ** -0.5
    return (scores * head_weights.float().unsqueeze(-1)).sum(dim=2)  # [B, T, C]


def indexer_select(q, head_weights, rows, visible, k: int):
    scores = indexer_scores(q, head_weights, rows).masked_fill(~visible, float("-inf"))
    k = min(k, scores.shape[-1])
    # A stable descending sort keeps equal scores in index order: the lower index wins a tie.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    selected = torch.zeros_like(visible).scatter_(-1, order, True)
    return selected & visible
