"""The seeded simulation of the engine (`simulation.py`, which says what a run generates and
checks), over fixed seeds chosen to cover its features between them: tenants, shared prefixes,
branches and regenerates, `n` > 1, stop strings, speculation, the graph path, a disk store,
injected faults, reclaim, eviction and preemption, a request that overflows.

- `DS4_SIM_SEED=S` runs seed S alone (a failing seed's message gives this command);
- `DS4_SIM_SECONDS=N` also runs random seeds for N seconds and prints the totals.
"""
from __future__ import annotations

import os
import random
import time
from collections import Counter

import pytest

from simulation import REPLAY, simulate

# Between them: every feature of the generator, and each of the defects of issue #43 the engine
# level can show, found when its fix is reverted (1: a request's NaN reaching others, through the
# reference attention's masking; rows past a table on the scratch row fail the slot-map check at
# once; 4: a failed forward's blocks staying registered; 5: a preemption for nothing (a plain step
# reserving a verify step's room: seeds 18, 37), or again before progress (2, 18, 37)).
# (Seed 4, an OOM in a decode step and a device error in a prefill chunk, finding 4, was dropped:
# both its faults fire in the seeds below, each seed's 2 faults counted by its report: a decode
# OOM in 860494638, prefill device errors in 18, 32 and 37; 4 is found by 32 and 37.)
SEEDS = [2,    # a disk store: evictions written and restored; 2 tenants; a restore OOM (finds 1, 5)
         18,   # speculation, a disk store, 3 tenants, 3 batch slots, step faults (finds 5)
         32,   # two prefill faults, one tenant, 2 batch slots (finds 1, 4)
         37,   # speculation over 4 batch slots in a 7-block pool, step faults (finds 4, 5)
         55,   # the graph path (the capture emulator), a disk store, restore faults
         860494638]  # n > 1 greedy choices preempted, then a failed step: its retry must not bring them
                     # back without room (found by a 20-minute run; finds 5 too)
if os.environ.get("DS4_SIM_SEED"):
    SEEDS = [int(os.environ["DS4_SIM_SEED"])]


def failure(report) -> str:
    return "\n".join([report.line(), f"plan: {report.plan}", *report.problems[:20],
                      f"replay: {REPLAY.format(seed=report.seed)}"])


@pytest.mark.parametrize("seed", SEEDS)
def test_seed(model, tok, seed):
    report = simulate(seed, model, tok)
    assert not report.problems, failure(report)
    c = report.counts
    assert c["requests"] and c["done"], report.line()  # it served something


def test_the_fixed_seeds_cover_the_features(model, tok):
    """The plans of the fixed seeds (not their runs) hold every feature between them."""
    from simulation import Plan

    plans = [Plan.of(s) for s in SEEDS]
    if len(plans) == 1:
        return  # (one seed replayed)
    assert any(p.speculative for p in plans) and any(not p.speculative for p in plans)
    assert {p.decode_mode for p in plans} == {"eager", "graph"}
    assert any(p.disk for p in plans) and any(len(p.tenants) == 3 for p in plans)
    assert {f.split(":")[0] for p in plans for f in p.faults.split(",") if f} >= {"prefill", "decode"}
    assert {f.split(":")[2] for p in plans for f in p.faults.split(",") if f} == {"device", "oom"}
    sites_kinds = {(f.split(":")[0], f.split(":")[2]) for p in plans for f in p.faults.split(",") if f}
    assert sites_kinds >= {(site, kind) for site in ("prefill", "decode") for kind in ("device", "oom")}


if os.environ.get("DS4_SIM_SECONDS"):
    def test_random_seeds_for_a_while(model, tok):
        """Random seeds for DS4_SIM_SECONDS seconds; the totals are printed (`-s` shows them)."""
        budget, start = float(os.environ["DS4_SIM_SECONDS"]), time.monotonic()
        seed, totals, bad = random.SystemRandom().randrange(10**6, 10**9), Counter(), []
        while time.monotonic() - start < budget:
            report = simulate(seed, model, tok)
            totals.update(report.counts)
            totals["seeds"] += 1
            if report.problems:
                bad.append(failure(report))
            seed += 1
        print(f"\nsimulation: {totals['seeds']} seeds in {time.monotonic() - start:.0f} s: {totals['requests']} requests "
              f"({totals['done']} done, {totals['failed']} failed, {totals['cancelled']} cancelled, {totals['refused']} "
              f"refused), {totals['faults']} faults injected, {totals['preemptions']} preemptions, {totals['evictions']} "
              f"session evictions, {totals['reclaimed']} cached blocks reclaimed, {totals['disk_saves']} disk saves, "
              f"{totals['disk_restores']} disk restores, {totals['iterations']} engine iterations; "
              f"{len(bad)} seed(s) failed")
        assert not bad, "\n\n".join(bad)
