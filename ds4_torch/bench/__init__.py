"""`ds4-torch bench TARGET`: speed and size comparisons, each against its peer in the same run.

The benchmarks sit on top of the library (and `bench serve` on top of the server): nothing in
`ds4_torch` imports them. One module per target, loaded only when its target runs:

- `model`      (`model.py`): our model vs transformers' `DeepseekV4ForCausalLM.generate`.
- `attention`  (`attention.py`): one decode step of attention at V4-Flash sizes vs transformers/SDPA.
- `layer`      (`layer.py`): one decode step of a whole V4-Flash CSA/HCA attention layer at long
  context, fp32 and bf16, vs transformers' DeepseekV4Attention.
- `decode`     (`decode.py`): eager, graph and torch.compile decode paths, and which one `auto` picks;
  over the static and (`--cache static paged`) the paged cache.
- `kernels`    (`kernels.py`): the Triton kernels on a CUDA GPU, achieved GB/s against the peak.
- `serve`      (`serve.py`): HTTP streaming through a local server vs direct decode; its clients
  run in a process of their own (`serve_clients.py`, which imports no torch).
- `moe`        (`moe.py`): one routed-experts layer at V4-Flash sizes vs transformers' experts.
- `checkpoint` (`checkpoint.py`): cache checkpoints (take, restore, branch, import) at V4-Flash's
  layout vs copying the whole sequence.
- `quant`      (`quant.py`): a real-size FP8/FP4 checkpoint kept quantized vs dequantized to bf16.
- `speculative` (`speculative.py`): decode with MTP speculation vs without, acceptance and costs.
- `stops`      (`stops.py`): the server's stop-string matcher vs the plain scan it replaced, alone
  and (`--gap`) through the server beside a stream.
"""
from __future__ import annotations

import importlib

TARGETS = ("model", "attention", "layer", "decode", "kernels", "serve", "moe", "checkpoint", "quant", "speculative", "stops")


def _threads(args) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _run_model(args) -> int:
    _threads(args)
    return importlib.import_module(".model", __name__).run(args)


def _run_attention(args) -> int:
    _threads(args)
    importlib.import_module(".attention", __name__).run(tuple(args.contexts), repeats=args.repeats, csv_path=args.csv)
    return 0


def _run_layer(args) -> int:
    _threads(args)
    import torch

    dtypes = tuple(getattr(torch, name) for name in args.dtypes)
    importlib.import_module(".layer", __name__).run(tuple(args.contexts), tuple(args.layers), dtypes,
                                                    repeats=args.repeats, transformers=not args.no_transformers,
                                                    csv_path=args.csv)
    return 0


def _run_decode(args) -> int:
    _threads(args)
    importlib.import_module(".decode", __name__).run(args.prompt_len, args.steps, tuple(args.modes), csv_path=args.csv,
                                                     caches=tuple(dict.fromkeys(args.cache)), batch=args.batch,
                                                     models=tuple(dict.fromkeys(args.models)))
    return 0


def _run_context(args) -> int:
    from .context import run

    return run(args)


def _run_kernels(args) -> int:
    import torch

    dtypes = tuple(getattr(torch, name) for name in args.dtypes)
    importlib.import_module(".kernels", __name__).run(tuple(args.contexts), dtypes, csv_path=args.csv)
    return 0


def _run_serve(args) -> int:
    return importlib.import_module(".serve", __name__).run(args)


def _run_moe(args) -> int:
    return importlib.import_module(".moe", __name__).run(args)


def _run_checkpoint(args) -> int:
    _threads(args)
    from ..runtime import resolve_device, resolve_dtype

    importlib.import_module(".checkpoint", __name__).run(tuple(args.contexts), resolve_dtype(args.dtype),
                                                         resolve_device(args.device), repeats=args.repeats,
                                                         csv_path=args.csv)
    return 0


def _run_quant(args) -> int:
    return importlib.import_module(".quant", __name__).run(args)


