"""`ds4-torch bench decode`: decode latency of the eager, graph and torch.compile paths, and which
one `auto` picks on this machine, and why.

Two models: the embedded default model, and one V4-Flash-sized CSA layer (hidden 4096, 64 heads x
512, q rank 1024, 8 output groups x 1024, indexer 64 x 128, window 128; its MoE cut to 8 experts and
its vocabulary to 1024 so it fits a laptop; `--models` picks). Each path decodes the same tokens
after the same prefill; the table gives ms per step (median; a step decodes one token of each of
`--batch` sequences), the aten ops one step launches (the captured graph's op count: on a GPU,
each is a kernel launch in eager mode, and the whole graph is one replay in graph mode), the time
of the whole run (first step, where graph captures and compile compiles, plus the others), after
how many tokens a mode's faster steps repay its first step against eager, and the largest logit
difference from eager (the model's first row).

`--cache static paged` decodes each model over both caches in the same run: a `PagedDS4Cache`
(256-token blocks, every sequence its own blocks) beside the static `DS4Cache`, `--batch` sequences
a step (a 16-row step: `--batch 16`). A paged step includes its block-table bookkeeping
(`append_tokens`, on the host: shown apart as well); the paged cache runs eager only (its graph
and compile paths are untested). The decoders' steps are timed interleaved, one step of each in
turn (each decoder first in turn), so a noisy machine slows them alike, and the paged/static
ratio is the median of the step-by-step ratios.
"""

from __future__ import annotations

import statistics
import time

import torch

from .report import machine, progress, write_csv
from ..decode import choose_mode, make_decoder, prefill

FLASH_LAYER = {
    "vocab_size": 1024, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 1,
    "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "sliding_window": 128, "layer_types": ["compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 8, "num_experts_per_tok": 6,
    "num_hash_layers": 0, "hc_mult": 4,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
}


def _flash_layer():
    from ..config import DS4Config
    from ..model import DS4ForCausalLM

    return DS4ForCausalLM(DS4Config.from_dict(FLASH_LAYER)).init_weights(seed=0).eval()


def _default():
    from ..default_model import build_default_model

    return build_default_model()


def _ops_per_step(model, cache) -> int:
    from torch.fx.experimental.proxy_tensor import make_fx

    snapshot = [t.clone() for t in cache.tensors()]
    ids = torch.zeros(1, dtype=torch.long)
    graph = make_fx(lambda i: model._forward(i.view(1, 1), cache), tracing_mode="real")(ids)
    for t, saved in zip(cache.tensors(), snapshot):
        t.copy_(saved)
    return sum(1 for n in graph.graph.nodes if n.op == "call_function" and "aten" in str(n.target))


CACHES = ("static", "paged")
MODELS = {"default": ("default model", _default), "flash": ("V4-Flash CSA layer", _flash_layer)}


def _new_cache(model, kind: str, batch: int, context: int):
    if kind == "static":
        return model.new_cache(batch, context)
    from ..paged import PagedDS4Cache

    return PagedDS4Cache(model.config, batch, context, dtype=model.dtype, device=model.device)


def _paged(cache) -> bool:
    return hasattr(cache, "append_tokens")


def _prefill(model, cache, ids, chunk: int = 256) -> None:
    """`decode.prefill`; a paged cache takes each chunk's tokens into its block tables first."""
    if not _paged(cache):
        prefill(model, cache, ids, chunk=chunk)
        return
    with torch.inference_mode():
        for a in range(0, ids.shape[1], chunk):
            cache.append_tokens(ids[:, a:a + chunk])
            model(ids[:, a:a + chunk], cache=cache, logits_to_keep=1)


class _Run:
    """One (cache, mode) decoder, its outputs and step times."""

    def __init__(self, model, kind: str, mode: str, ids, prompt_len: int, steps: int):
        self.kind = kind
        self.cache = _new_cache(model, kind, ids.shape[0], prompt_len + steps + 1)
        _prefill(model, self.cache, ids[:, :prompt_len])
        self.decoder = make_decoder(model, self.cache, mode)
        self.outs, self.times, self.append_times = [], [], []

    def step(self, tokens) -> float:
        """Decode `tokens` [B]; the seconds it took (a paged step's table bookkeeping included)."""
        t = time.perf_counter()
        if _paged(self.cache):
            self.cache.append_tokens(tokens[:, None])
            self.append_times.append(time.perf_counter() - t)
        self.outs.append(self.decoder.step(tokens))
        return time.perf_counter() - t


