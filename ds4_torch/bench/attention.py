"""`ds4-torch bench attention`: one decode step of attention at real V4-Flash sizes.

64 query heads x 512, one shared KV head, window 128, CSA (rate 4, top-k 512, indexer 64 x 128)
and HCA (rate 128), at several contexts. For each: KV bytes one decode step reads (by formula,
bf16 storage), and the measured time of one step of
- ours: the torch backend's attention op (the op the model calls);
- transformers: `eager_attention_forward` of DeepseekV4 on the same state (window + every
  compressed row, the indexer's picks applied as an additive mask, as its decode does);
- SDPA: `scaled_dot_product_attention` over the same keys ours reads (window + picked/visible rows)
  with the sink as an extra zero key whose logit comes from the mask.
The indexer's scan over all compressed rows (linear in the context by design) is timed apart.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from .report import progress, write_csv
from ..kernels import attention_ops, reference

HEADS, HEAD_DIM, WINDOW, TOPK = 64, 512, 128, 512
INDEX_HEADS, INDEX_DIM = 64, 128
RATES = {"CSA": 4, "HCA": 128}
BYTES = 2  # bf16 storage


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _state(kind: str, context: int, dtype, g):
    rate = RATES[kind]
    C = math.ceil(context / rate)
    position = context - 1  # the last position the cache can hold
    visible = (position + 1) // rate
    q = torch.randn(1, 1, HEADS, HEAD_DIM, generator=g, dtype=dtype)
    ring = torch.randn(1, WINDOW, HEAD_DIM, generator=g, dtype=dtype)
    new_kv = torch.randn(1, 1, HEAD_DIM, generator=g, dtype=dtype)
    comp = torch.randn(1, C, HEAD_DIM, generator=g, dtype=dtype)
    sinks = torch.randn(HEADS, generator=g)
    start = torch.tensor([position])
    sel = None
    if kind == "CSA":
        k = min(TOPK, C)
        sel = torch.randperm(visible, generator=g)[:k].sort().values.view(1, 1, -1)
        if sel.shape[-1] < k:
            sel = torch.cat([sel, sel.new_full((1, 1, k - sel.shape[-1]), -1)], -1)
    return SimpleNamespace(q=q, ring=ring, new_kv=new_kv, comp=comp, sel=sel, sinks=sinks, start=start, rate=rate,
                           C=C, visible=visible)


def _live_window(s):
    """The W-1 ring rows the query still sees (the slot of position start-W is stale) + the new row."""
    stale = int(s.start) % WINDOW
    keep = [r for r in range(WINDOW) if r != stale]
    return torch.cat([s.ring[:, keep], s.new_kv], dim=1)


def _ours(s, scale):
    return lambda: attention_ops("torch").attention(s.q, s.ring, s.new_kv, s.start, s.comp, s.sel, s.rate, s.sinks, scale)


def _transformers(s, scale):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

    module = SimpleNamespace(num_key_value_groups=HEADS, sinks=s.sinks.to(s.q.dtype), training=False)
    # Its decode concatenates the window (W-1 kept rows + the new one) and every compressed row.
    kv = torch.cat([_live_window(s), s.comp], dim=1)[:, None]  # [1, 1, W+C, D]
    mask = torch.zeros(1, 1, 1, kv.shape[2], dtype=s.q.dtype)
    if s.sel is not None:  # block bias: only the picked compressed rows
        comp_bias = torch.full((s.C,), float("-inf"), dtype=s.q.dtype)
        comp_bias[s.sel[0, 0][s.sel[0, 0] >= 0]] = 0
        mask[..., WINDOW:] = comp_bias
    q = s.q.transpose(1, 2)  # [1, H, 1, D]
    return lambda: eager_attention_forward(module, q, kv, kv, mask, scale)


def _sdpa(s, scale):
    if s.sel is not None:
        rows = s.comp[:, s.sel[0, 0][s.sel[0, 0] >= 0]]
    else:
        rows = s.comp[:, :s.visible]
    zero = torch.zeros(1, 1, HEAD_DIM, dtype=s.q.dtype)
    keys = torch.cat([_live_window(s), rows, zero], dim=1)[:, None]  # the last key is the sink
    bias = torch.zeros(1, HEADS, 1, keys.shape[2], dtype=s.q.dtype)
    bias[..., -1] = s.sinks.to(s.q.dtype).view(1, HEADS, 1)  # sink logit, contributes a zero value
    q = s.q.transpose(1, 2)
    return lambda: F.scaled_dot_product_attention(q, keys, keys, attn_mask=bias, scale=scale, enable_gqa=True)


def _indexer_scan(s, g):
    q = torch.randn(1, 1, INDEX_HEADS, INDEX_DIM, generator=g, dtype=s.q.dtype)
    w = torch.randn(1, 1, INDEX_HEADS, generator=g)
    rows = torch.randn(1, s.C, INDEX_DIM, generator=g, dtype=s.q.dtype)
    return lambda: reference.indexer_topk(q, w, rows, s.start, s.rate, TOPK)


def kv_bytes(kind: str, context: int, ours: bool) -> int:
    """Bytes of cache one decode step reads (bf16), indexer scan included for CSA."""
    rate = RATES[kind]
    visible = context // rate
    if kind == "HCA":
        return (WINDOW + visible) * HEAD_DIM * BYTES
    scan = visible * INDEX_DIM * BYTES
    rows = min(TOPK, visible) if ours else visible  # transformers concatenates every row
    return (WINDOW + rows) * HEAD_DIM * BYTES + scan


def run(contexts=(4096, 16384, 65536, 262144), dtype=torch.float32, repeats: int = 5, csv_path=None) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    scale = HEAD_DIM ** -0.5
    rows = []
    bar = progress(len(contexts) * len(RATES), "bench attention", unit="cell")
    for context in contexts:
        for kind in RATES:
            bar.set_postfix_str(f"{kind} at {context}")
            s = _state(kind, context, dtype, g)
            row = {"context": context, "layer": kind, "kv_bytes_ours": kv_bytes(kind, context, True),
                   "kv_bytes_transformers": kv_bytes(kind, context, False)}
            expected = _ours(s, scale)()
            for name, make in (("ours_ms", _ours), ("transformers_ms", _transformers), ("sdpa_ms", _sdpa)):
                fn = make(s, scale)
                out = fn()
                out = out[0] if isinstance(out, tuple) else out
                out = out.reshape(expected.shape) if out.numel() == expected.numel() else out.transpose(1, 2)
                if (out.float() - expected.float()).abs().max() > 1e-3:  # all three compute the same thing
                    raise AssertionError(f"{name} disagrees with ours at {kind} {context}")
                row[name] = 1e3 * _time(fn, repeats)
            row["indexer_scan_ms"] = 1e3 * _time(_indexer_scan(s, g), repeats) if kind == "CSA" else 0.0
            rows.append(row)
            bar.update()
    bar.close()
    print_table(rows, dtype)
    if csv_path:
        write_csv(rows, csv_path)
    return rows


def print_table(rows, dtype) -> None:
    print(f"decode attention, one layer, batch 1, {HEADS} heads x {HEAD_DIM}, window {WINDOW}, top-k {TOPK}; "
          f"CPU, {dtype}, {torch.get_num_threads()} thread(s); best of runs")
    head = f"{'context':>8} {'layer':>5} {'KV read ours':>13} {'KV read HF':>12} {'ours ms':>9} {'HF ms':>9} " \
           f"{'SDPA ms':>9} {'HF/ours':>8} {'indexer ms':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['context']:>8} {r['layer']:>5} {r['kv_bytes_ours'] / 2**20:>10.2f}MiB "
              f"{r['kv_bytes_transformers'] / 2**20:>9.2f}MiB {r['ours_ms']:>9.3f} {r['transformers_ms']:>9.3f} "
              f"{r['sdpa_ms']:>9.3f} {r['transformers_ms'] / r['ours_ms']:>7.1f}x {r['indexer_scan_ms']:>11.3f}")
    by = {(r["context"], r["layer"]): r for r in rows}
    if (4096, "CSA") in by and (65536, "CSA") in by:  # V4-Flash alternates CSA and HCA layers
        pair = {c: {k: by[(c, "CSA")][k] + by[(c, "HCA")][k] for k in ("ours_ms", "transformers_ms")}
                for c in (4096, 65536)}
        print(f"CSA+HCA pair: ours grows {pair[65536]['ours_ms'] / pair[4096]['ours_ms']:.2f}x from 4K to 64K "
              f"(target <= 1.5x); {pair[65536]['transformers_ms'] / pair[65536]['ours_ms']:.1f}x faster than "
              f"transformers at 64K (target >= 10x)")
    for kind in RATES:
        if (4096, kind) in by and (65536, kind) in by:
            a, b = by[(4096, kind)], by[(65536, kind)]
            print(f"{kind}: ours grows {b['ours_ms'] / a['ours_ms']:.2f}x from 4K to 64K (target <= 1.5x); "
                  f"{b['transformers_ms'] / b['ours_ms']:.1f}x faster than transformers at 64K (target >= 10x)")