def _run_speculative(args) -> int:
    _threads(args)
    return importlib.import_module(".speculative", __name__).run(args)


def _run_stops(args) -> int:
    return importlib.import_module(".stops", __name__).run(args)


def announce(args, parser, description: str) -> None:
    """Every target's first line, on stderr: what it measures and the settings given (its table
    comes at the end; a progress bar shows how far it is), said once it starts measuring."""
    from .report import announce as say

    given = [(k, v) for k, v in vars(args).items()
             if k not in ("func", "command", "target") and v != parser.get_default(k)]
    settings = ", ".join(f"--{k.replace('_', '-')}" + ("" if v is True else " " + (" ".join(map(str, v))
                                                      if isinstance(v, list) else str(v))) for k, v in given)
    say(f"ds4-torch bench {args.target}: {description}" + (f" ({settings})" if settings else " (the defaults)"),
        pending=True)


def add_parser(sub) -> None:
    """The `bench` command and its targets, under the CLI's subparsers `sub`."""
    from ..runtime import add_model_arguments, add_tp_argument, positive_int

    b = sub.add_parser("bench", help=f"benchmarks (targets: {', '.join(TARGETS)})")
    targets = b.add_subparsers(dest="target", required=True, metavar="TARGET",
                               title=f"targets ({', '.join(TARGETS)})")

    def target(name, help_text, run):
        p = targets.add_parser(name, help=help_text)

        def announced(args):
            announce(args, p, help_text)
            return run(args)

        p.set_defaults(func=announced)
        return p

    def common(p):
        p.add_argument("--threads", type=positive_int, default=None,
                       help="torch.set_num_threads (default: torch's choice)")
        p.add_argument("--csv", metavar="FILE", help="also write the table as CSV")

    m = target("model", "our model vs transformers' DeepseekV4ForCausalLM.generate", _run_model)
    add_model_arguments(m)
    m.add_argument("--prompt-len", type=positive_int, default=256, help="prompt tokens (default 256)")
    m.add_argument("--new-tokens", type=int, default=64, help="generated tokens (default 64)")
    add_tp_argument(m)
    m.add_argument("--repeats", type=positive_int, default=3,
                   help="runs per implementation, interleaved; the best of each is shown (default 3)")
    m.add_argument("--speculative-tokens", type=int, choices=range(0, 4), default=None, metavar="N",
                   help="also decode with N draft tokens from the MTP layer (0-3; default 1 when the model has one, "
                        "else 0): speed, drafted and accepted tokens, acceptance length")
    common(m)

    sp = target("speculative", "decode with MTP speculation vs without: speed, acceptance, cost ratios", _run_speculative)
    add_model_arguments(sp)
    sp.add_argument("--prompt", default=None, help="prompt text (default: a few lines of Romeo and Juliet)")
    sp.add_argument("--new-tokens", type=positive_int, default=128, help="generated tokens (default 128)")
    sp.add_argument("--speculative-tokens", type=positive_int, nargs="+", default=[1, 2, 3],
                    help="draft tokens per step to measure (default 1 2 3)")
    sp.add_argument("--repeats", type=positive_int, default=3,
                    help="runs per setting, interleaved with plain decoding; the best is shown (default 3)")
    sp.add_argument("--decode-mode", choices=("eager", "graph", "compile"), default="eager",
                    help="how plain and speculative steps run (default eager; compile: the first run of each "
                         "compiles, minutes on a CPU, so use --repeats 2 or more)")
    common(sp)

    a = target("attention", "one decode step of attention at V4-Flash sizes vs transformers/SDPA", _run_attention)
    a.add_argument("--contexts", type=positive_int, nargs="+", default=[4096, 16384, 65536, 262144])
    a.add_argument("--repeats", type=positive_int, default=5, help="timed runs per cell; the best is shown")
    common(a)

    y = target("layer", "one decode step of a V4-Flash CSA/HCA attention layer vs transformers", _run_layer)
    y.add_argument("--contexts", type=positive_int, nargs="+", default=[4096, 65536, 262144])
    y.add_argument("--layers", nargs="+", choices=("CSA", "HCA"), default=["CSA", "HCA"])
    y.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    y.add_argument("--repeats", type=positive_int, default=5, help="timed runs per cell; the best is shown")
    y.add_argument("--no-transformers", action="store_true", help="time ours only")
    common(y)

    d = target("decode", "per-token latency of eager, graph and torch.compile decode", _run_decode)
    d.add_argument("--prompt-len", type=positive_int, default=200)
    d.add_argument("--steps", type=positive_int, default=32)
    d.add_argument("--modes", nargs="+", choices=("eager", "graph", "compile"), default=["eager", "graph", "compile"])
    d.add_argument("--cache", nargs="+", choices=("static", "paged"), default=["static"],
                   help="caches to decode over, in the same run: static (DS4Cache) and/or paged (PagedDS4Cache, "
                        "eager only) (default static)")
    d.add_argument("--batch", type=positive_int, default=1, help="sequences decoded per step (default 1)")
    d.add_argument("--models", nargs="+", choices=("default", "flash"), default=["default", "flash"],
                   help="the embedded default model and/or one V4-Flash-sized CSA layer (default both)")
    common(d)

    ctx = target("context", "prefill and decode speed as the context grows, the cache sized as serve sizes it",
                 _run_context)
    add_model_arguments(ctx)
    ctx.add_argument("--contexts", type=positive_int, nargs="+", default=[1024, 40960],
                     help="prompt lengths; decode is timed right after each (default 1024 40960)")
    ctx.add_argument("--ctx", type=positive_int, default=None,
                     help="cache size in tokens (default: the model's max_position_embeddings, serve's default)")
    ctx.add_argument("--prefill-chunk", type=positive_int, default=256,
                     help="tokens per prefill chunk (default 256, as serve)")
    ctx.add_argument("--new-tokens", type=positive_int, default=32, help="decode steps timed (default 32)")
    common(ctx)

    k = target("kernels", "the Triton kernels on a CUDA GPU: achieved GB/s against the device's peak", _run_kernels)
    k.add_argument("--contexts", type=positive_int, nargs="+", default=[65536, 262144])
    k.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float16", "float32"), default=["bfloat16"])
    k.add_argument("--csv", metavar="FILE", help="also write the table as CSV")

    s = target("serve", "HTTP streaming through a local server vs direct decode", _run_serve)
    from .serve import add_arguments as add_serve_arguments  # argparse only; the server loads on run

    add_serve_arguments(s)

    st = target("stops", "the server's stop-string matcher vs the plain scan (us/token by stop length and count)",
                _run_stops)
    from .stops import add_arguments as add_stops_arguments  # argparse only; serve loads on run

    add_stops_arguments(st)

    moe = target("moe", "one routed-experts layer (ds4::moe) at V4-Flash sizes vs transformers", _run_moe)
    from .moe import add_arguments as add_moe_arguments  # argparse only

    add_moe_arguments(moe)

    c = target("checkpoint", "cache checkpoints at V4-Flash's layout: take, restore, branch, import (no weights)",
               _run_checkpoint)
    c.add_argument("--contexts", type=positive_int, nargs="+", default=[4096, 65536])
    c.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    c.add_argument("--device", default="cpu", help="cpu, cuda, ... (default cpu)")
    c.add_argument("--repeats", type=positive_int, default=5, help="timed runs per cell; the median is shown")
    common(c)

    quant = target("quant", "a real-size FP8/FP4 checkpoint: --quantized keep vs dequantized (decode, prefill, memory)",
                   _run_quant)
    from .quant import add_arguments as add_quant_arguments  # argparse only

    add_quant_arguments(quant)
