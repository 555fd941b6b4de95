"""`ds4-torch bench model`: runs the same weights through our model and through transformers'
`DeepseekV4ForCausalLM.generate`, on the same machine, one run each, greedy, and reports
prefill and decode throughput and KV cache bytes per token.
"""
from __future__ import annotations

import tempfile
import time

import torch

from .report import announce, machine, progress

# --------------------------------------------------------------------------- measuring
def _storage_bytes(obj, seen: set[int]) -> int:
    """Bytes of the distinct tensor storages reachable from a cache object.

    Counts storages, not views: a view that keeps a larger buffer alive costs the whole
    buffer, and K and V sharing one storage count once.
    """
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(_storage_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_storage_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        return sum(_storage_bytes(v, seen) for v in vars(obj).values())
    return 0


class _Timestamps:
    """A transformers streamer that only records when tokens arrive.

    `generate` calls put() once with the prompt (before prefill), then once per new
    token; the gap to the second call is prefill plus the first sampling step.
    """

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        self.times.append(time.perf_counter())


def bench_ours(model, prompt: list[int], new_tokens: int, speculative_tokens: int = 0) -> dict:
    from ..generation import generate
    from ..speculative import SpeculationStats

    stats = SpeculationStats()

    context = len(prompt) + new_tokens
    cache = model.new_cache(batch_size=1, max_context=context)
    tokens = []
    start = time.perf_counter()
    first = None
    # One prefill chunk, as transformers prefills the whole prompt in one forward.
    for t in generate(model, prompt, new_tokens, cache=cache, prefill_chunk=len(prompt),
                      speculative_tokens=speculative_tokens, stats=stats):
        if first is None:
            first = time.perf_counter()
        tokens.append(t)
    end = time.perf_counter()
    cached = int(cache.positions[0])  # tokens the cache holds (the last one is never fed back)
    return {
        "tokens": tokens, "prefill_s": first - start, "decode_s": end - first,
        "kv_bytes_per_token": model.kv_bytes_per_token(cached),
        "kv_bytes_total": cache.nbytes, "stats": stats,
    }


def bench_transformers(hf_model, prompt: list[int], new_tokens: int) -> dict:
    ids = torch.tensor([prompt], dtype=torch.long)
    stamps = _Timestamps()
    with torch.inference_mode():
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # never stop early, so both runs time the same count
            do_sample=False, use_cache=True, streamer=stamps, return_dict_in_generate=True,
            pad_token_id=0,  # silences the "no pad token" warning; batch 1 needs no padding
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    cached = len(prompt) + len(tokens) - 1
    kv = _storage_bytes(out.past_key_values, set())
    prompt_put, first_token = stamps.times[0], stamps.times[1]
    return {
        "tokens": tokens, "prefill_s": first_token - prompt_put, "decode_s": stamps.times[-1] - first_token,
        "kv_bytes_per_token": kv / cached, "kv_bytes_total": kv,
    }


def weight_bytes(model) -> int:
    """Bytes of the parameters and buffers this process holds."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def run_tensor_parallel(args) -> int:
    """Under torchrun: the model split over --tp ranks, then (rank 0 alone) the same model in one
    process; prefill/decode tokens/s and weight bytes per rank side by side."""
    import torch.distributed as dist

    from ..runtime import load_model

    model = load_model(args.model, device=args.device, dtype=args.dtype, tp=args.tp, quantized=args.quantized)
    rank = model.tp.rank
    prompt = torch.randint(model.config.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    split = bench_ours(model, prompt, args.new_tokens)
    per_rank = [None] * args.tp
    dist.all_gather_object(per_rank, weight_bytes(model))
    if rank == 0:
        del model
        single_model = load_model(args.model, device=args.device, dtype=args.dtype, quantized=args.quantized)
        single = bench_ours(single_model, prompt, args.new_tokens)
        announce(f"bench model --tp {args.tp}: {args.model or 'built-in default'}, prompt {args.prompt_len} tokens, "
                 f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads per process, greedy")
        print(f"{'run':<14} {'prefill tok/s':>14} {'decode tok/s':>13} {'weight bytes per rank':>22}")
        for name, r, weights in ((f"tp {args.tp}", split, max(per_rank)), ("one process", single, weight_bytes(single_model))):
            print(f"{name:<14} {args.prompt_len / r['prefill_s']:>14.1f} {(args.new_tokens - 1) / r['decode_s']:>13.1f} "
                  f"{weights:>22,}")
        print(f"weight bytes of each rank: {', '.join(f'{b:,}' for b in per_rank)}; "
              f"greedy tokens identical: {sum(a == b for a, b in zip(split['tokens'], single['tokens']))}/{args.new_tokens}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run(args) -> int:
    from ..runtime import UserError, load_model

    if args.new_tokens < 2:
        raise UserError(f"--new-tokens must be >= 2 (decode speed needs two tokens), got {args.new_tokens}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    if args.tp > 1:
        return run_tensor_parallel(args)
    if args.quantized == "keep":
        raise UserError("bench model compares with transformers, which gets our weights dequantized; "
                        "--quantized keep is for --tp runs, generate and serve")
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    vocab = model.config.vocab_size
    prompt = torch.randint(vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()

    import transformers

    transformers.utils.logging.disable_progress_bar()  # keep the report readable
    with tempfile.TemporaryDirectory(prefix="ds4-bench-") as tmp:
        model.save_pretrained(tmp)  # config.json + model.safetensors in transformers' layout
        hf_model = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()

    repeats = getattr(args, "repeats", 1)
    spec = getattr(args, "speculative_tokens", None)
    if spec is None:  # default: one draft token when the model has an MTP layer
        spec = 1 if getattr(model, "mtp", None) is not None else 0
    elif spec and getattr(model, "mtp", None) is None:
        raise UserError("--speculative-tokens needs a model with an MTP layer (mtp.* weights)")
    announce(f"bench model: {args.model or 'built-in default'}, prompt {args.prompt_len} tokens, "
             f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads, fp32, greedy; {machine()}; "
             f"best of {repeats} interleaved runs per implementation")
    spec_name = f"ds4_torch+mtp{spec}"
    runs = {"ds4_torch": [], "transformers": []} | ({spec_name: []} if spec else {})
    with progress(repeats * len(runs), "bench model") as bar:
        for _ in range(repeats):  # interleaved, so a noisy stretch of the machine hits all alike
            runs["ds4_torch"].append(bench_ours(model, prompt, args.new_tokens))
            bar.update()
            runs["transformers"].append(bench_transformers(hf_model, prompt, args.new_tokens))
            bar.update()
            if spec:
                runs[spec_name].append(bench_ours(model, prompt, args.new_tokens, spec))
                bar.update()
    results = {name: dict(r[0], prefill_s=min(x["prefill_s"] for x in r), decode_s=min(x["decode_s"] for x in r))
               for name, r in runs.items()}
    agree = sum(a == b for a, b in zip(results["ds4_torch"]["tokens"], results["transformers"]["tokens"]))

    rows = []
    for name, r in results.items():
        stats = r.get("stats")
        rows.append({
            "impl": name,
            "prefill_tok_s": args.prompt_len / r["prefill_s"],
            "decode_tok_s": (args.new_tokens - 1) / r["decode_s"],
            "kv_bytes_per_token": r["kv_bytes_per_token"],
            "kv_bytes_total": r["kv_bytes_total"],
            # speculative decoding (one run's counts: every run decodes the same tokens)
            "drafted": stats.drafted if stats else 0,
            "accepted": stats.accepted if stats else 0,
            "acceptance_length": round(stats.acceptance_length, 3) if stats and stats.steps else "",
        })
    print(f"{'impl':<17} {'prefill tok/s':>14} {'decode tok/s':>13} {'KV bytes/token':>15} {'KV bytes total':>15} "
          f"{'drafted':>8} {'accepted':>9} {'accept len':>11}")
    for r in rows:
        spec_cols = (f"{r['drafted']:>8} {r['accepted']:>9} {r['acceptance_length']:>11.2f}"
                     if r["acceptance_length"] != "" else f"{'-':>8} {'-':>9} {'-':>11}")
        print(f"{r['impl']:<17} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f} "
              f"{r['kv_bytes_per_token']:>15.1f} {r['kv_bytes_total']:>15,} {spec_cols}")
    print(f"greedy tokens identical: {agree}/{args.new_tokens}")
    if spec:
        same = sum(a == b for a, b in zip(results[spec_name]["tokens"], results["ds4_torch"]["tokens"]))
        plain_rate, spec_row = rows[0]["decode_tok_s"], rows[2]
        print(f"speculative decoding, {spec} draft token(s) from the MTP layer: {spec_row['drafted']} drafted, "
              f"{spec_row['accepted']} accepted, {spec_row['acceptance_length']:.2f} tokens per verify step (the "
              f"bonus token included); decode {spec_row['decode_tok_s'] / plain_rate:.2f}x plain; tokens identical "
              f"to plain: {same}/{args.new_tokens}")
    ours, theirs = rows[:2]
    print(f"ds4_torch / transformers: prefill {ours['prefill_tok_s'] / theirs['prefill_tok_s']:.2f}x (target >= 1.2x), "
          f"decode {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x (target >= 1.5x)")
    print("(ours: KV bytes from the cache's size formula, transformers: storages held by its cache after "
          "generation; per token = total / tokens in the cache)")
    if args.csv:
        from .report import write_csv

        write_csv(rows, args.csv)
    return 0
