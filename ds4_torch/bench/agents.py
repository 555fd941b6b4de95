"""`ds4-torch bench serve --scenario agents`: how much of what agents send the server prefills again.

8 conversations, 2 at a time, share one system prompt (`--system-tokens`, default 6,000). Each
has 5 turns (user messages of about `--user-tokens`, replies of `--new-tokens`, greedy), through
`/v1/chat/completions` as a client sends them (the whole conversation every time, replies sent
back as text). Every conversation also regenerates its third reply and edits its fourth user
message (the edited one replaces it), and 2 of them drop their last assistant turn and retry.
Run twice on a fresh server each: checkpoints on (`--checkpoint-interval`) and off (0). Printed:
requests, prompt tokens, tokens reused (the usage's cached tokens), tokens actually prefilled,
the reuse fraction, the wall time, the KV pool's peak bytes (blocks held at once) and the sessions
resident at the end.

Through a router (`run_routed`): `--replicas N` starts N `python -m serve` replicas (each with
`--kv-events`) behind vllm-router, a fresh set for each of `--policies` (round_robin, cache_aware,
kv_aware by default), and runs the same conversations through each (streamed, to time the first
token); `--router-url URL` runs them once through a router already running. Printed per policy:
requests, prompt tokens, reused, the reuse of every request and of the later ones (each
conversation's requests after its first: the ones a router can send to the replica holding the
conversation), the later ones' tokens prefilled again, and time to first token (p50, p90).
"""
from __future__ import annotations

import concurrent.futures
import logging
import random
import time

CONVERSATIONS = 8
AT_A_TIME = 2
TURNS = 5
RETRYING = 2  # conversations that drop their last assistant turn and retry
REQUESTS = CONVERSATIONS * (TURNS + 2) + RETRYING  # per run: each turn, a regenerate, an edit; the retries
WORDS = ("the company rehearses scenes before the evening performance while the prompter follows every line "
         "and the players wait behind the painted flats for their cues").split()


def _text(tokenizer, n_tokens: int, seed: int) -> str:
    """Prose of about `n_tokens` tokens, its own for each `seed` (messages of different
    conversations must not coincide, or the server would rightly reuse them)."""
    rng, words = random.Random(seed), []
    while True:
        words.append(rng.choice(WORDS))
        if len(words) % 16 == 0 and len(tokenizer.encode(" ".join(words), add_special_tokens=False)) >= n_tokens:
            return " ".join(words)


def _ask(http, url: str, msgs: list[dict], new_tokens: int) -> tuple[dict, str]:
    """One streamed chat request: ({prompt, cached, ttft}, the reply's text)."""
    import json

    start, ttft, usage, text = time.perf_counter(), None, None, []
    body = {"model": "bench", "messages": msgs, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta") or {}
                if ttft is None and any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls")):
                    ttft = time.perf_counter() - start
                text.append(delta.get("content") or "")
    if usage is None:
        raise RuntimeError("the stream ended without its usage")
    return ({"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"],
             "ttft": ttft if ttft is not None else time.perf_counter() - start}, "".join(text))


def _conversation(http, url: str, c: int, system: str, users: list[str], edit: str, new_tokens: int,
                  bar=None) -> list[dict]:
    """One conversation's requests, in order: each {prompt tokens, cached tokens, time to first token};
    `bar` counts them."""
    out = []

    def ask(turns):
        msgs = [{"role": "system", "content": system}] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        stats, reply = _ask(http, url, msgs, new_tokens)
        out.append(stats)
        if bar is not None:
            bar.update()
        return reply

    turns: list[str] = []
    for t in range(TURNS):
        turns.append(users[t])
        reply = ask(turns)
        if t == 2:                 # regenerate the third reply
            reply = ask(turns)
        if t == 3:                 # edit the fourth user message
            turns[-1] = edit
            reply = ask(turns)
        turns.append(reply)
    if c < RETRYING:               # drop the last assistant turn and retry
        ask(turns[:-1])
    return out


def _jobs(tokenizer, user_tokens: int) -> list[tuple[int, list[str], str]]:
    """Each conversation's user messages and the edit of its fourth."""
    return [(c, [_text(tokenizer, user_tokens, 100 * c + t + 1) for t in range(TURNS)],
             _text(tokenizer, user_tokens, 100 * c + 99)) for c in range(CONVERSATIONS)]


