"""`ds4-torch bench serve --scenario pool`: what the server's paged KV pool holds (`--kv-cache-mb`).

1. **Shared prompt.** `--chats` chats (default 16) on one system prompt (`--system-tokens`,
   default 6,000), each with its own question of about `--user-tokens` (500 here), sent at once
   into a pool of `--kv-cache-mb` (default 8 MiB), as token ids through `/v1/completions`, greedy,
   `--new-tokens` each. Printed: the replies answered and how many equal the same prompt decoded
   alone (`ds4_torch.generate`: what a fresh server gives), the pool's peak and final blocks against what holding the prompt once
   takes ((shared + own tokens) x bytes per token, plus a block per chat), and each chat's second
   turn's reused tokens (all of the first turn, when every chat stayed resident).
2. **Long sessions.** Conversations of `--session-tokens` (default 12,000) distinct tokens, one
   after another into the same pool, until two more than it holds have been sent: after each, the
   pool's fill, the sessions resident and evicted, and the status (never a 5xx).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time

from .agents import _text


def _server(model, tokenizer, *, ctx: int, kv_cache_mb: float, chats: int, prefill_chunk: int):
    from serve.http.app import ServerConfig, create_app
    from serve.background import BackgroundServer

    config = ServerConfig(model_name="bench", ctx=ctx, prefill_chunk=prefill_chunk, max_batch=chats,
                          max_sessions=max(chats + 2, 16), kv_cache_mb=kv_cache_mb, access_log=False)
    app = create_app(model, tokenizer, config)
    return app, BackgroundServer(app)


def _ask(http, url: str, prompt: list[int], new_tokens: int) -> dict:
    r = http.post(url + "/v1/completions", json={"model": "bench", "prompt": prompt, "max_tokens": new_tokens,
                                                 "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    if r.status_code != 200:
        return {"status": r.status_code, "text": r.text[:200]}
    body = r.json()
    usage = body["usage"]
    return {"status": 200, "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "tokens": body["choices"][0]["token_ids"]}


def _ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    return tokenizer.encode(_text(tokenizer, n_tokens, seed), add_special_tokens=False)[:n_tokens]


def shared_prompt(model, tokenizer, *, chats: int, system_tokens: int, user_tokens: int, new_tokens: int,
                  kv_cache_mb: float, prefill_chunk: int) -> dict:
    """Scenario 1 (see the module docstring): its numbers."""
    import httpx

    from ds4_torch.generation import generate

    from .report import progress

    system = _ids(tokenizer, system_tokens, 0)
    prompts = [system + _ids(tokenizer, user_tokens, 1000 + c) for c in range(chats)]
    ctx = system_tokens + 2 * (user_tokens + new_tokens) + 512
    app, server = _server(model, tokenizer, ctx=ctx, kv_cache_mb=kv_cache_mb, chats=chats, prefill_chunk=prefill_chunk)
    engine = app.state.engine
    pool, block_bytes = engine.runner.pool, engine.replica.kv.block_nbytes
    bar = progress(3 * chats, "pool: chats on one system prompt", unit="request")  # first, second turn, alone

    def ask(prompt, n):
        out = _ask(http, srv.url, prompt, n)
        bar.update()
        return out

    with server as srv, httpx.Client(timeout=3600) as http:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(chats) as ex:
            firsts = list(ex.map(lambda p: ask(p, new_tokens), prompts))
        wall = time.perf_counter() - start
        peak, after_first = pool.peak_used, pool.num_used
        reused = []  # per chat: its second turn's reused tokens less its first prompt's
        for c, (prompt, first) in enumerate(zip(prompts, firsts)):
            if first["status"] == 200:
                second = ask(prompt + first["tokens"] + _ids(tokenizer, 20, 5000 + c), 4)
                reused.append(second["cached"] - len(prompt) if second["status"] == 200 else None)
        evicted = app.state.metrics.value("ds4_session_evictions_total")
        preempted = app.state.metrics.value("ds4_preemptions_total")
    # Each chat alone, as a fresh server decodes it: the library's greedy generation of its prompt.
    same = 0
    for prompt, first in zip(prompts, firsts):
        same += first["status"] == 200 and first["tokens"] == list(generate(model, prompt, new_tokens))
        bar.update()
    bar.close()
    own = sum(len(p) - len(system) + new_tokens for p in prompts)
    bound = (len(system) + own) * block_bytes / pool.block_tokens + chats * block_bytes
    return {"chats": chats, "answered": sum(f["status"] == 200 for f in firsts), "same_as_alone": same,
            "shared_tokens": len(system), "own_tokens": own, "pool_blocks": pool.num_blocks,
            "peak_bytes": peak * block_bytes, "after_bytes": after_first * block_bytes, "bound_bytes": bound,
            "peak_vs_bound": peak * block_bytes / bound,
            "second_turn_reused_min": min((r for r in reused if r is not None), default=None),
            "evicted": int(evicted), "preempted": int(preempted), "wall_s": wall}


def long_sessions(model, tokenizer, *, session_tokens: int, kv_cache_mb: float, prefill_chunk: int,
                  new_tokens: int) -> list[dict]:
    """Scenario 2 (see the module docstring): one row per session sent."""
    import httpx

    from .report import progress

    ctx = session_tokens + new_tokens + 512
    app, server = _server(model, tokenizer, ctx=ctx, kv_cache_mb=kv_cache_mb, chats=2, prefill_chunk=prefill_chunk)
    engine = app.state.engine
    pool = engine.runner.pool
    holds = pool.num_blocks * pool.block_tokens // session_tokens
    rows = []
    bar = progress(holds + 2, "pool: long sessions", unit="session")
    with server as srv, httpx.Client(timeout=3600) as http, bar:
        for s in range(holds + 2):
            r = _ask(http, srv.url, _ids(tokenizer, session_tokens, 7000 + s), new_tokens)
            bar.update()
            rows.append({"session": s + 1, "status": r["status"], "fill": pool.num_used / pool.num_blocks,
                         "resident": sum(1 for x in engine.sessions if x.tokens),
                         "evicted": int(app.state.metrics.value("ds4_session_evictions_total"))})
    return rows


def run(args, model, tokenizer) -> int:
    from .report import machine, print_table, write_csv

    logging.getLogger("ds4").setLevel(logging.ERROR)  # the small model's stray markup is logged per reply
    user_tokens = args.user_tokens if args.user_tokens != 100 else 500  # (100 is the agents scenario's default)
    one = shared_prompt(model, tokenizer, chats=args.chats, system_tokens=args.system_tokens, user_tokens=user_tokens,
                        new_tokens=args.new_tokens, kv_cache_mb=args.kv_cache_mb, prefill_chunk=args.prefill_chunk)
    mib = 2**20
    print_table(
        f"pool, shared prompt: {one['chats']} chats at once, a {args.system_tokens}-token system prompt, questions of "
        f"~{user_tokens} tokens, {args.new_tokens} new tokens, --kv-cache-mb {args.kv_cache_mb}; {machine()}",
        f"{'answered':>8} {'same as alone':>13} {'peak MiB':>8} {'after MiB':>9} {'bound MiB':>9} {'peak/bound':>10} "
        f"{'2nd turn reuse - 1st prompt':>27} {'evicted':>7} {'preempted':>9} {'wall s':>7}",
        [f"{one['answered']:>8} {one['same_as_alone']:>13} {one['peak_bytes'] / mib:>8.2f} "
         f"{one['after_bytes'] / mib:>9.2f} {one['bound_bytes'] / mib:>9.2f} {one['peak_vs_bound']:>10.2f} "
         f"{one['second_turn_reused_min']!s:>27} {one['evicted']:>7} {one['preempted']:>9} {one['wall_s']:>7.1f}"])
    print()
    rows = long_sessions(model, tokenizer, session_tokens=args.session_tokens, kv_cache_mb=args.kv_cache_mb,
                         prefill_chunk=args.prefill_chunk, new_tokens=args.new_tokens)
    print_table(f"pool, long sessions: {args.session_tokens} distinct tokens each, one after another, "
                f"--kv-cache-mb {args.kv_cache_mb}",
                f"{'session':>7} {'status':>6} {'pool fill':>9} {'resident':>8} {'evicted':>7}",
                [f"{r['session']:>7} {r['status']:>6} {100 * r['fill']:>8.1f}% {r['resident']:>8} {r['evicted']:>7}"
                 for r in rows])
    if args.csv:
        write_csv([one] + rows, args.csv)
    return 0 if one["answered"] == one["chats"] and all(r["status"] == 200 for r in rows) else 1

