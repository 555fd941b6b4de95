"""`ds4-torch bench serve`: HTTP streaming through the batching server against direct decode.

1. Direct: `ds4_torch.generate` on the model (same prefill chunk as the server): the decode rate
   of one sequence with nothing else running ((tokens - 1) / first-to-last token).
2. HTTP, for each count in `--clients` (e.g. 1 2 4 8 16): that many concurrent streaming clients
   (in a separate process; httpx, `/v1/completions`, distinct random prompts so no prefix is
   reused, greedy, `return_token_ids` so every token is counted exactly). Per count: aggregate
   tokens/s (all tokens / wall time, prefill and queueing included), time to first token p50/p99,
   inter-token latency p50/p99 (gaps between consecutive tokens of one stream, over all streams),
   and the host work: CPU time of the engine and output threads outside the model (prefill
   included) and the batched sampler, in microseconds per sequence per decode step. The same
   streams are also run on the server's engine alone (submitted in-process: no HTTP, SSE or
   client process), which separates the engine's scaling from the HTTP layer's.
3. A long prompt mid-stream (`--stall-prompt-len`, default 2000): `--stall-clients` streams are
   decoding when one request with that long prompt arrives; the largest gap any stream sees while
   that prompt is prefilled, against the slowest chunk of the same prompt prefilled directly (a
   chunk deep into a prompt costs more than the first). The engine runs one batched decode step
   then at most one prefill chunk per iteration, so that gap should stay within one decode step
   plus one chunk.

`--scenario agents` runs `ds4_torch.bench.agents` instead: the tokens agents' conversations make
the server prefill, with cache checkpoints on and off; with `--replicas N` (or `--router-url`),
through vllm-router in front of N replicas, per routing policy. `--scenario pool` runs
`ds4_torch.bench.pool`: what the paged KV pool holds for chats on one system prompt and for long
sessions.
"""
from __future__ import annotations

import time

import torch

from .serve_clients import run_clients


