"""The prefix index against a brute-force reference: random sequences over a small alphabet (so
prefixes are shared, and diverge inside blocks and on their edges), random checkpoints, growth,
rewinds, removals and tenants; every answer compared with a direct scan of all sequences."""
from __future__ import annotations

import random

import pytest

from serve.engine.prefix_index import CHECKPOINT, END, PrefixIndex, PrefixMatch


def common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def brute_force(registry, tenant, prompt, max_reuse=None):
    """(common, reuse, sources) by scanning every sequence of `tenant`."""
    best_common, reuse, sources = 0, 0, set()
    for key, (t, tokens, checkpoints) in registry.items():
        if t != tenant:
            continue
        lcp = common(tokens, prompt)
        best_common = max(best_common, lcp)
        for p, kind in [(p, CHECKPOINT) for p in checkpoints] + [(len(tokens), END)]:
            if p <= lcp and (max_reuse is None or p <= max_reuse):
                if p > reuse:
                    reuse, sources = p, set()
                if p == reuse:
                    sources.add((key, kind))
    return best_common, reuse, sources


def check(index, registry, tenant, prompt, max_reuse=None):
    got = index.match(tenant, prompt, max_reuse)
    want_common, want_reuse, want_sources = brute_force(registry, tenant, prompt, max_reuse)
    assert (got.common, got.reuse, set(got.sources)) == (want_common, want_reuse, want_sources), prompt
    chain = index.chain(prompt)  # hashed once, handed to the lookups: the same answers
    assert index.match(tenant, prompt, max_reuse, chain=chain) == got
    for n in range(len(prompt) + 2):
        assert index.shares(tenant, prompt, n, chain) == (bool(registry) and tenant in index.tenants()
                                                          and want_common >= n and n <= len(prompt)), (prompt, n)
    if got.common:  # the key it names really shares that much
        t, tokens, _ = registry[got.common_key]
        assert t == tenant and common(tokens, prompt) == got.common
    else:
        assert got.common_key is None


def variant(rng, base, alphabet):
    """A prompt sharing a random prefix of `base`, then random tokens."""
    cut = rng.randint(0, len(base))
    return base[:cut] + [rng.randrange(alphabet) for _ in range(rng.randint(0, 12))]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_matches_a_brute_force_scan(block_size):
    rng = random.Random(block_size)
    alphabet = 3
    index, registry = PrefixIndex(block_size), {}
    trunk = [rng.randrange(alphabet) for _ in range(40)]  # a shared "system prompt"
    for step in range(300):
        action = rng.random()
        keys = list(registry)
        if action < 0.25 or not keys:
            key = f"s{step}"
            tenant = rng.choice(["alice", "bob"])
            tokens = variant(rng, trunk, alphabet) if rng.random() < 0.7 else \
                [rng.randrange(alphabet) for _ in range(rng.randint(0, 50))]
            checkpoints = sorted(rng.sample(range(len(tokens) + 1), min(3, len(tokens) + 1)))
            index.add(key, tenant, tokens, checkpoints)
            registry[key] = (tenant, list(tokens), set(checkpoints))
        elif action < 0.45:
            key = rng.choice(keys)
            more = [rng.randrange(alphabet) for _ in range(rng.randint(0, 20))]
            index.extend(key, more)
            registry[key][1].extend(more)
            if rng.random() < 0.5:
                p = rng.randint(0, len(registry[key][1]))
                index.add_checkpoint(key, p)
                registry[key][2].add(p)
        elif action < 0.6:
            key = rng.choice(keys)
            n = rng.randint(0, len(registry[key][1]))
            index.truncate(key, n)
            del registry[key][1][n:]
            registry[key][2].difference_update({p for p in registry[key][2] if p > n})
        elif action < 0.7:
            key = rng.choice(keys)
            index.remove(key)
            del registry[key]
        elif action < 0.75 and registry[keys[0]][2]:
            p = rng.choice(sorted(registry[keys[0]][2]))
            index.remove_checkpoint(keys[0], p)
            registry[keys[0]][2].discard(p)
        for key, (_, tokens, checkpoints) in registry.items():
            assert index.tokens(key) == tokens and index.checkpoints(key) == sorted(checkpoints)
        for _ in range(4):
            base = registry[rng.choice(list(registry))][1] if registry and rng.random() < 0.8 else trunk
            prompt = variant(rng, base, alphabet)
            limit = rng.choice([None, len(prompt) - 1, rng.randint(0, len(prompt))])
            check(index, registry, rng.choice(["alice", "bob", "carol"]), prompt, limit)
    assert len(index) == len(registry)
    for key in list(registry):
        index.remove(key)
    assert not index._nodes  # nothing left behind


