"""The one sampler: settings, their validation, and picking the next token from logits.

`generate()`, the CLI and the server all sample through `sample()`, so a setting means the same
thing everywhere. Order (vLLM's): on the raw logits, the hard mask of allowed tokens (structured
outputs), the bans of `min_tokens`, `logit_bias`, then the penalties (repetition, frequency,
presence); then the filters: temperature, top-k, top-p, min-p; then a draw from what is left with
the request's own generator (a request's tokens never depend on what else runs beside it). Greedy
(temperature 0, or below `TEMPERATURE_FLOOR`) takes the argmax after the penalties and bias, before
the filters.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

BAN = -100.0  # a logit_bias this low bans the token outright (OpenAI: "-100 should result in a ban")
MAX_PENALTY = 2.0  # presence/frequency penalties: OpenAI's range [-2, 2]
# Below this a temperature is greedy: logits / T would overflow float32 to inf (softmax NaN).
TEMPERATURE_FLOOR = 1e-5
# repetition_penalty's range: a factor this far from 1 already decides every seen token, and the
# scaled logits stay finite.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def _number(name: str, value, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < lo or (lo_open and value == lo) or value > hi:
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")


def _token_id(name: str, value) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():  # JSON object keys are strings
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must hold token ids (integers >= 0), got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """`temperature` 0 (anything below `TEMPERATURE_FLOOR`) is greedy (the filters are then irrelevant; penalties and bias still apply);
    `top_k` 0 keeps every token; `top_p` 1 and `min_p` 0 cut nothing; `seed` None draws from fresh
    entropy.

    Penalties and bias (vLLM's and OpenAI's definitions), on the raw logits:
    - `repetition_penalty` p (in [0.01, 100], 1 = off): a token seen in the prompt or the output has its logit
      l divided by p when l > 0, multiplied by p otherwise.
    - `frequency_penalty` f, `presence_penalty` a (each in [-2, 2]): l -= c*f + (c > 0)*a, with c
      the token's count among the generated tokens.
    - `logit_bias` {token id: bias in [-100, 100]}: added to the logit; -100 bans the token.
    - `min_tokens`: EOS and `stop_token_ids` are banned until that many tokens were generated.
    - `stop_token_ids`: tokens that end the request like EOS (the engine's job; the token is
      generated but its text is not output).
    If bans leave no token at all, they are lifted for that step (only a structured-output mask is
    never lifted)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: Iterable[int] = ()

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
        _number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        bias = self.logit_bias
        if isinstance(bias, Mapping):
            bias = bias.items()
        elif not isinstance(bias, (tuple, list)):
            raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
        normal = {}
        for pair in bias:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"logit_bias must map token ids to numbers, got the entry {pair!r}")
            token = _token_id("logit_bias", pair[0])
            _number(f"logit_bias[{token}]", pair[1], BAN, -BAN)
            normal[token] = float(pair[1])
        # Frozen and hashable like the other settings: a sorted tuple of (id, bias).
        object.__setattr__(self, "logit_bias", tuple(sorted(normal.items())))
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes, Mapping)) or not isinstance(stops, Iterable):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stops!r}")
        object.__setattr__(self, "stop_token_ids",
                           tuple(dict.fromkeys(_token_id("stop_token_ids", t) for t in stops)))

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR

    def check(self, vocab_size: int | None = None, max_tokens: int | None = None) -> None:
        """What the settings alone cannot check: token ids inside the vocabulary, `min_tokens`
        within `max_tokens`. Raises ValueError naming the field."""
        if vocab_size is not None:
            for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
                bad = [t for t in ids if t >= vocab_size]
                if bad:
                    raise ValueError(f"{name} holds the token id {bad[0]}, outside the vocabulary [0, {vocab_size})")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})")

    def for_choice(self, index: int) -> "SamplingParams":
        """The settings of choice `index` of a request asking for several (`n`, `best_of`): the
        seed becomes seed + index (vLLM's rule), so choice 0 is what the same request with n = 1
        gives, and the same request gives the same choices. Unseeded choices stay unseeded (each
        draws its own entropy)."""
        if self.seed is None or index == 0:
            return self
        return dataclasses.replace(self, seed=self.seed + index)

    @property
    def adjusts_logits(self) -> bool:
        """Anything to do before the filters: penalties, bias or banned stop tokens."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

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


def adjust_logits(logits: torch.Tensor, params: SamplingParams, output_ids: Sequence[int] = (),
                  prompt_ids: Sequence[int] = (), stop_ids: Iterable[int] = (),
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The logits [V] after the mask, the bans, `logit_bias` and the penalties (a new tensor, float32).
    `output_ids`: the tokens generated so far; `prompt_ids`: the prompt (repetition penalty only);
    `stop_ids`: the EOS ids `min_tokens` bans (with `params.stop_token_ids`); `allowed`: a bool
    mask [V] of the only tokens allowed (structured outputs), never lifted."""
    logits = logits.reshape(-1).float().clone()  # the caller's logits stay intact (logprobs, snapshots)
    V, device = logits.numel(), logits.device
    if allowed is not None:
        logits.masked_fill_(~allowed.to(device).reshape(-1), float("-inf"))
    banned = []
    if len(output_ids) < params.min_tokens:
        banned += [t for t in {*stop_ids, *params.stop_token_ids} if t < V]
    if params.logit_bias:
        banned += [t for t, b in params.logit_bias if b <= BAN]
        shift = [(t, b) for t, b in params.logit_bias if b > BAN]
        if shift:
            logits[torch.tensor([t for t, _ in shift], device=device)] += torch.tensor([b for _, b in shift],
                                                                                       device=device)
    if banned:
        kept = logits.index_fill(0, torch.tensor(banned, device=device), float("-inf"))
        if bool(torch.isfinite(kept).any()):  # else every token is banned: lift the bans this step
            logits = kept
    if params.repetition_penalty != 1.0 and (len(output_ids) or len(prompt_ids)):
        seen = torch.zeros(V, dtype=torch.bool, device=device)
        for ids in (prompt_ids, output_ids):  # a tensor of prompt ids is used as it is (long prompts)
            if len(ids):
                seen[torch.as_tensor(ids, dtype=torch.long).to(device)] = True
        p = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if (params.frequency_penalty or params.presence_penalty) and len(output_ids):
        ids = torch.as_tensor(output_ids, dtype=torch.long).to(device)
        counts = torch.bincount(ids, minlength=V)[:V].float()
        logits = logits - counts * params.frequency_penalty - (counts > 0).float() * params.presence_penalty
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None, *,
           output_ids: Sequence[int] = (), prompt_ids: Sequence[int] = (), stop_ids: Iterable[int] = (),
           allowed: torch.Tensor | None = None) -> int:
    """The next token id from one row of logits [V]; the keyword arguments as `adjust_logits` takes
    them (without them, penalties see no history and `min_tokens` bans only `stop_token_ids`)."""
    if params.adjusts_logits or allowed is not None:
        logits = adjust_logits(logits, params, output_ids, prompt_ids, stop_ids, allowed)
    else:
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
