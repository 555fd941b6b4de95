"""`ds4-torch bench kernels`: the Triton kernels on a CUDA GPU at V4-Flash sizes, in achieved
memory bandwidth against the device's peak.

One decode step (batch 1) of each kernel: the attention (partial + merge) of a CSA layer (window
128 + its 512 picked rows) and of an HCA layer (window + every visible row), the indexer's scan
of every compressed row into sort keys plus the top-k over them, a compressor row (CSA: 8 slots,
HCA: 128 slots), and the whole CSA decode (scan, top-k, attention). Bytes are what the step must
move at least: every input read once and every output written once (the split-K partials and the
sort keys between two kernels count too: they go through memory). Times are the median of
`triton.testing.do_bench` (L2 flushed between runs, so rows come from DRAM as at long context).
Peak bandwidth: memory clock x bus width x 2 (DDR), from the driver (`triton.testing.get_dram_gbps`).
Needs a CUDA GPU: elsewhere it says so and exits with status 2.
"""

from __future__ import annotations

import math

import torch

from .report import progress, write_csv

HEADS, HEAD_DIM, WINDOW, TOPK, ROPE = 64, 512, 128, 512, 64
INDEX_HEADS, INDEX_DIM = 64, 128
RATES = {"CSA": 4, "HCA": 128}


def _need_cuda():
    from ..runtime import UserError

    if not torch.cuda.is_available():
        raise UserError("bench kernels needs a CUDA GPU (it times the Triton kernels); torch.cuda.is_available() "
                        "is False on this machine")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UserError("bench kernels needs the triton package, which is not installed") from None


def _cases(context: int, dtype, device, g):
    """(name, fn, bytes) of each timed call at this context."""
    from ..kernels import triton_kernels as tk

    s = torch.finfo(dtype).bits // 8

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    position = context - 1
    start = torch.tensor([position], device=device)
    q, ring, new = randn(1, 1, HEADS, HEAD_DIM), randn(1, WINDOW, HEAD_DIM), randn(1, 1, HEAD_DIM)
    sinks = randn(HEADS, dt=torch.float32)
    scale = HEAD_DIM ** -0.5
    out = []
    for kind, rate in RATES.items():
        C = math.ceil(context / rate)
        visible = (position + 1) // rate
        comp = randn(1, C, HEAD_DIM)
        if kind == "CSA":
            sel = torch.randperm(visible, generator=g)[:TOPK].view(1, 1, -1).to(device)
            keys_read = WINDOW + TOPK
            fn = (lambda comp=comp, sel=sel: tk.attention(q, ring, new, start, comp, sel, rate, sinks, scale))
            extra = TOPK * 8  # the picks
        else:
            keys_read = WINDOW + visible
            fn = (lambda comp=comp: tk.attention(q, ring, new, start, comp, None, rate, sinks, scale))
            extra = 0
        splits = _splits(tk, q, keys_read if kind == "HCA" else WINDOW + TOPK, device)
        partials = splits * HEADS * (HEAD_DIM + 1) * 4 * 2  # written by the partial kernel, read by the merge
        nbytes = (2 * HEADS * HEAD_DIM + keys_read * HEAD_DIM) * s + extra + partials
        out.append((f"attention {kind}", fn, nbytes))

        S = 2 * rate if kind == "CSA" else rate
        kv, gate = randn(1, 1, S, HEAD_DIM), randn(1, 1, S, HEAD_DIM)
        w, cos, sin = randn(HEAD_DIM, dt=torch.float32), randn(1, 1, ROPE // 2), randn(1, 1, ROPE // 2)
        out.append((f"compress_rows {kind} ({S} slots)", lambda kv=kv, gate=gate, w=w, cos=cos, sin=sin:
                    tk.compress_rows(kv, gate, w, 1e-6, cos, sin), (2 * S + 1) * HEAD_DIM * s))

    C = math.ceil(context / RATES["CSA"])
    qi, hw, rows = randn(1, 1, INDEX_HEADS, INDEX_DIM), randn(1, 1, INDEX_HEADS, dt=torch.float32), randn(1, C, INDEX_DIM)
    scan_bytes = INDEX_HEADS * INDEX_DIM * s + INDEX_HEADS * 4 + C * INDEX_DIM * s + C * 8  # q, weights, rows, keys
    topk_bytes = C * 8 + TOPK * 8
    out.append(("indexer scan (keys)", lambda: tk.indexer_keys(qi, hw, rows, start, 4), scan_bytes))
    out.append(("indexer scan + top-k", lambda: tk.indexer_topk(qi, hw, rows, start, 4, TOPK), scan_bytes + topk_bytes))

    comp = randn(1, C, HEAD_DIM)
    csa_attention_bytes = next(b for name, _, b in out if name == "attention CSA")

    def csa_decode():
        sel = tk.indexer_topk(qi, hw, rows, start, 4, TOPK)
        return tk.attention(q, ring, new, start, comp, sel, 4, sinks, scale)

    out.append(("CSA decode (scan, top-k, attention)", csa_decode, scan_bytes + topk_bytes + csa_attention_bytes))
    return out


def _splits(tk, q, keys, device) -> int:
    """The split count the attention launcher picks (each split writes a partial output)."""
    config = tk.attention_config(HEADS, HEAD_DIM, q.dtype)
    return tk.attention_num_splits(math.ceil(HEADS / config["BLOCK_H"]), math.ceil(keys / config["BLOCK_N"]), device)


def run(contexts=(65536, 262144), dtypes=(torch.bfloat16,), csv_path=None) -> list[dict]:
    _need_cuda()
    import triton.testing

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    peak = triton.testing.get_dram_gbps(device.index or 0)  # GB/s
    g = torch.Generator().manual_seed(0)
    rows = []
    bar = progress(len(dtypes) * len(contexts), "bench kernels", unit="cell")
    for dtype in dtypes:
        for context in contexts:
            bar.set_postfix_str(f"{str(dtype).replace('torch.', '')} at {context}")
            for name, fn, nbytes in _cases(context, dtype, device, g):
                fn()  # compile outside the timing
                ms = triton.testing.do_bench(fn, return_mode="median")
                gbps = nbytes / (ms * 1e-3) / 1e9
                rows.append({"dtype": str(dtype).replace("torch.", ""), "context": context, "kernel": name,
                             "bytes": nbytes, "us": 1e3 * ms, "GB_s": gbps, "peak_GB_s": peak,
                             "pct_peak": 100 * gbps / peak})
            bar.update()
    bar.close()
    print(f"Triton kernels, one decode step, batch 1, V4-Flash sizes ({HEADS} heads x {HEAD_DIM}, window {WINDOW}, "
          f"top-k {TOPK}, indexer {INDEX_HEADS} x {INDEX_DIM}); {props.name}, peak DRAM bandwidth {peak:,.0f} GB/s; "
          "median of triton.testing.do_bench, L2 flushed")
    head = f"{'dtype':>8} {'context':>8} {'kernel':<38} {'bytes':>12} {'us':>9} {'GB/s':>8} {'% peak':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['dtype']:>8} {r['context']:>8} {r['kernel']:<38} {r['bytes']:>12,} {r['us']:>9.1f} "
              f"{r['GB_s']:>8.0f} {r['pct_peak']:>6.1f}%")
    for r in rows:
        if r["kernel"].startswith("CSA decode") and r["context"] >= 65536:
            verdict = "meets" if r["pct_peak"] >= 80 else "misses"
            print(f"CSA decode at {r['context']} ({r['dtype']}): {r['pct_peak']:.0f}% of peak, {verdict} the 80% goal")
    if csv_path:
        write_csv(rows, csv_path)
    return rows
