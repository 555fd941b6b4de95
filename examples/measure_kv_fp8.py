"""FP8 compressed rows against the full-precision cache: prompt logprobs on held-out text.

The embedded model reads held-out text in segments of `--length` tokens (the first `--segments` of
them; default all), prefilled in chunks of `--chunk`, once per KV row format
(`ds4_torch.kv_format`: "full", "fp8", "fp8-keep-rope"). An fp8 cache stores every compressed and
indexer row as fp8 when it is written and dequantizes it where it is read, so later chunks (and
later queries of the same chunk) read the rounded rows. For each fp8 format: the mean |NLL
difference| per token against "full" (nats), the top-1 agreement of the next-token argmax, and
the bytes per token of the caches it used.

The text: by default the 2,400 characters of held-out Tiny Shakespeare the repository ships
(`tests/data/tinyshakespeare_held_out.txt`, 1,061 tokens: one segment of 1,024); with the whole
Tiny Shakespeare (not shipped), `--held-out 0.1` reads the last 10%, the split training held out:

    python examples/measure_kv_fp8.py                                   # seconds
    python examples/measure_kv_fp8.py --text tinyshakespeare.txt --held-out 0.1 --length 4096
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from ds4_torch.default_model import build_default_model, default_tokenizer

SHIPPED = Path(__file__).resolve().parents[1] / "tests" / "data" / "tinyshakespeare_held_out.txt"


def prompt_logprobs(model, ids: torch.Tensor, kv_rows: str, chunk: int, progress=None) -> tuple[torch.Tensor, float]:
    """Log-probabilities [B, L, vocab] of every next token, prefilling `ids` [B, L] in chunks,
    and the bytes per token of context of the cache it used. `progress` (a tqdm bar) counts chunks."""
    B, L = ids.shape
    cache = model.new_cache(B, L, kv_rows=kv_rows)
    out = []
    for s in range(0, L, chunk):
        out.append(torch.log_softmax(model(ids[:, s:s + chunk], cache).float(), dim=-1))
        if progress is not None:
            progress.update()
    return torch.cat(out, dim=1), cache.nbytes / (B * L)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", default=str(SHIPPED),
                   help="the text (default: the held-out slice of Tiny Shakespeare in tests/data)")
    p.add_argument("--held-out", type=float, default=1.0,
                   help="the last fraction of the text read (default 1: all of it; 0.1 for the whole Tiny "
                        "Shakespeare, the split its training held out)")
    p.add_argument("--length", type=int, default=1024, help="tokens per segment (default 1024)")
    p.add_argument("--segments", type=int, default=None, help="segments read (default: every one)")
    p.add_argument("--chunk", type=int, default=32, help="prefill chunk (default 32)")
    p.add_argument("--formats", default="fp8,fp8-keep-rope")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    text = text[int(len(text) * (1 - args.held_out)):]
    tokens = default_tokenizer().encode(text)
    n = len(tokens) // args.length
    if args.segments is not None:
        n = min(n, args.segments)
    if n == 0:
        raise SystemExit(f"the held-out text has {len(tokens)} tokens, fewer than --length {args.length}")
    print(f"measure_kv_fp8: {n} segment(s) of {args.length} tokens of {args.text} (the last {args.held_out:g} of "
          f"it), prefilled in chunks of {args.chunk}, once per format: full, {args.formats}", file=sys.stderr)
    ids = torch.tensor(tokens[:n * args.length]).view(n, args.length)
    model = build_default_model()
    targets = ids[:, 1:]
    formats = args.formats.split(",")
    bar = tqdm(total=(1 + len(formats)) * -(-args.length // args.chunk), desc="prefill chunks", unit="chunk")
    with torch.inference_mode(), bar:
        ref, full_bytes = prompt_logprobs(model, ids, "full", args.chunk, bar)
        ref = ref[:, :-1]
        ref_nll = -ref.gather(-1, targets[..., None])[..., 0]
        result = {"tokens": int(targets.numel()), "segments": n, "length": args.length, "chunk": args.chunk,
                  "full_nll": ref_nll.mean().item(), "full_cache_bytes_per_token": full_bytes}
        for fmt in formats:
            lp, cache_bytes = prompt_logprobs(model, ids, fmt, args.chunk, bar)
            lp = lp[:, :-1]
            nll = -lp.gather(-1, targets[..., None])[..., 0]
            result[fmt] = {"nll": nll.mean().item(), "mean_abs_nll_diff": (nll - ref_nll).abs().mean().item(),
                           "top1_agreement": (lp.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                           "cache_bytes_per_token": cache_bytes}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
