"""Look inside the attention: which rows each head attends to, and how much goes to the sink.

    traces = trace_attention(model, input_ids)   # one forward pass, batch 1
    traces[2].compressed_share   # [H, T] softmax mass on compressed rows per head and query

Works by wrapping the model's op bundle for one stateless forward: every attention call is
recomputed with the reference `attention_probs`, so the numbers are exactly the softmax the model
used (with the torch backend) and the model's output is unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .kernels import reference


@dataclass
class LayerTrace:
    layer: int
    kind: str
    rate: int  # 0 for sliding layers
    window_probs: torch.Tensor  # [H, T, T]: query t -> key position j (only the window is nonzero)
    compressed_probs: torch.Tensor  # [H, T, C]: query t -> compressed row w
    sink_share: torch.Tensor  # [H, T]: softmax mass taken by the sink
    selected: torch.Tensor | None  # CSA: [T, K] compressed rows the indexer picked (-1: none)

    @property
    def window_share(self) -> torch.Tensor:
        return self.window_probs.sum(-1)

    @property
    def compressed_share(self) -> torch.Tensor:
        return self.compressed_probs.sum(-1)


@torch.no_grad()
def trace_attention(model, input_ids: torch.Tensor) -> list[LayerTrace]:
    """Run a stateless forward of `input_ids` [1, T] and return one LayerTrace per layer."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"trace_attention takes one sequence [1, T], got {tuple(input_ids.shape)}")
    T = input_ids.shape[1]
    calls, picks = [], []
    ops = model.ops

    def record_attention(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale, comp_slots=None):
        probs, _ = reference.attention_probs(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale, comp_slots)
        calls.append((probs[0].float(), ring.shape[1], comp_sel))
        return ops.attention(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale, comp_slots)

    def record_topk(*args):
        out = ops.indexer_topk(*args)
        picks.append(out)
        return out

    model.ops = dataclasses.replace(ops, attention=record_attention, indexer_topk=record_topk)
    try:
        model(input_ids)  # a fresh cache: the ring is empty, the chunk is the whole sequence
    finally:
        model.ops = ops
    traces = []
    for i, (probs, W, comp_sel) in enumerate(calls):
        kind = model.config.layer_types[i]
        traces.append(LayerTrace(
            layer=i, kind=kind, rate=model.config.compress_rate(i),
            window_probs=probs[:, :, W:W + T], compressed_probs=probs[:, :, W + T:-1], sink_share=probs[:, :, -1],
            selected=comp_sel[0] if comp_sel is not None else None,
        ))
    return traces
