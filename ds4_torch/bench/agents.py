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


def _conversation(http, url: str, c: int, system: str, users: list[str], edit: str, new_tokens: int,
                  bar=None) -> list[dict]:
    """One conversation's requests: each (prompt tokens, cached tokens); `bar` counts them."""
    out = []

    def ask(turns):
        msgs = [{"role": "system", "content": system}] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        r = http.post(url + "/v1/chat/completions", json={
            "model": "bench", "messages": msgs, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        body = r.json()
        usage = body["usage"]
        out.append({"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]})
        if bar is not None:
            bar.update()
        return body["choices"][0]["message"]["content"] or ""

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


def run_scenario(model, tokenizer, *, system_tokens: int, user_tokens: int, new_tokens: int, interval: int,
                 prefill_chunk: int, memory_mb: float) -> dict:
    import httpx

    from .report import progress

    from serve.http.app import ServerConfig, create_app
    from serve.background import BackgroundServer

    system = _text(tokenizer, system_tokens, 0)
    ctx = system_tokens + 2 * TURNS * (user_tokens + new_tokens) + 256
    config = ServerConfig(model_name="bench", ctx=ctx, prefill_chunk=prefill_chunk, max_batch=AT_A_TIME,
                          checkpoint_interval=interval, checkpoint_memory_mb=memory_mb, access_log=False)
    app = create_app(model, tokenizer, config)
    logging.getLogger("ds4").setLevel(logging.ERROR)  # the small model's stray markup is logged per reply
    jobs = [(c, [_text(tokenizer, user_tokens, 100 * c + t + 1) for t in range(TURNS)],
             _text(tokenizer, user_tokens, 100 * c + 99)) for c in range(CONVERSATIONS)]
    bar = progress(REQUESTS, f"agents, checkpoints {f'every {interval}' if interval else 'off'}", unit="request")
    with BackgroundServer(app) as srv, httpx.Client(timeout=3600) as http, bar:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(AT_A_TIME) as pool:
            results = list(pool.map(lambda j: _conversation(http, srv.url, j[0], system, j[1], j[2], new_tokens,
                                                            bar), jobs))
        wall = time.perf_counter() - start
        metrics = app.state.metrics
        branches, rewinds = metrics.value("ds4_branches_total"), metrics.value("ds4_rewinds_total")
        engine = app.state.engine
        peak_pool = engine.runner.pool.peak_used * engine.replica.kv.block_nbytes
        held = sum(1 for s in engine.sessions if s.tokens)
    reqs = [r for conv in results for r in conv]
    prompt = sum(r["prompt"] for r in reqs)
    cached = sum(r["cached"] for r in reqs)
    return {"checkpoints": f"every {interval}" if interval else "off", "requests": len(reqs),
            "prompt_tokens": prompt, "reused": cached, "prefilled": prompt - cached,
            "reuse": cached / prompt, "wall_s": wall, "branches": int(branches), "rewinds": int(rewinds),
            "peak_pool_bytes": peak_pool, "sessions_held": held}


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
