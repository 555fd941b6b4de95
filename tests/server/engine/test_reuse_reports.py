"""The reuse reports' bookkeeping (serve.engine.reuse), without a model: the quick path a request
whose reuse is full takes gives the same report as comparing everything, and what is remembered
of evicted conversations stays within its bounds. (Through the server: tests/server/http/test_cache_explain.py.)"""
from __future__ import annotations

import random

import serve.engine.reuse as reuse
from serve.engine.prefix_index import PrefixIndex
from serve.engine.reuse import ReuseReports


def brute_common(sequences, prompt):
    best = 0
    for tokens in sequences:
        n = 0
        while n < min(len(tokens), len(prompt)) and tokens[n] == prompt[n]:
            n += 1
        best = max(best, n)
    return best


def test_the_quick_path_reports_what_comparing_everything_reports(monkeypatch):
    rng = random.Random(0)
    trunk = [rng.randrange(3) for _ in range(60)]
    index = PrefixIndex(4)
    reports = ReuseReports(index)
    live, gone = {}, {}
    for key in range(16):
        tenant = rng.choice(["a", "b"])
        tokens = trunk[:rng.randint(0, 60)] + [rng.randrange(3) for _ in range(rng.randint(0, 20))]
        if key % 2:
            index.add(key, tenant, tokens, [p for p in (8, 24, 40) if p <= len(tokens)])
            live[key] = (tenant, tokens)
        elif tokens:
            reports.left(tokens, tenant, rng.choice(["sessions", "pool"]), rng.random() < 0.3)
            gone[key] = (tenant, tokens)
    seen = set()
    for i in range(400):
        base = rng.choice([trunk, *(t for _, t in [*live.values(), *gone.values()])])  # near a known one
        prompt = base[:rng.randint(1, len(base))] + [rng.randrange(3) for _ in range(rng.randint(0, 6))]
        tenant = rng.choice(["a", "b"])
        chain = index.chain(prompt)
        match = index.match(tenant, prompt, chain=chain)
        reused = rng.choice([match.reuse, rng.randint(0, match.reuse)])
        quick = reports.finish(f"q{i}", tenant, reports.look(tenant, prompt, chain, match, reused), reused, "checkpoint")
        with monkeypatch.context() as m:
            m.setattr(PrefixIndex, "shares", lambda *a: True)  # every probe says "maybe": everything compared
            full = reports.finish(f"f{i}", tenant, reports.look(tenant, prompt, chain, match, reused), reused,
                                  "checkpoint")
        assert {k: v for k, v in quick.items() if k != "request"} == {k: v for k, v in full.items() if k != "request"}
        same = brute_common([t for ten, t in [*live.values(), *gone.values()] if ten == tenant], prompt)
        if quick["reason"] not in ("new", "full"):
            assert quick["shared"] == same > reused
        else:
            assert same <= reused or (same == len(prompt) and reused == len(prompt) - 1)
        seen.add(quick["reason"])
    assert {"full", "diverged", "no_checkpoint"} <= seen and seen & {"evicted", "pool", "evicted_to_disk"}


def test_evicted_conversations_are_remembered_within_bounds(monkeypatch):
    monkeypatch.setattr(reuse, "DEPARTED_TOKENS", 100)
    monkeypatch.setattr(reuse, "DEPARTED_SEQUENCES", 3)
    reports = ReuseReports(PrefixIndex(4))
    reports.left(list(range(10)), None, "sessions", False)
    reports.left(list(range(20)), None, "sessions", False)  # extends the first: it replaces it
    assert len(reports.departed) == 1
    for k in range(4):
        reports.left([100 + k] * 30, None, "pool", False)
    assert len(reports.departed) <= 3 and reports._departed_tokens <= 100
    reports.left(list(range(500, 700)), None, "sessions", False)  # longer than all of it: not kept
    assert reports._departed_tokens <= 100 and sum(n for *_, n in reports._departed.values()) == \
        reports._departed_tokens
