"""`ds4-torch bench speculative`: single-stream decode with and without MTP speculation, in the
same run (interleaved, best of `--repeats` each), with the acceptance length, the cost ratios
that explain the speed-up, and what that acceptance would give DeepSeek-V4-Flash.

Speed-up model: a step emits `a` tokens (the acceptance length) for one verify forward of 1 + N
tokens with its rollback (cost `v` decode steps) and the MTP work: a catch-up pass over the 1 + N
verified positions and N - 1 one-token drafting passes, with their rollbacks (cost `m` decode
steps in all), so speed-up = a / (v + m). V4-Flash at batch 1 is bound by reading its weights: a
verify of a few tokens costs about one decode step (v = 1; more in truth, as its tokens route to
more experts) and its MTP block is one layer of 43 (N passes, m = N/43).
"""
from __future__ import annotations

import time

import torch

from .report import announce, machine, progress

DEFAULT_PROMPT = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
                  "Arise, fair sun, and kill the envious moon,\n")
FLASH_LAYERS = 43


def _decode_time(model, prompt, new_tokens, n, stats=None, mode="eager"):
    from ..generation import generate

    tokens, first = [], None
    for t in generate(model, prompt, new_tokens, prefill_chunk=len(prompt), speculative_tokens=n, stats=stats,
                      decode_mode=mode):
        if first is None:
            first = time.perf_counter()
        tokens.append(t)
    return time.perf_counter() - first, tokens


@torch.inference_mode()
def cost_ratios(model, prompt, n, repeats=50) -> tuple[float, float]:
    """(verify forward of 1 + n tokens with its rollback, the step's MTP passes with theirs), each
    in decode steps (the fastest of `repeats` interleaved runs), at the prompt's end."""
    from ..cache import Rollback

    cache = model.new_cache(1, len(prompt) + n + 1)
    ids = torch.tensor([prompt])
    _, streams = model._forward(ids, cache, return_streams=True)
    keep, none = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)

    def step():
        model._forward(ids[:, -1:], cache)
        cache.positions.sub_(1)  # back to the same position: only the time matters here

    def verify():
        undo = Rollback()
        model._forward(ids[:, -1 - n:], cache, logits_to_keep=n + 1, return_streams=True, undo=undo)
        undo.apply(none)

    def mtp():
        undo = Rollback()
        model.mtp_forward(streams[:, -1 - n:], ids[:, -1 - n:], cache, undo=undo, select=none)
        undo.apply(keep)
        for _ in range(n - 1):
            undo = Rollback()
            model.mtp_forward(streams[:, -1:], ids[:, -1:], cache, logits_to_keep=1, undo=undo)
            undo.apply(none)
        cache.mtp.positions.sub_(1)

    best = {fn: float("inf") for fn in (step, verify, mtp)}
    for _ in range(repeats):  # interleaved, the fastest of each: a busy moment of the machine hits one run
        for fn in best:
            start = time.perf_counter()
            fn()
            best[fn] = min(best[fn], time.perf_counter() - start)
    return best[verify] / best[step], best[mtp] / best[step]


def run(args) -> int:
    from ..runtime import UserError, load_model
    from ..speculative import SpeculationStats
    from ..tokenizer import load_tokenizer

    model = load_model(args.model, device=args.device, dtype=args.dtype)
    if getattr(model, "mtp", None) is None:
        raise UserError("this model has no MTP layer (mtp.* weights): nothing to speculate with")
    if args.model:
        tok = load_tokenizer(args.model)
    else:
        from ..default_model import default_tokenizer

        tok = default_tokenizer()
    prompt = tok.encode(args.prompt or DEFAULT_PROMPT)
    announce(f"bench speculative: {args.model or 'built-in default'}, prompt {len(prompt)} tokens, {args.new_tokens} new "
             f"tokens, {torch.get_num_threads()} threads, {args.dtype}, greedy, {args.decode_mode}; {machine()}; best of "
             f"{args.repeats} interleaved runs")
    print(f"{'draft tokens':>12} {'decode tok/s':>13} {'speed-up':>9} {'drafted':>8} {'accepted':>9} {'accept len':>11} "
          f"{'verify cost':>12} {'MTP cost':>9} {'predicted':>10} {'V4-Flash':>9} {'identical':>10}")
    rows = []
    bar = progress(args.repeats * (1 + 2 * len(args.speculative_tokens)), "bench speculative")
    for n in [0, *args.speculative_tokens]:
        plain_s, spec_s, stats = [], [], SpeculationStats()
        for _ in range(args.repeats):  # interleaved, so a noisy stretch of the machine hits both alike
            t, plain = _decode_time(model, prompt, args.new_tokens, 0, mode=args.decode_mode)
            plain_s.append(t)
            bar.update()
            if n:
                stats = SpeculationStats()
                t, tokens = _decode_time(model, prompt, args.new_tokens, n, stats, args.decode_mode)
                spec_s.append(t)
                bar.update()
        base = (args.new_tokens - 1) / min(plain_s)
        if not n:
            print(f"{0:>12} {base:>13.1f} {1.0:>8.2f}x {'-':>8} {'-':>9} {1.0:>11.2f}")
            rows.append({"draft_tokens": 0, "decode_tok_s": base, "speedup": 1.0})
            continue
        speed = (args.new_tokens - 1) / min(spec_s)
        verify, mtp = cost_ratios(model, prompt, n)
        a = stats.acceptance_length
        predicted, flash = a / (verify + mtp), a / (1 + n / FLASH_LAYERS)
        same = f"{sum(x == y for x, y in zip(tokens, plain))}/{len(plain)}"
        print(f"{n:>12} {speed:>13.1f} {speed / base:>8.2f}x {stats.drafted:>8} {stats.accepted:>9} {a:>11.2f} "
              f"{verify:>12.2f} {mtp:>9.2f} {predicted:>9.2f}x {flash:>8.2f}x {same:>10}")
        rows.append({"draft_tokens": n, "decode_tok_s": speed, "speedup": speed / base, "drafted": stats.drafted,
                     "accepted": stats.accepted, "acceptance_length": a, "verify_cost": verify, "mtp_cost": mtp,
                     "predicted_speedup": predicted, "v4_flash_speedup": flash})
    bar.close()
    print("speed-up: against plain decoding of the same run; drafted/accepted: draft tokens of the last run; accept "
          "len: tokens emitted per verify step (bonus included); costs in decode steps: verify = the 1 + N token "
          "forward and its rollback, MTP = the step's N MTP passes (catch-up over 1 + N positions, N - 1 drafts) "
          f"with theirs; predicted = accept len / (verify + MTP); V4-Flash = accept len / (1 + N/{FLASH_LAYERS}): a "
          f"weight-bound verify costs about one step, its MTP block one layer of {FLASH_LAYERS}")
    if args.csv:
        from .report import write_csv

        write_csv(rows, args.csv)
    return 0