def _converse(url: str, system: str, jobs, new_tokens: int, what: str) -> tuple[list[list[dict]], float]:
    """Every conversation through `url`, AT_A_TIME at once, a progress bar saying `what`: (each one's
    requests, wall seconds)."""
    import httpx

    from .report import progress

    with httpx.Client(timeout=3600) as http, progress(REQUESTS, what, unit="request") as bar:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(AT_A_TIME) as pool:
            results = list(pool.map(lambda j: _conversation(http, url, j[0], system, j[1], j[2], new_tokens, bar),
                                    jobs))
        return results, time.perf_counter() - start


def _totals(results: list[list[dict]]) -> dict:
    """Prompt tokens, reused, the reuse of every request and of the later ones (each conversation's
    requests after its first), time to first token (p50, p90) over all requests."""
    reqs = [r for conv in results for r in conv]
    later = [r for conv in results for r in conv[1:]]
    prompt, cached = sum(r["prompt"] for r in reqs), sum(r["cached"] for r in reqs)
    ttfts = sorted(r["ttft"] for r in reqs)
    return {"requests": len(reqs), "prompt_tokens": prompt, "reused": cached, "prefilled": prompt - cached,
            "reuse": cached / prompt, "later_reuse": sum(r["cached"] for r in later) / sum(r["prompt"] for r in later),
            "later_prefilled": sum(r["prompt"] - r["cached"] for r in later),
            "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]}


def run_scenario(model, tokenizer, *, system_tokens: int, user_tokens: int, new_tokens: int, interval: int,
                 prefill_chunk: int, memory_mb: float) -> dict:
    from serve.http.app import ServerConfig, create_app
    from serve.background import BackgroundServer

    system = _text(tokenizer, system_tokens, 0)
    config = ServerConfig(model_name="bench", ctx=_context(system_tokens, user_tokens, new_tokens),
                          prefill_chunk=prefill_chunk, max_batch=AT_A_TIME, checkpoint_interval=interval,
                          checkpoint_memory_mb=memory_mb, access_log=False)
    app = create_app(model, tokenizer, config)
    logging.getLogger("ds4").setLevel(logging.ERROR)  # the small model's stray markup is logged per reply
    with BackgroundServer(app) as srv:
        results, wall = _converse(srv.url, system, _jobs(tokenizer, user_tokens), new_tokens,
                                  f"agents, checkpoints {f'every {interval}' if interval else 'off'}")
        metrics = app.state.metrics
        branches, rewinds = metrics.value("ds4_branches_total"), metrics.value("ds4_rewinds_total")
        engine = app.state.engine
        peak_pool = engine.runner.pool.peak_used * engine.replica.kv.block_nbytes
        held = sum(1 for s in engine.sessions if s.tokens)
    return {"checkpoints": f"every {interval}" if interval else "off", **_totals(results), "wall_s": wall,
            "branches": int(branches), "rewinds": int(rewinds), "peak_pool_bytes": peak_pool, "sessions_held": held}


def _context(system_tokens: int, user_tokens: int, new_tokens: int) -> int:
    return system_tokens + 2 * TURNS * (user_tokens + new_tokens) + 256


def run(args, model, tokenizer) -> int:
    from .report import announce, machine, print_table, write_csv

    announce(f"agents: {CONVERSATIONS} conversations, {AT_A_TIME} at a time, on a {args.system_tokens}-token system "
             f"prompt, {REQUESTS} requests through /v1/chat/completions, twice, each on a fresh server: checkpoints "
             f"every {args.checkpoint_interval} tokens, then off (about 4 minutes on a 2-core CPU with the defaults; "
             f"the table comes at the end)")
    rows = []
    for interval in (args.checkpoint_interval, 0):
        rows.append(run_scenario(model, tokenizer, system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                                 new_tokens=args.new_tokens, interval=interval, prefill_chunk=args.prefill_chunk,
                                 memory_mb=args.checkpoint_memory_mb))
    header = (f"{'checkpoints':>11} {'requests':>8} {'prompt tok':>10} {'reused':>8} {'prefilled':>9} {'reuse':>6} "
              f"{'wall s':>7} {'branches':>8} {'rewinds':>7} {'peak pool MiB':>13} {'sessions held':>13}")
    print_table(
        f"agents: {CONVERSATIONS} conversations, {AT_A_TIME} at a time, a {args.system_tokens}-token system prompt, "
        f"{TURNS} turns (user ~{args.user_tokens} tokens, replies {args.new_tokens}); {machine()}", header,
        [f"{r['checkpoints']:>11} {r['requests']:>8} {r['prompt_tokens']:>10} {r['reused']:>8} {r['prefilled']:>9} "
         f"{100 * r['reuse']:>5.1f}% {r['wall_s']:>7.1f} {r['branches']:>8} {r['rewinds']:>7} "
         f"{r['peak_pool_bytes'] / 2**20:>13.2f} {r['sessions_held']:>13}" for r in rows])
    if args.csv:
        write_csv(rows, args.csv)
    return 0


# --------------------------------------------------------------------------- through a router
def replica_args(args, ctx: int) -> list[str]:
    """The `serve` flags of each replica: this run's model, device and dtype, the scenario's context
    and checkpoints, and as many decoding at once as conversations run at once."""
    out = ["--ctx", str(ctx), "--prefill-chunk", str(args.prefill_chunk), "--max-batch", str(AT_A_TIME),
           "--checkpoint-interval", str(args.checkpoint_interval),
           "--checkpoint-memory-mb", str(args.checkpoint_memory_mb), "--served-model-name", "bench",
           "--device", args.device, "--dtype", args.dtype, "--quantized", args.quantized,
           "--access-log", "off", "--log-level", "warning"]
    return out + (["--model", args.model] if args.model else [])


def run_routed(args, tokenizer) -> int:
    """The conversations through vllm-router: in front of `--replicas N` fresh replicas per policy
    (`--policies`, each in its own run), or at `--router-url` (one run, whatever is behind it)."""
    from ..runtime import UserError
    from .replicas import replicas_behind_router, router_executable
    from .report import announce, machine, print_table, write_csv

    announce(f"agents through vllm-router: {CONVERSATIONS} conversations, {AT_A_TIME} at a time, {REQUESTS} requests "
             f"per run, " + (f"at {args.router_url}" if args.router_url else
                             f"{args.replicas} fresh replicas per policy ({', '.join(args.policies)}); each run "
                             f"starts its replicas and router first (minutes per policy on a 2-core CPU)"))
    system = _text(tokenizer, args.system_tokens, 0)
    jobs = _jobs(tokenizer, args.user_tokens)
    rows = []
    if args.router_url:
        results, wall = _converse(args.router_url.rstrip("/"), system, jobs, args.new_tokens, "agents via the router")
        rows.append({"policy": args.router_url, **_totals(results), "wall_s": wall})
    else:
        executable = router_executable(args.router)
        if executable is None:
            raise UserError("--replicas needs vllm-router: pip install 'vllm-router==0.1.17' (a prebuilt wheel for "
                            "Linux x86-64), or give its path with --router")
        serve_args = replica_args(args, _context(args.system_tokens, args.user_tokens, args.new_tokens))
        for policy in args.policies:
            with replicas_behind_router(args.replicas, serve_args, policy, executable) as (router, _):
                results, wall = _converse(router.url, system, jobs, args.new_tokens, f"agents, {policy}")
            rows.append({"policy": policy, **_totals(results), "wall_s": wall})
    where = f"through {args.router_url}" if args.router_url else f"{args.replicas} replicas behind vllm-router"
    header = (f"{'policy':>12} {'requests':>8} {'prompt tok':>10} {'reused':>8} {'reuse':>6} {'later turns':>11} "
              f"{'later prefilled':>15} {'TTFT p50 s':>10} {'TTFT p90 s':>10} {'wall s':>7}")
    print_table(
        f"agents {where}: {CONVERSATIONS} conversations, {AT_A_TIME} at a time, a {args.system_tokens}-token system "
        f"prompt, {TURNS} turns (user ~{args.user_tokens} tokens, replies {args.new_tokens}), checkpoints every "
        f"{args.checkpoint_interval}; {machine()}", header,
        [f"{r['policy']:>12} {r['requests']:>8} {r['prompt_tokens']:>10} {r['reused']:>8} {100 * r['reuse']:>5.1f}% "
         f"{100 * r['later_reuse']:>10.1f}% {r['later_prefilled']:>15} {r['ttft_p50_s']:>10.3f} "
         f"{r['ttft_p90_s']:>10.3f} {r['wall_s']:>7.1f}"
         for r in rows])
    if args.csv:
        write_csv(rows, args.csv)
    return 0
