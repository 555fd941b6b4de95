"""`ds4-torch bench context`: prefill and decode speed as the context grows, with the cache sized
as `serve` sizes it by default (the model's maximum context), so the table shows what a long
prompt costs and that decode stays nearly flat: the compressed layers read a row per 4 or 16
tokens (CSA's top-k of them), and only the sliding window reads tokens one by one."""

from __future__ import annotations

import time

import torch

from .report import announce, machine, progress, write_csv
from ..decode import make_decoder, prefill


def run(args) -> int:
    from ..runtime import UserError, load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    capacity = args.ctx or model.config.max_position_embeddings
    longest = max(args.contexts) + args.new_tokens
    if longest > capacity:
        raise UserError(f"context {max(args.contexts)} + {args.new_tokens} new tokens does not fit the cache "
                        f"({capacity} tokens; --ctx)")
    announce(f"bench context: {args.model or 'built-in default'}, cache of {capacity} tokens, prefill chunks of "
             f"{args.prefill_chunk}, {args.new_tokens} decode steps, {args.dtype}, {torch.get_num_threads()} threads; "
             f"{machine()}")
    g = torch.Generator().manual_seed(0)
    rows = []
    bar = progress(sum(args.contexts) + len(args.contexts) * args.new_tokens, "bench context", unit="token")
    for context in args.contexts:
        prompt = torch.randint(2, model.config.vocab_size, (1, context), generator=g).to(model.device)
        cache = model.new_cache(1, capacity)
        start = time.perf_counter()
        done = [0]

        def tick(tokens_done, _logits):
            bar.update(tokens_done - done[0])
            done[0] = tokens_done

        logits = prefill(model, cache, prompt, chunk=args.prefill_chunk, on_chunk=tick)
        prefill_s = time.perf_counter() - start
        decoder = make_decoder(model, cache, "eager")
        token = logits.argmax(-1)
        times = []
        for _ in range(args.new_tokens):
            t0 = time.perf_counter()
            token = decoder.step(token).argmax(-1)
            times.append(time.perf_counter() - t0)
            bar.update()
        times.sort()
        median = times[len(times) // 2]
        rows.append({"context": context, "prefill_tok_s": round(context / prefill_s, 1),
                     "decode_tok_s": round(1 / median, 1), "decode_ms": round(median * 1000, 2)})
        bar.clear()
        print(f"context {context:>8,}: prefill {rows[-1]['prefill_tok_s']:>9,.1f} tok/s ({prefill_s:.1f} s)   "
              f"decode {rows[-1]['decode_tok_s']:>7,.1f} tok/s ({rows[-1]['decode_ms']} ms/token, median of "
              f"{args.new_tokens})", flush=True)
    bar.close()
    if len(rows) > 1:
        print(f"decode at {rows[-1]['context']:,} / at {rows[0]['context']:,}: "
              f"{rows[-1]['decode_tok_s'] / rows[0]['decode_tok_s']:.2f}x")
    if args.csv:
        write_csv(rows, args.csv)
    return 0
