"""The `ds4-torch` command line (also `python -m ds4_torch`).

`generate` and `info` live here; `serve` and `cache-explain` (the `serve` package) and `bench`
(`ds4_torch.bench`) sit on top of the library and are imported only when their command runs.
"""
from __future__ import annotations

import argparse
import io
import sys
import time

import torch

from .decode import MODES as DECODE_MODES
from .runtime import (DTYPES, UserError, add_model_arguments, add_tp_argument, check_tokenizer_vocabulary,
                      check_tp_launcher, load_config, load_model, load_model_tokenizer, positive_float, positive_int)

EXIT_USAGE = 2  # argparse's code for bad input; we use it for every user-facing error


# --------------------------------------------------------------------------- commands
def cmd_generate(args) -> int:
    check_tp_launcher(args.tp)
    tok = load_model_tokenizer(args.model)
    check_tokenizer_vocabulary(tok, load_config(args.model).vocab_size, args.allow_vocab_mismatch)
    model = load_model(args.model, device=args.device, dtype=args.dtype, tp=args.tp, quantized=args.quantized)
    tp = getattr(model, "tp", None)
    seed = args.seed
    if tp is not None:
        from .parallel import shared_seed

        seed = shared_seed(tp, seed)  # every rank must draw the same tokens
    try:
        return _generate(args, tok, model, seed, lead=tp is None or tp.rank == 0)
    finally:
        if tp is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def _generate(args, tok, model, seed, lead: bool) -> int:
    from .generation import generate
    from .sampling import stop_token_ids
    from .speculative import SpeculationStats
    from .tokenizer import StreamDecoder

    if args.chat:
        ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = tok.encode(args.prompt)
    if not ids:
        raise UserError("the prompt encodes to no tokens")

    stream = StreamDecoder(tok)
    out = sys.stdout if lead else io.StringIO()  # the other ranks compute the same text silently
    start = time.perf_counter()
    n = 0
    stats = SpeculationStats()
    try:
        for token in generate(
            model, ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, seed=seed,
            eos_token_id=stop_token_ids(model.config, tok), decode_mode=args.decode_mode,
            speculative_tokens=args.speculative_tokens, stats=stats,
        ):
            n += 1
            out.write(stream.push(token))
            out.flush()
    except ValueError as e:  # bad sampling settings, or the prompt does not fit the model's context
        raise UserError(str(e)) from e
    out.write(stream.flush() + "\n")
    out.flush()
    elapsed = time.perf_counter() - start
    if lead:
        spec = (f", {stats.drafted} drafted, {stats.accepted} accepted, {stats.acceptance_length:.2f} tokens per "
                f"verify step" if args.speculative_tokens else "")
        print(f"[{len(ids)} prompt tokens, {n} new tokens, {elapsed:.2f} s, {model.device}, "
              f"{str(model.dtype).removeprefix('torch.')}{spec}]", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    from .hardware import capabilities
    from .model import DS4ForCausalLM

    cfg = load_config(args.model)
    # On the meta device nothing is allocated: info on a 284B-parameter checkpoint
    # costs no memory, and the parameter count and cache shapes are the same.
    with torch.device("meta"):
        model = DS4ForCausalLM(cfg).to_dtype(DTYPES[args.dtype])
        cache = model.new_cache(batch_size=1, max_context=args.ctx)

    print(f"model: {args.model or 'built-in default (tiny, trained on Tiny Shakespeare)'}")
    print(f"vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
          f"{cfg.num_attention_heads} heads x {cfg.head_dim}, sliding window {cfg.sliding_window}")
    print(f"{'layer':>5}  {'attention':<30} {'rate':>5}  moe")
    for i, kind in enumerate(cfg.layer_types):
        rate = cfg.compress_rate(i)
        print(f"{i:>5}  {kind:<30} {rate if rate else '-':>5}  {cfg.mlp_layer_types[i]}")
    parameters = model.num_parameters()
    print(f"parameters: {parameters:,}")
    per_token = model.kv_bytes_per_token(args.ctx)
    print(f"KV cache ({args.dtype}) at context {args.ctx}: {per_token:,.1f} bytes/token; "
          f"total for batch 1: {cache.nbytes:,} bytes ({cache.nbytes / 2**20:.2f} MiB)")
    _print_kv_formats(cfg, DTYPES[args.dtype], args.dtype, args.ctx)
    held = _print_weight_memory(args, parameters, cache.nbytes)
    if args.kv_table:
        _print_session_table(args, cfg, held)
    print("capabilities of this machine:")
    print("  " + capabilities().table().replace("\n", "\n  "))
    return 0


def _print_kv_formats(cfg, dtype, dtype_name: str, ctx: int) -> None:
    """Compressed-row bytes per token of context for each KV row format (ds4_torch.kv_format),
    and what a static cache of `ctx` tokens in that format allocates per token."""
    from .footprint import cache_bytes, kv_bytes_per_token, sequence_fixed_bytes
    from .kv_format import KV_ROW_FORMATS

    full = kv_bytes_per_token(cfg, "full", dtype)
    print(f"KV bytes per token of context (compressed and indexer rows, all layers; the window ring and open "
          f"windows, {sequence_fixed_bytes(cfg, dtype):,} bytes per sequence in {dtype_name}, not included), and "
          f"per token of a static cache of context {ctx} (`new_cache(kv_rows=...)`, all included):")
    for name in KV_ROW_FORMATS:
        b = kv_bytes_per_token(cfg, name, dtype)
        label = dtype_name if name == "full" else {"fp8": "fp8 (every channel)",
                                                   "fp8-keep-rope": f"fp8, RoPE channels in {dtype_name}"}[name]
        ratio = f"  ({b / full:.3f}x)" if full else ""
        static = cache_bytes(cfg, ctx, 1, dtype, name) / ctx
        print(f"  {label:<32} {b:>10,.2f}{ratio}   static cache: {static:,.2f}")


def _print_session_table(args, cfg, held: int) -> None:
    """How many sessions fit --memory-gb per device once the weights are held (footprint.session_table)."""
    from .footprint import format_session_table, session_table

    if args.memory_gb is None:
        raise UserError("--kv-table needs --memory-gb (the memory of one device)")
    budget = args.memory_gb * 2**30 - held
    print(f"sessions that fit {args.memory_gb:g} GiB per device less {held / 2**30:.2f} GiB of weights "
          f"({budget / 2**30:.2f} GiB; under --tp every rank holds every session's rows; activations not counted):")
    print(format_session_table(session_table(cfg, DTYPES[args.dtype], budget),
                               names={"full": args.dtype, "fp8": "fp8"}))


def _print_weight_memory(args, parameters: int, cache_bytes: int) -> int:
    """The bytes a load would hold per device (headers only, see ds4_torch.footprint), and
    whether weights plus one sequence's KV cache fit --memory-gb."""
    from .default_model import DEFAULT_MODEL_DIR
    from .footprint import has_weights, weight_bytes_per_rank

    path = args.model or DEFAULT_MODEL_DIR
    try:
        per_rank = weight_bytes_per_rank(path, DTYPES[args.dtype], args.quantized, args.tp)
    except (OSError, ValueError, KeyError) as e:  # a checkpoint that would not load says why here too
        raise UserError(f"cannot plan loading {path}: {e}") from e
    held = max(per_rank)
    where = "per device" if args.tp > 1 else "in total"
    source = "" if has_weights(path) else " (no weight files: the dense model's sizes)"
    print(f"weights held{source} (--quantized {args.quantized}, {args.dtype}, --tp {args.tp}): {held:,} bytes "
          f"({held / 2**30:.3f} GiB) {where}; {sum(per_rank) / parameters:.3f} bytes per parameter"
          + (" (all devices together)" if args.tp > 1 else ""))
    if args.memory_gb is not None:
        need = held + cache_bytes
        verdict = "yes" if need <= args.memory_gb * 2**30 else "no"
        print(f"fits in {args.memory_gb:g} GiB per device: {verdict} (weights {held / 2**30:.2f} GiB + KV cache "
              f"for batch 1 at context {args.ctx} {cache_bytes / 2**30:.2f} GiB = {need / 2**30:.2f} GiB; "
              f"activations and the framework not counted)")
    return held


def cmd_cache_explain(args) -> int:
    from serve.cli import explain_cache

    return explain_cache(args)


def cmd_serve(args) -> int:
    from serve.cli import run

    return run(args)


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="ds4-torch", description="DeepSeek-V4 (DS4) models in PyTorch.")
    p.add_argument("--version", action="version", version=f"ds4-torch {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add_model_arguments(g)
    g.add_argument("-p", "--prompt", required=True, help="prompt text")
    g.add_argument("-n", "--max-new-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut")
    g.add_argument("--min-p", type=float, default=0.0, help="0 = no min-p cut")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat format")
    g.add_argument("--speculative-tokens", type=int, default=0, choices=range(0, 4), metavar="N",
                   help="draft N tokens per step with the model's MTP layer and verify them in one forward "
                        "(0-3; default 0 = off): the same tokens, fewer forwards")
    g.add_argument("--decode-mode", choices=DECODE_MODES, default="auto",
                   help="decode path: graph = captured CUDA graphs (an emulator off CUDA), compile = torch.compile; "
                        "auto picks graph where the device supports it, else eager (env DS4_TORCH_DECODE_MODE "
                        "overrides)")
    add_tp_argument(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="layers, parameter count and KV cache size of a model")
    i.add_argument("--model", metavar="DIR", help="checkpoint directory; default: the built-in default model")
    i.add_argument("--ctx", type=positive_int, default=4096, help="context length for the cache size (default 4096)")
    i.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="dtype of weights and cache")
    i.add_argument("--quantized", choices=("dequantize", "keep"), default="dequantize",
                   help="how FP8/FP4 weights would be loaded (as generate/serve --quantized): the bytes held follow")
    i.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="bytes held per device when split over N ranks (default 1)")
    i.add_argument("--memory-gb", type=positive_float, default=None, metavar="G",
                   help="say whether weights + one sequence's KV cache fit G GiB per device")
    i.add_argument("--kv-table", action="store_true",
                   help="with --memory-gb: how many sessions of 40K, 128K and 1M tokens fit, static vs paged, "
                        "full precision vs fp8 rows")
    i.set_defaults(func=cmd_info)

    from serve.cli import add_arguments as add_serve_arguments  # argparse only: serve's app loads on run

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (same flags as `python -m serve`)")
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)

    from serve.cli import add_explain_arguments

    x = sub.add_parser("cache-explain", help="ask a running server what a past request reused of the KV cache, and "
                                             "why not more")
    add_explain_arguments(x)
    x.set_defaults(func=cmd_cache_explain)

    from .bench import add_parser as add_bench_parser  # argparse only: each target loads on run

    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"ds4-torch: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C: said, on a line of its own (not a traceback, not silence)
        print(f"\nds4-torch: interrupted ({args.command}{' ' + args.target if args.command == 'bench' else ''})",
              file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `ds4-torch generate ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
