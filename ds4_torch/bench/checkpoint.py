"""`ds4-torch bench checkpoint`: cache checkpoints at V4-Flash's real layout (43 layers: 2 sliding,
21 CSA, 20 HCA; window 128, head_dim 512, indexer 128), no weights needed.

A cache of two sequences at each context; sequence 0 holds `context - 64` tokens (a synthetic
state: the timings do not depend on the values). Per context, the median of `repeats` runs of:

- `take`: `take_checkpoint` of sequence 0 (fixed size, whatever the position);
- `restore`: rewinding sequence 0 in place to a checkpoint 64 tokens back (`restore_checkpoint`:
  layout checks, the ring and open windows copied, later rows cleared);
- `branch`: sequence 1 from sequence 0's rows and that checkpoint (`branch_from_checkpoint`:
  the rows copied, so it grows with the position);
- `import`: `import_checkpoint`, the full value check a checkpoint read from disk gets;
- `copy`: `copy_sequence` of the whole sequence, the peer: what a fork costs today.
"""
from __future__ import annotations

import statistics
import time

import torch

from .report import machine, print_table, progress, write_csv
from ..cache import DS4Cache
from ..config import v4_flash_config as flash_config  # (the name tests and callers use)

BACK = 64  # tokens between the checkpoint and the sequence's end
TIMED = ("take_ms", "restore_ms", "branch_ms", "import_ms", "copy_sequence_ms")


def _synthetic(cache: DS4Cache, index: int, n: int) -> None:
    """Make sequence `index` a state of `n` tokens that passes every check (values all zero)."""
    cache.reset(index)
    for layer in cache.layers:
        for state in layer.states:
            if state.prev_gate is not None and n >= layer.rate:
                state.prev_gate[index] = 0  # a window has closed: the overlap is finite
    cache.positions[index] = n


def _median_ms(fn, before, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        before()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[1:])


def run(contexts=(4096, 65536), dtype: torch.dtype = torch.bfloat16, device="cpu", repeats: int = 5,
        csv_path=None) -> list[dict]:
    device = torch.device(device)
    config = flash_config()
    rows = []
    bar = progress(len(contexts), "bench checkpoint", unit="context")
    for ctx in contexts:
        if ctx <= BACK:
            raise ValueError(f"context {ctx} must exceed {BACK} tokens")
        cache = DS4Cache(config, batch_size=2, max_context=ctx, dtype=dtype, device=device)
        end, at = ctx - BACK, ctx - 2 * BACK
        _synthetic(cache, 0, at)
        checkpoint = cache.take_checkpoint(0)
        on_host = {k: t.cpu() for k, t in checkpoint.items()}
        _synthetic(cache, 0, end)

        def noop():
            pass

        def back_to_end():
            cache.positions[0] = end

        rows.append({
            "context": ctx, "checkpoint_at": at, "checkpoint_bytes": cache.checkpoint_nbytes(),
            "take_ms": _median_ms(lambda: cache.take_checkpoint(0), noop, repeats, device),
            "restore_ms": _median_ms(lambda: cache.restore_checkpoint(0, checkpoint), back_to_end, repeats, device),
            "branch_ms": _median_ms(lambda: cache.branch_from_checkpoint(1, 0, checkpoint), back_to_end, repeats,
                                    device),
            "import_ms": _median_ms(lambda: cache.import_checkpoint(on_host), noop, repeats, device),
            "copy_sequence_ms": _median_ms(lambda: cache.copy_sequence(1, 0), back_to_end, repeats, device),
        })
        del cache
        bar.update()
    bar.close()
    where = machine() if device.type == "cpu" else torch.cuda.get_device_name(device)
    print_table(f"checkpoints, V4-Flash layout, {str(dtype).removeprefix('torch.')}, {device}; {where}, "
                f"{torch.get_num_threads()} thread(s); median of {repeats}",
                f"{'context':>8} {'ckpt at':>8} {'bytes':>11} " + " ".join(f"{k[:-3] + ' ms':>12}" for k in TIMED),
                (f"{r['context']:>8} {r['checkpoint_at']:>8} {r['checkpoint_bytes']:>11,} " +
                 " ".join(f"{r[k]:>12.2f}" for k in TIMED) for r in rows))
    if csv_path:
        write_csv(rows, csv_path)
    return rows
