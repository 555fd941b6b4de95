"""Fault injection for recovery tests: env `DS4_TORCH_FAULT`.

Grammar: comma-separated `SITE:N[:KIND[:always]]`
- SITE  `prefill` | `decode` | `restore` | `submit`: where the engine calls `fault_point(SITE)`
        (a prefill chunk and a decode step once their forward ran, where an asynchronous device
        error surfaces; the first step after a disk restore; the engine core taking a submit);
- N     the 1-based occurrence of that site in this process that fails;
- KIND  `device` (default: a RuntimeError worded like a CUDA error), `oom`
        (`torch.OutOfMemoryError`) or `slow` (no error: the site takes `DS4_TORCH_FAULT_SLOW_S`
        seconds, default 2);
- `always`: every occurrence from the N-th on fails, not just the N-th.
Example: `DS4_TORCH_FAULT=prefill:2,decode:5:oom` fails the second prefill chunk and the fifth
decode step of the process.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

SITES = ("prefill", "decode", "restore", "submit")
KINDS = ("device", "oom", "slow")
ENV = "DS4_TORCH_FAULT"
SLOW_ENV = "DS4_TORCH_FAULT_SLOW_S"


class InjectedDeviceError(RuntimeError):
    """Stands in for an asynchronous CUDA/Metal error surfacing at a synchronization point."""


@dataclass(frozen=True)
class FaultRule:
    site: str
    occurrence: int
    kind: str = "device"
    always: bool = False

    def fires(self, count: int) -> bool:
        return count >= self.occurrence if self.always else count == self.occurrence


def parse_faults(spec: str) -> list[FaultRule]:
    """Parse the `DS4_TORCH_FAULT` grammar; a malformed spec raises ValueError naming the part."""
    rules = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        if not 2 <= len(fields) <= 4:
            raise ValueError(f"{ENV}: {part!r} is not SITE:N[:KIND[:always]]")
        site, n = fields[0], fields[1]
        kind = fields[2] if len(fields) > 2 and fields[2] else "device"
        always = len(fields) == 4
        if site not in SITES:
            raise ValueError(f"{ENV}: unknown site {site!r} in {part!r}; sites: {', '.join(SITES)}")
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"{ENV}: occurrence {n!r} in {part!r} must be an integer >= 1")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown kind {kind!r} in {part!r}; kinds: {', '.join(KINDS)}")
        if always and fields[3] != "always":
            raise ValueError(f"{ENV}: the fourth field of {part!r} can only be 'always'")
        rules.append(FaultRule(site, int(n), kind, always))
    return rules


_lock = threading.Lock()
_counts = {site: 0 for site in SITES}
_cached: tuple[str, list[FaultRule]] = ("", [])


def _rules() -> list[FaultRule]:
    global _cached
    spec = os.environ.get(ENV, "")
    if spec != _cached[0]:
        _cached = (spec, parse_faults(spec))
    return _cached[1]


def fault_point(site: str) -> None:
    """Count one occurrence of `site` and raise if a rule says this one fails."""
    rules = _rules()
    with _lock:
        _counts[site] += 1
        count = _counts[site]
    for rule in rules:
        if rule.site == site and rule.fires(count):
            message = f"injected {rule.kind} fault at {site} #{count} ({ENV})"
            if rule.kind == "slow":
                time.sleep(float(os.environ.get(SLOW_ENV, "2")))
                continue
            if rule.kind == "oom":
                raise torch.OutOfMemoryError(f"CUDA out of memory: {message}")
            raise InjectedDeviceError(f"CUDA error: an illegal memory access was encountered: {message}")


def reset_fault_counts() -> None:
    """Start counting occurrences from zero again (tests use this between scenarios)."""
    with _lock:
        for site in SITES:
            _counts[site] = 0
