"""What a request reused of the cache, and why not more: the report `Sessions.claim` gives each
request on its first admission (`GenRequest.cache_report`, a dict; the API layer shows it).

- `reused`: prompt tokens taken from the cache (the request's `cached_tokens`: what `usage` says);
- `source`: where they came from: `session` (a resident conversation's end, taken over),
  `shared` (a running request's state, its blocks shared: a choice of an `n` > 1 request),
  `checkpoint` (a checkpoint of a resident conversation: rewound in place or branched from),
  `disk` (a snapshot restored from the disk store), `none`;
- `reason`: `new` (no earlier prompt of the tenant shared a token), `full` (none shared more than
  was reused), else why the best earlier prompt of the tenant (the one sharing the most tokens,
  `shared`) gave fewer:
  `diverged` (the prompt differs from it, or ends inside it, at `diverged_at`: the nearest state
  before that was reused), `no_checkpoint` (it differs at `diverged_at` and no state lay at or
  before that), `evicted` (it left memory for another conversation: every resident slot was
  taken; nothing on disk), `pool` (it left memory because the KV pool needed its blocks for
  other requests; nothing on disk), `evicted_to_disk` (it was written to the disk store, which
  no longer gave it back), `prompt_logprobs` (a request asking for prompt logprobs reuses nothing);
- `diverged_at` with `before`, `ours`, `theirs`: token ids around that position (the shared ones
  before it, then each side's), which the API process decodes;
- `other_tenant`: the tokens another tenant's prompt shared, when more than this tenant's best and
  than what was reused. It is the operator's (the access log, `/metrics`), never shown to a client:
  it would tell one tenant how much of another's prompt matches theirs.

Evicted conversations are remembered (`departed`: their tokens in a prefix index of their own, the
latest `DEPARTED_SEQUENCES` within `DEPARTED_TOKENS` tokens), so an eviction can be named later.

Cost: a request whose reuse is full pays a few dictionary lookups (`PrefixIndex.shares` on the block
hashes `Sessions` computed for its own match); the full comparisons run only when something shares
more than the request can reuse. Not thread-safe, except `report` (the engine thread writes).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .prefix_index import PrefixIndex, PrefixMatch

REASONS = ("new", "full", "diverged", "no_checkpoint", "evicted", "pool", "evicted_to_disk", "prompt_logprobs",
           "other_tenant")
SOURCES = ("session", "shared", "checkpoint", "disk", "none")
DEPARTED_SEQUENCES = 256
DEPARTED_TOKENS = 1 << 18     # about 25 MB of index at most, far less when they share a system prompt
REPORTS = 4096                # the latest requests' reports, for `report(request_id)`
EXCERPT_BEFORE, EXCERPT_AFTER = 8, 12   # tokens shown before the divergence, and of each side after it


@dataclass
class Look:
    """What the claim's candidates shared, taken before the claim acts (a rewind cuts the very
    conversation that shared the most)."""
    prompt: int
    shared: int = 0                    # the most tokens an earlier prompt of the tenant shares
    departed: tuple | None = None      # (cause, on disk) when that prompt left memory
    diverged_at: int | None = None
    excerpt: tuple = ()                # (before, ours, theirs) token ids
    other_tenant: int = 0
    slow: bool = False                 # something shared more than the claim could reuse


class ReuseReports:
    def __init__(self, index: PrefixIndex, metrics=None):
        self.index = index
        self.metrics = metrics
        self.departed = PrefixIndex(index.block_size)
        self._departed: OrderedDict[int, tuple[str, bool, int]] = OrderedDict()  # key -> (cause, on disk, tokens)
        self._departed_tokens = 0
        self._keys = itertools.count()
        self._reports: dict[str, dict] = {}

    # ------------------------------------------------------------------ conversations leaving
    def left(self, tokens: Sequence[int], tenant: Hashable, cause: str, on_disk: bool) -> None:
        """A conversation left memory (`cause`: "sessions", for another conversation's slot, or
        "pool", for KV blocks); `on_disk`: a snapshot of it was handed to the disk store."""
        if not tokens or len(tokens) > DEPARTED_TOKENS:  # (one that long would push every other out)
            return
        m = self.departed.match(tenant, tokens)
        if m.common_key is not None and m.common == self._departed[m.common_key][2]:
            self._forget(m.common_key)  # a prefix of this one: it says nothing more
        key = next(self._keys)
        self.departed.add(key, tenant, tokens)
        self._departed[key] = (cause, on_disk, len(tokens))
        self._departed_tokens += len(tokens)
        while self._departed_tokens > DEPARTED_TOKENS or len(self._departed) > DEPARTED_SEQUENCES:
            self._forget(next(iter(self._departed)))

    def _forget(self, key) -> None:
        self.departed.remove(key)
        self._departed_tokens -= self._departed.pop(key)[2]

    # ------------------------------------------------------------------ one request
    def look(self, tenant: Hashable, seq: list[int], chain: list[int], live: PrefixMatch, reusable: int) -> Look:
        """What the tenant's resident and departed prompts (and other tenants') share with `seq`,
        given the live index's `match` and that the claim reuses at most `reusable` tokens."""
        n = len(seq)
        look = Look(n, shared=live.common)
        probe = reusable + 1
        if live.common > reusable and not (live.common == n and reusable == n - 1):  # (the last token's logits)
            look.slow = True
        if not look.slow and self._departed:
            look.slow = self.departed.shares(tenant, seq, probe, chain)
        tenants = None
        if not look.slow:
            tenants = self._others(tenant)
            look.slow = any(index.shares(t, seq, probe, chain) for t in tenants
                            for index in (self.index, self.departed))
        if not look.slow:
            return look
        their, their_index = live.common_key, self.index
        if self._departed:
            gone = self.departed.match(tenant, seq, chain=chain)
            if gone.common > live.common:
                look.shared, their, their_index = gone.common, gone.common_key, self.departed
                look.departed = self._departed[gone.common_key][:2]
        p = look.shared
        if their is not None and their_index.tokens(their, p, p + 1):  # theirs goes on past p: a divergence
            look.diverged_at = p
            look.excerpt = (seq[max(0, p - EXCERPT_BEFORE):p], seq[p:p + EXCERPT_AFTER],
                            their_index.tokens(their, p, p + EXCERPT_AFTER))
        for t in self._others(tenant) if tenants is None else tenants:
            for index in (self.index, self.departed):
                look.other_tenant = max(look.other_tenant, index.match(t, seq, chain=chain).common)
        return look

    def _others(self, tenant: Hashable) -> set:
        tenants = self.index.tenants()
        if self._departed:
            tenants |= self.departed.tenants()
        tenants.discard(tenant)
        return tenants

    def finish(self, request_id: str, tenant: Hashable, look: Look, reused: int, source: str,
               reason: str | None = None) -> dict:
        """The report of a claim that reused `reused` tokens from `source` (`reason`: given, for a
        request that reuses nothing on purpose); kept for `report`, counted in the metrics."""
        report = {"request": request_id, "prompt": look.prompt, "reused": reused, "source": source}
        report["reason"] = reason or self._reason(look, reused, source)
        if look.slow and report["reason"] not in ("new", "full"):
            report["shared"] = look.shared
            if look.diverged_at is not None:
                report["diverged_at"] = look.diverged_at
                report["before"], report["ours"], report["theirs"] = (list(x) for x in look.excerpt)
        if look.other_tenant > max(look.shared, reused):
            report["other_tenant"] = look.other_tenant
        report["tenant"] = tenant
        while len(self._reports) >= REPORTS:
            del self._reports[next(iter(self._reports))]
        self._reports[request_id] = report
        if self.metrics is not None:
            self.metrics.reuse_reasons.labels(reason=operator_reason(report)).inc()
            self.metrics.reused_tokens.labels(source=source).inc(reused)
        return report

    @staticmethod
    def _reason(look: Look, reused: int, source: str) -> str:
        n, shared = look.prompt, look.shared
        if reused >= shared or (shared == n and reused == n - 1):
            return "full" if reused or shared else "new"
        if look.departed is not None and not (look.departed[1] and source == "disk"):
            cause, on_disk = look.departed
            return "evicted_to_disk" if on_disk else "pool" if cause == "pool" else "evicted"
        return "diverged" if reused else "no_checkpoint"

    def report(self, request_id: str) -> dict | None:
        """The report of a recent request (any thread)."""
        return self._reports.get(request_id)


def operator_reason(report: dict) -> str:
    """The reason an operator sees: `other_tenant` when another tenant's prompt shared more."""
    return "other_tenant" if report.get("other_tenant") else report["reason"]
