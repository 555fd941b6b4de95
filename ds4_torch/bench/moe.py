"""`ds4-torch bench moe`: one routed-experts layer at V4-Flash-like sizes, ds4_torch vs transformers.

Both sides get the very same weight tensors (shared, not copied) and the same routing: ds4_torch's
`Experts` module (the `ds4::moe` op) and transformers' `DeepseekV4Experts`, once with its plain
per-expert loop ("eager", what a standalone module runs) and once with "grouped_mm" (what a
loaded transformers model picks by default). Cases: one decode token (N=1) and a prefill of
`--prefill-tokens` tokens. The shared expert and the router are the same dense code on both
sides and are left out: the table isolates the routed experts this op replaces.

Columns: best-of-`--decode-repeats` / `--repeats` milliseconds (interleaved runs, so every
implementation sees the same machine load), milliseconds per token, the bytes-read floor (the
weight bytes of the experts the routing selected: each must be read at least once), the achieved
GB/s against that floor, the time relative to transformers' eager loop and to the faster of its
two implementations, and the largest output difference from ds4_torch.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HF_IMPLEMENTATIONS = ("eager", "grouped_mm")


def add_arguments(parser) -> None:
    from ..runtime import positive_int

    parser.add_argument("--hidden", type=positive_int, default=4096, help="hidden size (default 4096, V4-Flash)")
    parser.add_argument("--intermediate", type=positive_int, default=2048,
                        help="expert intermediate size (default 2048, V4-Flash)")
    parser.add_argument("--experts", type=positive_int, default=16, help="routed experts (default 16)")
    parser.add_argument("--top-k", type=positive_int, default=6, help="experts per token (default 6, V4-Flash)")
    parser.add_argument("--prefill-tokens", type=positive_int, default=256, help="tokens of the prefill case")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed prefill runs per cell; the best is shown (default 5)")
    parser.add_argument("--decode-repeats", type=positive_int, default=30,
                        help="timed decode runs per cell (cheap, and noisier on a shared machine; default 30)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                        help="ds4::moe implementation (default auto)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--csv", metavar="FILE", help="also write the table as CSV")


def routing(tokens: int, experts: int, top_k: int, seed: int):
    """Router-like routing: top-k of random scores, weights normalised over the k picks."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    weights, ids = scores.topk(top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def build_modules(H: int, I: int, E: int, dtype: torch.dtype, backend: str):
    """(ds4_torch Experts, {impl: transformers DeepseekV4Experts}) sharing one set of weights."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    from ..model import Experts

    g = torch.Generator().manual_seed(0)
    # Scaled so that the projections are O(1) and both SwiGLU clamps bite sometimes.
    gate_up = nn.Parameter((torch.randn(E, 2 * I, H, generator=g) * (3 / H ** 0.5)).to(dtype), requires_grad=False)
    down = nn.Parameter((torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype), requires_grad=False)
    with torch.device("meta"):  # no throwaway weight allocations: the parameters are set below
        ours = Experts(SimpleNamespace(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, swiglu_limit=10.0))
    ours.gate_up_proj, ours.down_proj = gate_up, down
    ours.backend = backend
    theirs = {}
    for impl in HF_IMPLEMENTATIONS:
        config = DeepseekV4Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, swiglu_limit=10.0,
                                  num_hidden_layers=1, layer_types=["sliding_attention"])
        config._experts_implementation = impl
        with torch.device("meta"):
            module = DeepseekV4Experts(config)
        module.gate_up_proj, module.down_proj = gate_up, down
        theirs[impl] = module
    return ours, theirs


def time_interleaved(fns: dict, repeats: int) -> dict:
    """Best wall time of each callable over `repeats` rounds; one untimed warm-up each."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            began = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - began)
    return best


@torch.no_grad()
def measure(args, dtype_name: str, bar=None) -> list[dict]:
    dtype = DTYPES[dtype_name]
    H, I, E, k = args.hidden, args.intermediate, args.experts, args.top_k
    ours, theirs = build_modules(H, I, E, dtype, args.backend)
    expert_bytes = (2 * I * H + H * I) * torch.finfo(dtype).bits // 8
    rows = []
    for case, tokens, repeats in (("decode", 1, args.decode_repeats),
                                  (f"prefill{args.prefill_tokens}", args.prefill_tokens, args.repeats)):
        ids, weights = routing(tokens, E, k, seed=tokens)
        hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1)).to(dtype)
        weights = weights.to(dtype)
        fns = {"ds4_torch": lambda: ours(hidden, ids, weights)}
        for impl, module in theirs.items():
            fns[f"transformers-{impl}"] = lambda module=module: module(hidden, ids, weights)
        reference = fns["ds4_torch"]().float()
        diffs = {name: (fn().float() - reference).abs().max().item() for name, fn in fns.items()}
        best = time_interleaved(fns, repeats)
        if bar is not None:
            bar.update()
        floor = ids.unique().numel() * expert_bytes
        for name, seconds in best.items():
            rows.append({
                "dtype": dtype_name, "case": case, "tokens": tokens, "impl": name,
                "ms": seconds * 1e3, "ms_per_token": seconds * 1e3 / tokens,
                "floor_mb": floor / 1e6, "gb_s": floor / seconds / 1e9,
                "vs_transformers_eager": seconds / best["transformers-eager"],
                "vs_transformers_best": seconds / min(v for k, v in best.items() if k.startswith("transformers")),
                "max_abs_diff": diffs[name],
            })
    del ours, theirs
    return rows


def run(args) -> int:
    from .report import announce, progress, write_csv

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    announce(f"bench moe: hidden {args.hidden}, expert intermediate {args.intermediate}, {args.experts} experts, "
             f"top-{args.top_k}, {torch.get_num_threads()} threads, backend {args.backend}, "
             f"best of {args.decode_repeats} (decode) / {args.repeats} (prefill)")
    with progress(2 * len(args.dtypes), "bench moe", unit="case") as bar:  # decode and prefill per dtype
        rows = [row for name in args.dtypes for row in measure(args, name, bar)]
    header = (f"{'dtype':<5} {'case':<11} {'impl':<24} {'ms':>9} {'ms/token':>9} {'floor MB':>9} {'GB/s':>6} "
              f"{'x eager':>8} {'x best':>7} {'max diff':>9}")
    print(header)
    for r in rows:
        print(f"{r['dtype']:<5} {r['case']:<11} {r['impl']:<24} {r['ms']:>9.2f} {r['ms_per_token']:>9.3f} "
              f"{r['floor_mb']:>9.1f} {r['gb_s']:>6.2f} {r['vs_transformers_eager']:>8.2f} "
              f"{r['vs_transformers_best']:>7.2f} {r['max_abs_diff']:>9.2g}")
    print("(floor: weight bytes of the experts the routing selected; x eager / x best: time / transformers' eager "
          "loop / the faster transformers implementation; max diff: largest |output - ds4_torch output|)")
    if args.csv:
        write_csv(rows, args.csv)
    return 0