@torch.no_grad()
def run(prompt_len: int = 200, steps: int = 32, modes=("eager", "graph", "compile"), csv_path=None,
        caches=("static",), batch: int = 1, models=tuple(MODELS)) -> list[dict]:
    rows, skipped, ratios = [], [], {}
    per_model = sum(1 for kind in caches for mode in modes if kind != "paged" or mode == "eager")
    bar = progress(len(models) * per_model * steps, "bench decode", unit="step")
    for key in models:
        name, build = MODELS[key]
        model = build()
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len + steps),
                            generator=torch.Generator().manual_seed(0))
        runs = []
        for kind in caches:
            for mode in modes:
                if kind == "paged" and mode != "eager":
                    skipped.append(f"{name}, paged cache, {mode}")
                    continue
                runs.append(_Run(model, kind, mode, ids, prompt_len, steps))
        first = []
        for r in runs:  # the first step captures / compiles
            bar.set_postfix_str(f"{name}, {r.kind} cache, {r.decoder.mode}: first step")
            first.append(r.step(ids[:, prompt_len]))
            bar.update()
        bar.set_postfix_str(name)
        for i in range(1, steps):  # interleaved: one step of each decoder in turn, each first in turn
            for r in runs[i % len(runs):] + runs[:i % len(runs)]:
                r.times.append(r.step(ids[:, prompt_len + i]))
                bar.update()
        reference = torch.stack(runs[0].outs) if runs else None
        eager = {r.kind: r for r in runs if r.decoder.mode == "eager"}
        if {"static", "paged"} <= set(eager):  # step by step: the pairs ran back to back
            ratios[name] = statistics.median(p / s for p, s in zip(eager["paged"].times, eager["static"].times))
        for r, first_s in zip(runs, first):
            ops_cache = _new_cache(model, r.kind, 1, prompt_len + steps + 1)
            if _paged(ops_cache):
                ops_cache.append_tokens(torch.zeros(1, 1, dtype=torch.long))
            rows.append({
                "model": name, "cache": r.kind, "batch": batch, "mode": r.decoder.mode,
                "ms_per_step": 1e3 * statistics.median(r.times),
                "append_ms": 1e3 * statistics.median(r.append_times[1:]) if r.append_times else None,
                "first_step_s": first_s, "total_s": first_s + sum(r.times),
                "aten_ops_per_step": _ops_per_step(model, ops_cache),
                "launches_per_step": 1 if r.decoder.mode == "graph" and torch.cuda.is_available() else None,
                "max_diff_vs_eager": (torch.stack(r.outs) - reference).abs().max().item(),
            })
        del model, runs
    eager = {(r["model"], r["cache"]): r for r in rows if r["mode"] == "eager"}
    for r in rows:  # tokens after which this mode's faster steps have repaid its slower first step
        e = eager.get((r["model"], r["cache"]))
        gain = (e["ms_per_step"] - r["ms_per_step"]) / 1e3 if e else 0.0
        r["break_even_tokens"] = None if e is None or r is e or gain <= 0 else \
            max(0, round((r["first_step_s"] - e["first_step_s"]) / gain))
    bar.close()
    device = torch.device("cpu")
    auto, why = choose_mode(device)
    print(f"decode, batch {batch}, prompt {prompt_len}, {steps} steps; {machine()}, {torch.get_num_threads()} "
          f"thread(s); graph mode off CUDA is the capture emulator (an FX replay), not a CUDA graph; "
          f"max |diff| against the first row of each model")
    head = (f"{'model':<20} {'cache':<7} {'mode':<8} {'ms/step':>9} {'1st step s':>11} {'run s':>7} {'break-even':>11} "
            f"{'aten ops/step':>14} {'max |diff|':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        even = "-" if r["break_even_tokens"] is None else f"{r['break_even_tokens']:,} tok"
        print(f"{r['model']:<20} {r['cache']:<7} {r['mode']:<8} {r['ms_per_step']:>9.2f} {r['first_step_s']:>11.2f} "
              f"{r['total_s']:>7.2f} {even:>11} {r['aten_ops_per_step']:>14} {r['max_diff_vs_eager']:>11.2e}")
    for note in skipped:
        print(f"skipped: {note} (a paged cache decodes eager only for now)")
    for model_name, ratio in ratios.items():
        static, paged = eager[(model_name, "static")], eager[(model_name, "paged")]
        print(f"{model_name}: a {batch}-row eager step over the paged cache takes {ratio:.3f}x the static cache's "
              f"(median of the step-by-step ratios; medians {paged['ms_per_step']:.2f} vs {static['ms_per_step']:.2f} "
              f"ms, of it {paged['append_ms']:.3f} ms block-table bookkeeping on the host; target: within 5%)")
    print(f"auto picks {auto} on this machine ({device.type}): {why}")
    for model_name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model_name and r["cache"] == "static"] or \
            [r for r in rows if r["model"] == model_name]
        run_best = min(mine, key=lambda r: r["total_s"])
        step_best = min(mine, key=lambda r: r["ms_per_step"])
        print(f"{model_name}: fastest over this run ({steps} tokens, first step included): {run_best['mode']}"
              f"{' = auto' if run_best['mode'] == auto else f' (auto: {auto})'}; fastest per token once warm: "
              f"{step_best['mode']}" + ("" if step_best["break_even_tokens"] is None else
                                       f", ahead of eager after {step_best['break_even_tokens']:,} tokens"))
    if csv_path:
        write_csv(rows, csv_path)
    return rows
