"""What every benchmark writes besides its printed table: what it will do and its progress (on
stderr, from the start), the CSV, the machine's description."""
from __future__ import annotations

import csv
import platform
import sys


def write_csv(rows: list[dict], path) -> None:
    """A benchmark's table as CSV: one row per dict; the header holds every row's keys in the order
    they first appear (a row without one leaves its cell empty)."""
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def print_table(title: str, header: str, lines) -> None:
    """A benchmark's table: its title line, the header, a rule as wide, then one line per row."""
    print(title)
    print(header)
    print("-" * len(header))
    for line in lines:
        print(line)


def machine() -> str:
    """The CPU a table was measured on: model name, core count and torch's SIMD level, e.g.
    "AMD EPYC, 2 cores, AVX512"."""
    import os

    import torch

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}"


_pending: list[str] = []  # the target's announcement, said with its first plan or progress bar


def announce(text: str, pending: bool = False) -> None:
    """What a benchmark is about to do, on stderr before its first measurement (its tables come at
    the end, on stdout). `pending`: said only when the benchmark starts (its first `announce` or
    `progress`), so a bad argument found before that stays a one-line error."""
    if pending:
        _pending[:] = [text]
        return
    for line in [*_pending, text]:
        print(line, file=sys.stderr, flush=True)
    _pending.clear()


def progress(total: int, desc: str, unit: str = "run"):
    """A progress bar on stderr over a benchmark's `total` units of work (tqdm; `.update()` per
    unit, a context manager)."""
    from tqdm import tqdm

    if _pending:
        print(_pending.pop(), file=sys.stderr, flush=True)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