def add_arguments(p) -> None:
    from ..runtime import add_model_arguments, positive_int

    add_model_arguments(p)
    p.add_argument("--scenario", choices=("throughput", "agents", "pool"), default="throughput",
                   help="throughput: streaming clients against direct decode (default); agents: conversations "
                        "sharing a system prompt, regenerating, editing and retrying (ds4_torch.bench.agents); "
                        "pool: the paged KV pool with chats on one system prompt and long sessions "
                        "(ds4_torch.bench.pool)")
    p.add_argument("--chats", type=positive_int, default=16, help="pool: chats sent at once (default 16)")
    p.add_argument("--session-tokens", type=positive_int, default=12000,
                   help="pool: tokens of each long session (default 12000)")
    p.add_argument("--kv-cache-mb", type=float, default=8.0, help="pool: the server's --kv-cache-mb (default 8)")
    p.add_argument("--system-tokens", type=positive_int, default=6000,
                   help="agents: the shared system prompt's tokens (default 6000)")
    p.add_argument("--user-tokens", type=positive_int, default=100, help="agents: tokens per user message (default 100)")
    p.add_argument("--checkpoint-interval", type=positive_int, default=256,
                   help="agents: the server's --checkpoint-interval in the run with checkpoints (default 256)")
    p.add_argument("--checkpoint-memory-mb", type=float, default=1024,
                   help="agents: the server's --checkpoint-memory-mb (default 1024)")
    p.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="agents: run the conversations through vllm-router in front of N replicas (`python -m serve` "
                        "processes with --kv-events), a fresh set for each of --policies, and compare the policies "
                        "(default: one server, in this process)")
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware", "kv_aware"], metavar="POLICY",
                   choices=("round_robin", "random", "cache_aware", "kv_aware", "power_of_two", "consistent_hash",
                            "sticky_least_loaded"),
                   help="agents with --replicas: vllm-router's --policy values to run (default round_robin "
                        "cache_aware kv_aware)")
    p.add_argument("--router-url", metavar="URL", default=None,
                   help="agents: run the conversations through the router (or server) at URL instead")
    p.add_argument("--router", metavar="PATH", default=None,
                   help="agents with --replicas: the vllm-router executable (default: the one installed beside this "
                        "Python, else on PATH)")
    p.add_argument("--clients", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16],
                   help="concurrent streaming clients, one run per count (default 1 2 4 8 16)")
    p.add_argument("--max-batch", type=positive_int, default=None,
                   help="the server's --max-batch (default: the largest client count)")
    p.add_argument("--stall-prompt-len", type=int, default=2000,
                   help="prompt of the request that arrives mid-stream (0: skip that run; default 2000)")
    p.add_argument("--stall-clients", type=positive_int, default=4, help="streams decoding when it arrives (default 4)")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--prompt-len", type=positive_int, default=256, help="prompt tokens per request (default 256)")
    p.add_argument("--prefill-chunk", type=positive_int, default=256, help="prefill chunk (default 256)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--repeat", type=positive_int, default=3,
                   help="direct runs (the median is reported) and runs of the model alone's decode steps (the best "
                        "is reported; default 3)")
    p.add_argument("--speculative-tokens", type=int, nargs="+", choices=range(0, 4), default=[0], metavar="N",
                   help="the server's --speculative-tokens; several values run the streams once per value, in this "
                        "run, and compare each with the first (default 0: no speculation)")
    p.add_argument("--speculative-max-batch", type=positive_int, default=None, metavar="N",
                   help="the server's --speculative-max-batch (default: always speculate)")
    p.add_argument("--speculative-policy", choices=("auto", "always"), default="always",
                   help="the server's --speculative-policy (default always: measure speculation itself)")
    p.add_argument("--engine-core", choices=("thread", "process", "both"), default="process",
                   help="where the server's engine runs: process (default: an engine core process of its own, as "
                        "`serve` runs it), thread (in this process, beside HTTP) or both, one after the other")
    p.add_argument("--plot", metavar="FILE", help="also draw tokens/s and ITL against streams (matplotlib): the "
                                                  "model alone, the engine alone and HTTP")
    p.add_argument("--csv", metavar="FILE", help="also write the table as CSV")


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def bench_direct(model, prompt: list[int], new_tokens: int, chunk: int) -> dict:
    from ..generation import generate

    cache = model.new_cache(batch_size=1, max_context=len(prompt) + new_tokens)
    start = time.perf_counter()
    stamps = []
    for _ in generate(model, prompt, new_tokens, cache=cache, prefill_chunk=chunk):
        stamps.append(time.perf_counter())
    return {"ttft": [stamps[0] - start], "rates": [(len(stamps) - 1) / (stamps[-1] - stamps[0])],
            "tokens": len(stamps), "wall": stamps[-1] - start}


