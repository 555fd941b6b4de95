"""What every benchmark writes besides its printed table."""
from __future__ import annotations

import csv


def write_csv(rows: list[dict], path) -> None:
    """A benchmark's table as CSV: one row per dict, the first row's keys as the header."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
