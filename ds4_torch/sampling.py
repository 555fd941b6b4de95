"""The one sampler: settings, their validation, and picking the next token from logits.

`generate()`, the CLI and the server all sample through `sample()`, so a setting means the same
thing everywhere. Order of the filters (vLLM's and transformers' order): temperature, top-k,
top-p, min-p, then a draw from what is left with the request's own generator (a request's tokens
never depend on what else runs beside it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class SamplingParams:
    """`temperature` 0 is greedy (the other settings are then irrelevant); `top_k` 0 keeps every
    token; `top_p` 1 and `min_p` 0 cut nothing; `seed` None draws from fresh entropy."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device) -> torch.Generator | None:
        """A generator of this request's own, seeded from `seed` (None when greedy)."""
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """The next token id from one row of logits [V]."""
    logits = logits.reshape(-1).float()
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the better ones before it already reach top_p; the best token always
        # stays (its preceding mass is 0).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits[order[drop]] = float("-inf")
    if params.min_p > 0:
        # p_i / p_max >= min_p  <=>  l_i >= l_max + ln(min_p), on the temperature-scaled logits.
        logits = logits.masked_fill(logits < logits.max() + math.log(params.min_p), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def stop_token_ids(config=None, tokenizer=None, extra: int | Iterable[int] | None = None) -> frozenset[int]:
    """The one EOS set: the model config's EOS ids, the tokenizer's EOS and any `extra` ids."""
    ids: set[int] = set()
    if config is not None:
        ids.update(int(i) for i in (getattr(config, "eos_token_ids", None) or ()))
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is not None:
        ids.add(int(eos))
    if isinstance(extra, int):
        ids.add(extra)
    elif extra is not None:
        ids.update(int(i) for i in extra)
    return frozenset(ids)