def run_engine(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """The same streams submitted to the server's engine in-process (no HTTP, no SSE, no client
    process): what the engine and its output thread give alone."""
    import threading

    from serve.engine.sequence import GenRequest

    stamps: list[list[float]] = [[] for _ in prompts]
    left, done, lock = [len(prompts)], threading.Event(), threading.Lock()

    def emit_for(i):
        def emit(event):
            if event[0] == "token":
                stamps[i].append(time.perf_counter())
            else:
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
        return emit

    reqs = [GenRequest(p, new_tokens, ignore_eos=True, emit=emit_for(i)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    engine.submit_all(reqs)
    if not done.wait(3600):
        raise RuntimeError("the engine did not finish the streams")
    failed = [r.error for r in reqs if r.state != "done"]
    if failed:
        raise RuntimeError(f"engine run failed: {failed[0]}")
    return {"ttft": [s[0] - start for s in stamps], "stamps": stamps, "tokens": sum(map(len, stamps)),
            "wall": time.perf_counter() - start}


def model_floor(model, prompts: list[list[int]], new_tokens: int, chunk: int, steps: int | None = None,
                repeat: int = 3) -> dict:
    """The model's own work for these streams, with nothing around it: every prompt prefilled in
    one batch (faster than the engine's one prompt at a time), then decode steps of all rows
    (best of `repeat` x `steps`, argmax fed back; by default the streams' own new_tokens - 1
    steps). No sampler, scheduler, output thread or HTTP, so no server can beat it: `new_tokens`
    per stream over prefill + (new_tokens - 1) steps is the ceiling on the streams' aggregate
    tokens/s, and the step time the floor on their ITL."""
    from ..decode import make_decoder, prefill

    steps = new_tokens - 1 if steps is None else steps
    ids = torch.tensor(prompts, device=model.device)
    cache = model.new_cache(len(prompts), ids.shape[1] + 1 + repeat * steps)
    start = time.perf_counter()
    with torch.no_grad():
        logits = prefill(model, cache, ids, chunk)
    prefill_s = time.perf_counter() - start
    decoder = make_decoder(model, cache)
    tokens = [logits.argmax(-1)]
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(steps):
            tokens.append(decoder.step(tokens[-1]).argmax(-1))
        best = min(best, (time.perf_counter() - start) / steps)
    return {"clients": len(prompts), "prefill_s": prefill_s, "step_ms": 1000 * best,
            "tok_s_total": len(prompts) * new_tokens / (prefill_s + (new_tokens - 1) * best),
            "tokens": torch.stack(tokens, 1).tolist()}  # each row's greedy continuation


def _thread_cpu_clock(thread):
    """A function giving `thread`'s CPU seconds so far (NaN where the platform cannot read
    another thread's CPU clock)."""
    try:
        clock = time.pthread_getcpuclockid(thread.ident)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return lambda: float("nan")
    return lambda: time.clock_gettime(clock)


def _gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:])]


