"""`ds4-torch bench serve`: HTTP streaming throughput against direct decode, in one run.

1. Direct: `ds4_torch.generate` on the model (same prefill chunk as the server), timing the
   first token and the decode rate ((tokens - 1) / time from the first token to the last).
2. HTTP: a local server (uvicorn on a background thread, the same model object) and 1, then N,
   concurrent streaming clients (in a separate process) (httpx, `/v1/completions`, prompts of random token ids, distinct
   per client so no prefix is reused, greedy, `return_token_ids` so every token arrives in its own
   SSE chunk and is counted exactly). Per client: time to first token (request sent -> first token
   chunk received) and tokens/s ((tokens - 1) / first-to-last token). Total tokens/s: all tokens /
   wall time of the run.

The engine serves one request at a time (batch 1), so with N clients the total rate stays near the
direct rate while time to first token grows with the queue.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

import torch


def add_arguments(p) -> None:
    from ..runtime import add_model_arguments, positive_int

    add_model_arguments(p)
    p.add_argument("--clients", type=positive_int, default=4, help="concurrent streaming clients (default 4)")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--prompt-len", type=positive_int, default=256, help="prompt tokens per request (default 256)")
    p.add_argument("--prefill-chunk", type=positive_int, default=256, help="prefill chunk (default 256)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--repeat", type=positive_int, default=3,
                   help="direct and 1-client HTTP runs, alternated; the median is reported (default 3)")
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


async def _client(http, url: str, prompt: list[int], new_tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    start = time.perf_counter()
    stamps: list[float] = []
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices", ()):
                now = time.perf_counter()
                stamps.extend([now] * len(choice.get("token_ids") or ()))
    return {"ttft": stamps[0] - start, "rate": (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1
            else float("nan"), "tokens": len(stamps)}


async def _run_clients(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(_client(http, url, p, new_tokens) for p in prompts))
        wall = time.perf_counter() - start
    return {"ttft": [r["ttft"] for r in results], "rates": [r["rate"] for r in results],
            "tokens": sum(r["tokens"] for r in results), "wall": wall}


def _client_main() -> None:
    """Entry point of the client process: spec as JSON on stdin, results as JSON on stdout."""
    spec = json.load(sys.stdin)
    json.dump(asyncio.run(_run_clients(spec["url"], spec["prompts"], spec["new_tokens"])), sys.stdout)


def run_clients(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """The clients run in a separate process, as real clients would: in this one they would
    compete with the server's threads for the GIL and slow down what is being measured."""
    import os
    import subprocess

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", "from ds4_torch.bench.serve import _client_main; _client_main()"],
                          input=json.dumps({"url": url, "prompts": prompts, "new_tokens": new_tokens}),
                          capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"the client process failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


def _median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["rates"][0])[len(runs) // 2]


def run(args) -> int:
    from serve.app import ServerConfig, create_app
    from serve.runner import BackgroundServer

    from ..runtime import UserError, load_model, load_model_tokenizer
    from .report import write_csv

    if args.new_tokens < 2:
        raise UserError(f"--new-tokens must be >= 2 (a decode rate needs two tokens), got {args.new_tokens}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    tokenizer = load_model_tokenizer(args.model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompts(n):
        return [torch.randint(vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(n)]

    print(f"bench serve: {args.model or 'built-in default'}, prompt {args.prompt_len} tokens, {args.new_tokens} new "
          f"tokens, {args.clients} clients, {torch.get_num_threads()} threads, greedy, 1-client runs x{args.repeat}",
          file=sys.stderr)
    bench_direct(model, prompts(1)[0][:8], 2, args.prefill_chunk)  # one-off first-call costs

    config = ServerConfig(model_name="bench", ctx=args.prompt_len + args.new_tokens,
                          prefill_chunk=args.prefill_chunk, max_queue=max(64, args.clients))
    app = create_app(model, tokenizer, config)
    direct, http1 = [], []
    with BackgroundServer(app) as srv:
        # Direct and 1-client HTTP runs alternate, so load from elsewhere on the machine hits both alike.
        for _ in range(args.repeat):
            direct.append(bench_direct(model, prompts(1)[0], args.new_tokens, args.prefill_chunk))
            http1.append(run_clients(srv.url, prompts(1), args.new_tokens))
        results = {"direct": _median_run(direct), "http x1": _median_run(http1)}
        if args.clients > 1:
            results[f"http x{args.clients}"] = run_clients(srv.url, prompts(args.clients), args.new_tokens)

    direct_rate = results["direct"]["rates"][0]
    rows = []
    for name, r in results.items():
        per_client = statistics.mean(r["rates"])
        rows.append({
            "run": name, "clients": len(r["ttft"]), "ttft_p50_s": _pct(r["ttft"], 50), "ttft_p99_s": _pct(r["ttft"], 99),
            "tok_s_per_client": per_client, "tok_s_total": r["tokens"] / r["wall"],
            "vs_direct_decode": per_client / direct_rate,
        })
    print(f"{'run':<16} {'clients':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s/client':>13} {'tok/s total':>12} "
          f"{'vs direct':>10}")
    for r in rows:
        print(f"{r['run']:<16} {r['clients']:>7} {r['ttft_p50_s']:>8.3f}s {r['ttft_p99_s']:>8.3f}s "
              f"{r['tok_s_per_client']:>13.1f} {r['tok_s_total']:>12.1f} {r['vs_direct_decode']:>9.1%}")
    print("(tok/s per client: decode rate seen by each client, first to last token; total: all tokens / wall time "
          "including prefill and queueing; vs direct: per-client rate / direct decode rate; 1-client rows: the run "
          "with the median rate)")
    if args.csv:
        write_csv(rows, args.csv)
    return 0
