"""When the engine speculates (`serve --speculative-tokens N`): per decode step, a plain step or
a speculative one.

A verify step of 1 + N tokens per sequence pays when its accepted drafts outweigh its cost, and
both vary: the cost with the batch (a big batch's verify is compute-bound), the acceptance with
the text (a layer that drafts prose well may draft tool calls badly). Policy "always" speculates
while at most `max_batch` sequences decode. Policy "auto" also measures, per power-of-two batch
size, the tokens per second of the model time each kind of step took (an exponential average)
and runs the faster kind, trying the other one every `probe_every` steps of that size so a
change of content or load is noticed (speculation for `probe_steps` steps, its first not
measured: rows coming back from plain steps start with guessed drafts and a stale MTP layer).
Both kinds give the same tokens; only the speed differs.
"""
from __future__ import annotations

POLICIES = ("auto", "always")


class SpeculationPolicy:
    def __init__(self, policy: str = "always", max_batch: int | None = None, probe_every: int = 32,
                 probe_steps: int = 4, smoothing: float = 0.25):
        if policy not in POLICIES:
            raise ValueError(f"speculative policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy, self.max_batch, self.probe_every, self.smoothing = policy, max_batch, probe_every, smoothing
        self.probe_steps = probe_steps  # a probe of speculation lasts this many steps (its first is not measured)
        self.rate: dict[tuple[int, bool], float] = {}  # (batch bucket, speculative) -> tokens per model second
        self.steps: dict[int, int] = {}                 # steps taken per bucket
        self.hold = 0                                   # steps left in a probe of speculation

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << (rows - 1).bit_length()

    def speculate(self, rows: int) -> bool:
        """Whether a step of `rows` sequences speculates."""
        if self.max_batch is not None and rows > self.max_batch:
            return False
        if self.policy == "always":
            return True
        if self.hold:
            self.hold -= 1
            return True
        b = self.bucket(rows)
        spec, plain = self.rate.get((b, True)), self.rate.get((b, False))
        if spec is None or plain is None:  # measure each kind once: speculation first
            return spec is None
        better = spec >= plain
        n = self.steps.get(b, 0)
        choice = (not better) if n % self.probe_every == self.probe_every - 1 else better
        if choice and not better:
            self.hold = self.probe_steps - 1
        return choice

    def record(self, rows: int, speculative: bool, tokens: int, seconds: float, fair: bool = True) -> None:
        """A step of `rows` sequences emitted `tokens` in `seconds` of model time. `fair`: False
        for a speculative step whose rows rejoined after plain steps (their first drafts are
        guesses, their MTP layers stale): counted, not measured."""
        if seconds <= 0 or tokens <= 0:
            return
        b = self.bucket(rows)
        self.steps[b] = self.steps.get(b, 0) + 1
        if not fair:
            return
        rate, key = tokens / seconds, (b, speculative)
        old = self.rate.get(key)
        self.rate[key] = rate if old is None else old + self.smoothing * (rate - old)