def test_reuse_never_crosses_tenants_and_prefers_the_furthest_state():
    index = PrefixIndex(4)
    system = list(range(10, 30))
    index.add("a", "alice", system + [1, 2, 3], checkpoints=[20])
    index.add("b", "alice", system + [1, 2, 9, 9, 9], checkpoints=[22])
    assert index.match("bob", system + [1, 2, 3]) == PrefixMatch(0, None, 0, ())
    m = index.match("alice", system + [1, 2, 7])
    assert (m.common, m.reuse, m.sources) == (22, 22, (("b", CHECKPOINT),))
    m = index.match("alice", system + [1, 2, 3, 4])  # extends "a": its live end
    assert (m.common, m.common_key, m.reuse, m.sources) == (23, "a", 23, (("a", END),))
    m = index.match("alice", system + [5])  # both sequences hold the system prompt's checkpoint
    assert (m.common, m.reuse, m.sources) == (20, 20, (("a", CHECKPOINT),))


def test_bad_calls_say_what_is_wrong():
    index = PrefixIndex(4)
    index.add("a", "t", [1, 2, 3])
    with pytest.raises(ValueError, match="already registered"):
        index.add("a", "t", [1])
    with pytest.raises(ValueError, match=r"outside \[0, 3\]"):
        index.add_checkpoint("a", 4)
    with pytest.raises(ValueError, match="truncate"):
        index.truncate("a", 5)
    with pytest.raises(KeyError, match="unknown key"):
        index.extend("b", [1])
    with pytest.raises(ValueError, match="block_size"):
        PrefixIndex(0)
    index.remove("b")  # unknown: ignored


def test_tenants_stay_apart_even_when_every_hash_collides(monkeypatch):
    import serve.engine.prefix_index as module

    monkeypatch.setattr(module, "hash", lambda x: 7, raising=False)
    index = PrefixIndex(4)  # one block per sequence: a collision inside a tenant would cost reuse
    index.add("a", "alice", [1, 2, 3, 4], [2])
    assert index.match("bob", [1, 2, 3, 4]) == PrefixMatch(0, None, 0, ())
    index.add("b", "bob", [1, 2, 3, 4])
    assert index.match("bob", [1, 2, 3, 4, 5]).sources == (("b", END),)
    assert index.match("alice", [1, 2, 9]).sources == (("a", CHECKPOINT),)


def test_a_hash_collision_is_a_miss_not_a_wrong_answer(monkeypatch):
    """Force every block of every sequence onto one hash: matches must stay exact (only reuse is
    lost past the collision)."""
    import serve.engine.prefix_index as module

    real_hash = hash
    monkeypatch.setattr(module, "hash", lambda x: 7 if isinstance(x, tuple) and len(x) == 2 and
                        isinstance(x[1], tuple) else real_hash(x), raising=False)
    index, registry = PrefixIndex(2), {}
    for key, tokens in (("a", [1, 2, 3, 4, 5]), ("b", [1, 3, 3, 4]), ("c", [2, 2])):
        index.add(key, "t", tokens, [1])
        registry[key] = ("t", tokens, {1})
    for prompt in ([1, 2, 3, 4, 5, 6], [1, 3, 3], [2, 2, 2], [1, 2], [9]):
        got = index.match("t", prompt)
        want_common, want_reuse, _ = brute_force(registry, "t", prompt)
        assert got.common <= want_common and got.reuse <= want_reuse
        if got.reuse:
            key, kind = got.sources[0]
            assert common(registry[key][1], prompt) >= got.reuse