def run(args) -> int:
    from ..decode import prefill
    from ..runtime import UserError, load_model, load_model_tokenizer
    from .report import announce, progress, write_csv

    if args.new_tokens < 2:
        raise UserError(f"--new-tokens must be >= 2 (a decode rate needs two tokens), got {args.new_tokens}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if (args.replicas or args.router_url) and args.scenario != "agents":
        raise UserError("--replicas and --router-url run the agents scenario: add --scenario agents")
    if args.replicas and args.router_url:
        raise UserError("--replicas starts a router; --router-url uses one: give one of them")
    if args.scenario == "agents" and (args.replicas or args.router_url):
        from . import agents

        return agents.run_routed(args, load_model_tokenizer(args.model))  # (the replicas load the model)
    model = load_model(args.model, device=args.device, dtype=args.dtype, quantized=args.quantized)
    tokenizer = load_model_tokenizer(args.model)
    if args.scenario == "agents":
        from . import agents

        return agents.run(args, model, tokenizer)
    if args.scenario == "pool":
        from . import pool

        return pool.run(args, model, tokenizer)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompts(n, length=args.prompt_len):
        return [torch.randint(vocab, (length,), generator=gen).tolist() for _ in range(n)]

    counts = sorted(set(args.clients))
    # Room for the long prompt beside the streams: a prefill starts only when a batch slot is free.
    max_batch = args.max_batch or max(*counts, args.stall_clients + 1)
    announce(f"bench serve: {args.model or 'built-in default'}, prompt {args.prompt_len} tokens, {args.new_tokens} new "
             f"tokens, clients {counts}, max batch {max_batch}, {torch.get_num_threads()} threads, greedy")
    cores = ("thread", "process") if args.engine_core == "both" else (args.engine_core,)
    # runs: direct decode, the model alone per count, then per server the engine alone and HTTP per count
    bar = progress(args.repeat + len(counts) + len(cores) * len(args.speculative_tokens) * 2 * len(counts)
                   + (args.stall_prompt_len > 0), "bench serve")
    bar.set_postfix_str("direct decode")
    bench_direct(model, prompts(1)[0][:8], 2, args.prefill_chunk)  # one-off first-call costs
    direct = []
    for _ in range(args.repeat):
        direct.append(bench_direct(model, prompts(1)[0], args.new_tokens, args.prefill_chunk))
        bar.update()
    direct = sorted(direct, key=lambda r: r["rates"][0])[args.repeat // 2]
    stall_prompt = prompts(1, args.stall_prompt_len)[0] if args.stall_prompt_len > 0 else None
    chunk_s = float("nan")
    if stall_prompt is not None:  # the same prompt's chunks, directly: the stall bound
        stamps = [time.perf_counter()]
        with torch.no_grad():
            prefill(model, model.new_cache(1, len(stall_prompt)), torch.tensor([stall_prompt], device=model.device),
                    args.prefill_chunk, on_chunk=lambda done, logits: stamps.append(time.perf_counter()))
        chunk_s = max(_gaps(stamps))

    ctx = max(args.prompt_len + args.new_tokens, args.stall_prompt_len + 1)
    if any(args.speculative_tokens) and getattr(model, "mtp", None) is None:
        raise UserError("--speculative-tokens needs a model with an MTP layer (mtp.* weights)")
    bar.clear()
    print(f"direct decode (1 sequence, nothing else running): {direct['rates'][0]:.1f} tok/s")
    floor = []
    for c in counts:
        bar.set_postfix_str(f"the model alone, {c} client(s)")
        floor.append(model_floor(model, prompts(c), args.new_tokens, args.prefill_chunk, repeat=args.repeat))
        bar.update()
    all_rows, first = [], None
    for core in cores:
        for n in args.speculative_tokens:
            # the same prompts for every value: the tokens, and so the work, are the same
            gen.manual_seed(1)
            rows = _serve_table(args, model, tokenizer, n, counts, max_batch, ctx, prompts,
                                stall_prompt if first is None else None, chunk_s, core, bar)
            if first is None:
                first = rows
            elif n != args.speculative_tokens[0]:
                print(f"--speculative-tokens {n} against {args.speculative_tokens[0]}, total tok/s: " + ", ".join(
                    f"{r['clients']} client(s) {r['tok_s_total'] / f['tok_s_total']:.2f}x"
                    for r, f in zip(rows, first) if r["clients"] == f["clients"]))
            all_rows += rows
    rows = all_rows
    bar.close()
    print_floor(floor)
    print_against_floor(rows, floor)
    if args.csv:
        write_csv(rows, args.csv)
    if args.plot:
        plot(rows, floor, args.plot)
    return 0


def print_against_floor(rows: list[dict], floor: list[dict]) -> None:
    """Each server's HTTP and engine-alone tok/s over the model alone's, its ITL p50 over the
    model's own step (the issue #35 targets: >= 0.9 / 0.85 and <= 1.15x), and the engine's mean
    decode-only iteration (no prefill chunk beside it) over the model's step, while HTTP streams run."""
    by_clients = {f["clients"]: f for f in floor}
    print("against the model alone: tok/s (HTTP, engine alone) / the model's; ITL p50 (HTTP) / the model's step; "
          "core step: the engine's mean iteration without a prefill chunk, while the HTTP streams ran / the "
          "model's step")
    print(f"{'engine':>8} {'spec':>4} {'clients':>7} {'HTTP tok/s':>11} {'engine tok/s':>13} {'ITL/step':>9} "
          f"{'core step/step':>15}")
    for r in rows:
        f = by_clients.get(r["clients"])
        if f is None:
            continue
        print(f"{r['engine_core']:>8} {r['speculative_tokens']:>4} {r['clients']:>7} "
              f"{r['tok_s_total'] / f['tok_s_total']:>11.2f} {r['alone_tok_s'] / f['tok_s_total']:>13.2f} "
              f"{r['itl_p50_ms'] / f['step_ms']:>9.2f} {r['core_step_ms'] / f['step_ms']:>15.2f}")


def plot(rows: list[dict], floor: list[dict], path: str) -> None:
    """tok/s and ITL p50 against streams: the model alone, and for each server its engine alone
    and HTTP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, itl) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [f["clients"] for f in floor]
    rate.plot(xs, [f["tok_s_total"] for f in floor], "k-o", label="model alone")
    itl.plot(xs, [f["step_ms"] for f in floor], "k-o", label="model alone (step)")
    servers = sorted({(r["engine_core"], r["speculative_tokens"]) for r in rows})
    for core, n in servers:
        mine = [r for r in rows if (r["engine_core"], r["speculative_tokens"]) == (core, n)]
        name = f"{core} engine" + (f", spec {n}" if n else "")
        cs = [r["clients"] for r in mine]
        rate.plot(cs, [r["alone_tok_s"] for r in mine], "--s", label=f"{name}: engine alone")
        rate.plot(cs, [r["tok_s_total"] for r in mine], "-^", label=f"{name}: HTTP")
        itl.plot(cs, [r["alone_itl_p50_ms"] for r in mine], "--s", label=f"{name}: engine alone")
        itl.plot(cs, [r["itl_p50_ms"] for r in mine], "-^", label=f"{name}: HTTP")
    for ax, label in ((rate, "tokens/s, all streams"), (itl, "ITL p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    rate.legend(fontsize=7)
    fig.suptitle("bench serve: the model alone, the engine alone, HTTP")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def print_floor(floor: list[dict]) -> None:
    print("the model alone (see model_floor: the prompts prefilled as one batch, then decode steps of every row; "
          "no sampler, scheduler or HTTP): the ceiling on tok/s and the floor on ITL for the tables above")
    print(f"{'clients':>7} {'prefill s':>10} {'step ms':>8} {'step vs 1':>10} {'tok/s total':>12} {'vs 1 client':>12}")
    one = floor[0] if floor[0]["clients"] == 1 else {"step_ms": float("nan"), "tok_s_total": float("nan")}
    for r in floor:
        r["step_vs_1"] = r["step_ms"] / one["step_ms"]
        r["vs_1_client"] = r["tok_s_total"] / one["tok_s_total"]
        print(f"{r['clients']:>7} {r['prefill_s']:>10.3f} {r['step_ms']:>8.2f} {r['step_vs_1']:>9.2f}x "
              f"{r['tok_s_total']:>12.1f} {r['vs_1_client']:>11.2f}x")


def _core_arguments(args, config, threads: int):
    """`serve` arguments for an engine core process with `config` (serve.cli's parser)."""
    from serve.cli import build_parser

    argv = ["--device", str(args.device), "--dtype", args.dtype, "--quantized", args.quantized,
            "--ctx", str(config.ctx), "--prefill-chunk", str(config.prefill_chunk), "--max-queue",
            str(config.max_queue), "--max-batch", str(config.max_batch), "--max-sessions", str(config.max_sessions),
            "--speculative-tokens", str(config.speculative_tokens), "--speculative-policy", config.speculative_policy,
            "--log-level", "warning"]
    if args.model:
        argv += ["--model", args.model]
    if config.speculative_max_batch:
        argv += ["--speculative-max-batch", str(config.speculative_max_batch)]
    return build_parser().parse_args(argv)


def _serve_table(args, model, tokenizer, n, counts, max_batch, ctx, prompts, stall_prompt, chunk_s,
                 engine_core: str = "thread", bar=None) -> list[dict]:
    """One server (`--speculative-tokens n`, its engine on a thread of this process or in an
    engine core process) through every client count: its table printed, its rows. `bar` (a
    progress bar) counts its runs."""
    def step(what: str):  # the previous run is done (the first call: none was), this one starts
        if bar is not None:
            bar.update(int(bool(step.started)))
            bar.set_postfix_str(what)
            step.started = True
    step.started = False

    import os

    from serve.http.app import ServerConfig, create_app
    from serve.background import BackgroundServer

    config = ServerConfig(model_name="bench", ctx=ctx, prefill_chunk=args.prefill_chunk,
                          max_queue=max(64, max(counts)), max_batch=max_batch,
                          max_sessions=max(max_batch, max(counts) + 1, 16), speculative_tokens=n,
                          speculative_max_batch=args.speculative_max_batch,
                          speculative_policy=args.speculative_policy)
    core = None
    if engine_core == "process":
        from serve.core.client import CoreClient
        from serve.core.process import spawn_core

        threads = str(torch.get_num_threads())  # the core's model runs on as many threads as this one's
        saved, os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS"), threads
        try:
            core = spawn_core(_core_arguments(args, config, threads))
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        app = create_app(model, tokenizer, config, engine=CoreClient.connect(core, tokenizer))
    else:
        app = create_app(model, tokenizer, config)
    rows = []
    stall = None
    engine = app.state.engine

    def host_counters():
        t = engine.timing()
        parts = [t[f"{p}_s"] for p in ("model", "sampling", "host")]
        # the output part: in this process with a thread engine, the core client's reader thread with a core
        return t["host_cpu_s"] + t["output_cpu_s"] + t.get("api_cpu_s", 0.0), t["decode_rows"], t["steps"], parts, \
            [t["verify_steps"], t["emitted_tokens"]], t.get("api_cpu_s", 0.0), (t["decode_only_steps"],
                                                                                t["decode_only_s"])

    with BackgroundServer(app) as srv:
        loop_cpu = _thread_cpu_clock(srv.thread)
        alone = []
        for c in counts:  # the engine alone, in-process: the same work without HTTP and the client process
            step(f"engine ({engine_core}, speculative tokens {n}) alone, {c} client(s)")
            r = run_engine(engine, prompts(c), args.new_tokens)
            gaps = [g for s in r["stamps"] for g in _gaps(s)]
            alone.append({"clients": c, "tok_s_total": r["tokens"] / r["wall"], "itl_p50_ms": 1000 * _pct(gaps, 50),
                          "itl_p99_ms": 1000 * _pct(gaps, 99)})
        for c, by_itself in zip(counts, alone):
            cpu0, rows0, steps0, parts0, spec0, api0, only0 = host_counters()
            loop0 = loop_cpu()
            step(f"HTTP ({engine_core}, speculative tokens {n}), {c} client(s)")
            r = run_clients(srv.url, prompts(c), args.new_tokens)
            engine.output.flush(10)
            cpu1, rows1, steps1, parts1, spec1, api1, only1 = host_counters()
            loop_s = loop_cpu() - loop0
            steps = max(1.0, steps1 - steps0)
            split = {f"step_{p}_ms": 1000 * (b - a) / steps for p, a, b in zip(("model", "sampling", "host"), parts0,
                                                                                parts1)}
            verify = spec1[0] - spec0[0]
            gaps = [g for s in r["stamps"] for g in _gaps(s)]
            rows.append({"clients": c, "speculative_tokens": n, "tok_s_total": r["tokens"] / r["wall"],
                         "ttft_p50_s": _pct(r["ttft"], 50),
                         "ttft_p99_s": _pct(r["ttft"], 99), "itl_p50_ms": 1000 * _pct(gaps, 50),
                         "itl_p99_ms": 1000 * _pct(gaps, 99),
                         "host_us_per_seq_step": 1e6 * (cpu1 - cpu0) / max(1, rows1 - rows0),
                         "mean_batch": (rows1 - rows0) / steps, "client_cores": r["client_cores"],
                         "loop_us_per_token": 1e6 * loop_s / max(1, r["tokens"]),
                         # the API process's CPU per token: its event loop, and with a core its reader thread
                         "api_us_per_token": 1e6 * (loop_s + api1 - api0) / max(1, r["tokens"]),
                         "core_step_ms": 1000 * (only1[1] - only0[1]) / max(1, only1[0] - only0[0]),
                         "engine_core": engine_core,
                         "alone_tok_s": by_itself["tok_s_total"], "alone_itl_p50_ms": by_itself["itl_p50_ms"],
                         "acceptance_length": (spec1[1] - spec0[1]) / verify if verify else float("nan"), **split})
        if stall_prompt is not None:
            step(f"a {len(stall_prompt)}-token prompt arriving mid-stream")
            r = run_clients(srv.url, prompts(args.stall_clients), 4 * args.new_tokens, late=stall_prompt)
            lo, hi = r["window"]
            inside = [b - a for s in r["stamps"] for a, b in zip(s, s[1:]) if b > lo and a < hi]
            outside = [b - a for s in r["stamps"] for a, b in zip(s, s[1:]) if b <= lo or a >= hi]
            stall = {"max_gap_ms": 1000 * max(inside, default=float("nan")),
                     "itl_p50_ms": 1000 * _pct(outside, 50), "chunk_ms": 1000 * chunk_s,
                     "prefill_s": hi - lo}
    if core is not None:
        core.wait(60)
    if bar is not None:
        bar.update()  # the last run
        bar.clear()
    base = rows[0]["tok_s_total"] if rows and rows[0]["clients"] == 1 else float("nan")
    print(f"the engine {'in a core process of its own' if core is not None else 'on a thread of the HTTP process'}:")
    if n:
        print(f"--speculative-tokens {n} (accept len: tokens per verify step, the bonus token included):")
    print(f"{'clients':>7} {'tok/s total':>12} {'vs 1 client':>12} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>9} {'ITL p99':>9} {'ITL vs 1':>9} {'host us/seq/step':>17} {'step ms: model':>15} "
          f"{'sampling':>9} {'host':>6} {'loop us/token':>13} {'API us/token':>12} {'client cores':>12}"
          + (f" {'accept len':>10}" if n else ""))
    for r in rows:
        r["vs_1_client"] = r["tok_s_total"] / base
        r["itl_vs_1_client"] = r["itl_p50_ms"] / rows[0]["itl_p50_ms"] if rows[0]["clients"] == 1 else float("nan")
        print(f"{r['clients']:>7} {r['tok_s_total']:>12.1f} {r['vs_1_client']:>11.2f}x {r['ttft_p50_s']:>8.3f}s "
              f"{r['ttft_p99_s']:>8.3f}s {r['itl_p50_ms']:>7.1f}ms {r['itl_p99_ms']:>7.1f}ms "
              f"{r['itl_vs_1_client']:>8.2f}x {r['host_us_per_seq_step']:>17.1f} {r['step_model_ms']:>15.2f} "
              f"{r['step_sampling_ms']:>9.2f} {r['step_host_ms']:>6.2f} {r['loop_us_per_token']:>13.1f} "
              f"{r['api_us_per_token']:>12.1f} "
              f"{r['client_cores']:>12.2f}"
              + (f" {r['acceptance_length']:>10.2f}" if n else ""))
    print("(tok/s total: all tokens / wall time, prefill and queueing included; TTFT: request sent -> first token; "
          "ITL: gap between consecutive tokens of one stream; host us/seq/step: CPU time of the engine and output "
          "threads outside the model and the sampler, per sequence per decode step; step ms: the engine's mean decode "
          "iteration split into the model (and any prefill chunk beside it), the sampler and the rest; loop us/token: CPU time "
          "of the server's event loop (HTTP, SSE, the API views) per streamed token; API us/token: the HTTP "
          "process's CPU per token (its event loop and, with an engine core, the thread turning its messages into "
          "text); client cores: the "
          "client process's CPU time over the wall time, the share of this machine's cores the clients took)")
    print("the engine alone (the same streams submitted by this process to its engine: with a core, over its socket; "
          "no HTTP, SSE or client process):")
    print(f"{'clients':>7} {'tok/s total':>12} {'vs 1 client':>12} {'ITL p50':>9} {'ITL p99':>9} {'ITL vs 1':>9}")
    for r in alone:
        r["vs_1_client"] = r["tok_s_total"] / alone[0]["tok_s_total"]
        r["itl_vs_1_client"] = r["itl_p50_ms"] / alone[0]["itl_p50_ms"]
        print(f"{r['clients']:>7} {r['tok_s_total']:>12.1f} {r['vs_1_client']:>11.2f}x {r['itl_p50_ms']:>7.1f}ms "
              f"{r['itl_p99_ms']:>7.1f}ms {r['itl_vs_1_client']:>8.2f}x")
    if stall is not None:
        print(f"a {args.stall_prompt_len}-token prompt arriving while {args.stall_clients} streams decode: prefilled "
              f"in {stall['prefill_s']:.2f} s; largest gap any stream saw meanwhile {stall['max_gap_ms']:.1f} ms "
              f"(ITL p50 outside it {stall['itl_p50_ms']:.1f} ms; its slowest {args.prefill_chunk}-token chunk, "
              f"prefilled directly, {stall['chunk_ms']:.1f} ms)")
    return rows
