"""The one sampler: settings, their validation, and picking the next token from logits.

`generate()`, the CLI and the server all sample through `sample()`, so a setting means the same
thing everywhere. Order (vLLM's): on the raw logits, the hard mask of allowed tokens (structured
outputs) and of `forbidden_token_ids`, the bans of `min_tokens`, `logit_bias`, then the penalties (repetition, frequency,
presence); then the filters: temperature, top-k, top-p, min-p; then a draw from what is left with
the request's own generator (a request's tokens never depend on what else runs beside it). Greedy
(temperature 0, or below `TEMPERATURE_FLOOR`) takes the argmax after the penalties and bias, before
the filters.

`BatchSampler` applies the same rules to a whole decode batch in one call, with per-slot settings
written at admission and seeded draws that do not depend on the batch (Gumbel-max over hashed noise).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import secrets
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
    - `forbidden_token_ids`: tokens never sampled, masked with the structured-output mask (before
      `logit_bias`, so no bias brings them back): what the server must never let a model write
      (a tool-call opener when no tools are offered).
    If bans leave no token at all, they are lifted for that step (a structured-output mask and
    `forbidden_token_ids` never are: a row left with nothing fails)."""
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
    forbidden_token_ids: Iterable[int] = ()

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
        forbidden = self.forbidden_token_ids
        if isinstance(forbidden, (str, bytes, Mapping)) or not isinstance(forbidden, Iterable):
            raise ValueError(f"forbidden_token_ids must be a list of token ids, got {forbidden!r}")
        object.__setattr__(self, "forbidden_token_ids",
                           tuple(sorted({_token_id("forbidden_token_ids", t) for t in forbidden})))

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR

    def check(self, vocab_size: int | None = None, max_tokens: int | None = None) -> None:
        """What the settings alone cannot check: token ids inside the vocabulary, `min_tokens`
        within `max_tokens`. Raises ValueError naming the field."""
        if vocab_size is not None:
            for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids),
                              ("forbidden_token_ids", self.forbidden_token_ids)):
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
        """Anything to do before the filters: penalties, bias, banned stop tokens or forbidden ones."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.forbidden_token_ids)

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
    mask [V] of the only tokens allowed (structured outputs), never lifted (nor is
    `params.forbidden_token_ids`)."""
    logits = logits.reshape(-1).float().clone()  # the caller's logits stay intact (logprobs, snapshots)
    V, device = logits.numel(), logits.device
    if allowed is not None:
        logits.masked_fill_(~allowed.to(device).reshape(-1), float("-inf"))
    if params.forbidden_token_ids:
        logits.index_fill_(0, torch.tensor(params.forbidden_token_ids, device=device), float("-inf"))
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
    row = functools.partial(torch.tensor, device=logits.device)
    logits = filter_logits(logits.unsqueeze(0), top_k=row([params.top_k]) if 0 < params.top_k < logits.numel() else None,
                           top_p=row([params.top_p]) if params.top_p < 1.0 else None,
                           min_p=row([params.min_p]) if params.min_p > 0 else None, max_top_k=params.top_k)[0]
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


# --------------------------------------------------------------------------- the batched sampler
def filter_logits(logits: torch.Tensor, top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                  min_p: torch.Tensor | None = None, max_top_k: int | None = None) -> torch.Tensor:
    """The filters on temperature-scaled logits [B, V], each row with its own setting ([B] tensors;
    None: no row uses the filter), in `sample()`'s order: top-k (0 keeps all), top-p (1 cuts
    nothing), min-p (0 cuts nothing). Filtered tokens become -inf (a new tensor). Every step is a
    per-row op, so a row's result never depends on the other rows. `max_top_k`: the largest
    top_k of any row, when the caller knows it: without top-p, the k-th values then come from a
    top-k of that size instead of a sort of the whole vocabulary (the same values)."""
    neg_inf = float("-inf")
    if top_k is not None or top_p is not None:
        if top_p is None and max_top_k is not None:
            ranked = torch.topk(logits, min(max_top_k, logits.shape[-1]), dim=-1).values  # best first
        else:  # one stable sort serves both: ties keep index order, the same alone or in any batch
            ranked, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        if top_k is not None:
            kth = ranked.gather(-1, (top_k.clamp(1, ranked.shape[-1]) - 1).unsqueeze(-1))
            keep_all = (top_k <= 0).unsqueeze(-1)
            logits = logits.masked_fill(~keep_all & (logits < kth), neg_inf)
            if top_p is not None:
                ranked = ranked.masked_fill(~keep_all & (ranked < kth), neg_inf)  # still sorted
        if top_p is not None:
            probs = torch.softmax(ranked, dim=-1)
            # Drop a token when the better ones before it already reach top_p; the best token
            # always stays (its preceding mass is 0). A row at 1 cuts nothing (the sum may round to 1).
            drop = ((torch.cumsum(probs, dim=-1) - probs) >= top_p.unsqueeze(-1)) & (top_p < 1).unsqueeze(-1)
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), neg_inf)
    if min_p is not None:
        # p_i / p_max >= min_p  <=>  l_i >= l_max + ln(min_p); ln(0) = -inf cuts nothing.
        floor = logits.amax(dim=-1, keepdim=True) + torch.log(min_p.float()).unsqueeze(-1)
        logits = logits.masked_fill(logits < floor, neg_inf)
    return logits


_WORD = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**31: a 32-bit word times it stays below 2**63, exact in int64 on any device


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An avalanching bijection of 32-bit words held in int64 (two xorshift-multiply rounds)."""
    x = ((x ^ (x >> 16)) * _MIX) & _WORD
    x = ((x ^ (x >> 16)) * _MIX) & _WORD
    return x ^ (x >> 16)


def seed_words(seed: int) -> tuple[int, int]:
    """A seed of any size as two 32-bit words (its value modulo 2**64)."""
    seed %= 1 << 64
    return seed & _WORD, seed >> 32


# The noise's resolution: u in (0, 1) takes 2**53 values, so a token up to ~37 nats below the best
# can still be drawn (23 bits, a float32's, cut everything past ~19.5 nats and under-sampled near it).
NOISE_BITS = 53


@functools.lru_cache(maxsize=8)
def _token_keys(vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token id's own two hash words (the same every step: computed once per vocabulary and device)."""
    ids = torch.arange(vocab_size, device=device, dtype=torch.int64)
    return _mix32(ids + 0x9E3779B9), _mix32(ids + 0x7F4A7C15)


def gumbel_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """The Gumbel value -log(-log(u)) (float32) of `NOISE_BITS`-bit integers k (int64), with
    u = (2k + 1) / 2**(NOISE_BITS + 1) in (0, 1), increasing in k. -log(u) is taken as -log(v) in
    the lower half (u = v) and -log1p(-v) in the upper half (u = 1 - v), with v in (0, 1/2) exact in
    float32: 1 - v itself would round to 1 there, and the top end is what decides how far below
    the best a token can still be drawn."""
    half = (1 << (NOISE_BITS - 1)) - 1
    upper = bits > half
    v = ((torch.where(upper, bits ^ half, bits) & half) * 2 + 1).float() * 2.0 ** -(NOISE_BITS + 1)
    return -torch.log(torch.where(upper, -torch.log1p(-v), -torch.log(v)))


def noise_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The `NOISE_BITS`-bit integers [B, V] (int64) behind `gumbel_noise`, a pure function of
    (seed, position, token id): row b from `seeds[b]` (two 32-bit words, int64 [B, 2]) and
    `positions[b]` (int64 [B]). Integer ops only, the same bits on every device: three Feistel
    rounds turn (seed, position) into a 64-bit row state (x, y), and token t's words mix(x ^ a_t),
    mix(y ^ b_t) give its bits (for a given token, a bijection of the row state, so every value is
    reachable with its own probability)."""
    keys_x, keys_y = _token_keys(vocab_size, seeds.device)
    x, y = seeds[:, 0] & _WORD, seeds[:, 1] & _WORD
    y = y ^ _mix32(x ^ 0x2545F491)
    x = x ^ _mix32(y ^ (positions.to(torch.int64) & _WORD))
    y = y ^ _mix32(x ^ 0x68E31DA4)
    hi = _mix32(x.unsqueeze(-1) ^ keys_x)
    lo = _mix32(y.unsqueeze(-1) ^ keys_y)
    return (hi << (NOISE_BITS - 32)) | (lo >> (64 - NOISE_BITS))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [B, V] (float32): `gumbel_of_bits` of `noise_bits`. argmax(logits + noise) is a
    draw from softmax(logits) (Gumbel-max): one call samples a whole batch, and a row's draw
    depends on nothing but its own seed and position."""
    return gumbel_of_bits(noise_bits(seeds, positions, vocab_size))


def _anything_left(logits: torch.Tensor) -> torch.Tensor:
    """[B] bool: the row has a token above -inf (one pass)."""
    return logits.amax(dim=-1) > float("-inf")


@dataclass
class SampledTokens:
    """What one `BatchSampler.sample` call gives, row b for logits row b."""
    tokens: torch.Tensor                      # [B] int64
    failed: torch.Tensor | None               # [B] bool: NaN/inf logits or nothing allowed: fail that request only
    stop: torch.Tensor | None                 # [B] bool: the token ends its request (EOS unless ignored, a stop id)
                                              # (both None from sample(tokens_only=True))
    logprob: torch.Tensor | None = None       # [B] raw log-softmax of the chosen token (when logprobs asked)
    top_ids: torch.Tensor | None = None       # [B, k] the k best tokens by raw log-softmax, best first
    top_logprobs: torch.Tensor | None = None  # [B, k]


class BatchSampler:
    """`sample()` for a whole decode batch in one call: each request's settings live in per-slot
    tensors written once by `admit`, and its history (for penalties and `min_tokens`) by `append`.

        sampler = BatchSampler(max_slots, vocab_size, device)
        sampler.admit(slot, params, prompt_ids=prompt, eos_ids=eos)   # once per request
        out = sampler.sample(logits, allowed=grammar_masks, logprobs=k)   # each step, rows = slots
        sampler.append(tokens)                                        # the tokens actually taken
        sampler.release(slot)

    Row b of `logits` is slot b (or `slots[b]` when given). The same rules as `sample()`, batched:
    greedy rows (temperature below `TEMPERATURE_FLOOR`) take `sample()`'s argmax. A sampled row draws
    by Gumbel-max with `gumbel_noise` of (its seed, its generated-token count): a seeded request gets
    the same tokens alone or in any batch, and an unseeded one a seed drawn at admission. Nothing in
    a step reads a tensor back to the host: which optional ops run is decided from the admitted
    settings, and skipping one leaves every row exactly as running it with neutral values would."""

    # The per-slot settings and their neutral values: a free slot's, and what a skipped op equals.
    # `generated` counts the tokens appended so far (min_tokens, and the noise's position).
    NEUTRAL = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "presence": 0.0, "frequency": 0.0,
               "repetition": 1.0, "min_tokens": 0, "generated": 0}

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device | str = "cpu"):
        if max_slots < 1 or vocab_size < 1:
            raise ValueError(f"BatchSampler needs max_slots >= 1 and vocab_size >= 1, got {max_slots}, {vocab_size}")
        self.max_slots, self.vocab_size, self.device = max_slots, vocab_size, torch.device(device)
        self.params: list[SamplingParams | None] = [None] * max_slots
        for name, value in self.NEUTRAL.items():  # self.temperature, self.top_k, ...: [max_slots]
            setattr(self, name, torch.full((max_slots,), value, device=self.device,
                                           dtype=torch.int64 if isinstance(value, int) else torch.float32))
        self.seeds = torch.zeros(max_slots, 2, dtype=torch.int64, device=self.device)  # two 32-bit words
        # EOS (unless ignored) and stop_token_ids: they end the request, and min_tokens bans them.
        self.stop_ids = torch.zeros(max_slots, vocab_size, dtype=torch.bool, device=self.device)
        self._tables: dict[str, torch.Tensor] = {}  # [S, V] tables made on first use: bias, banned, counts, seen

    def _table(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if name not in self._tables:
            self._tables[name] = torch.zeros(self.max_slots, self.vocab_size, dtype=dtype, device=self.device)
        return self._tables[name]

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be an integer in [0, {self.max_slots}), got {slot!r}")

    def admit(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int] | torch.Tensor = (),
              output_ids: Sequence[int] | torch.Tensor = (), eos_ids: Iterable[int] = ()) -> None:
        """Write a request's settings into `slot`: `prompt_ids` (seen by the repetition penalty),
        `output_ids` (tokens it already generated, e.g. a resumed request), `eos_ids` (end it like
        its `stop_token_ids`, banned until `min_tokens`; pass none when EOS is ignored). Raises
        ValueError naming a token id outside the vocabulary."""
        self._check_slot(slot)
        params.check(self.vocab_size)
        V = self.vocab_size
        eos = [int(t) for t in eos_ids]
        if any(not 0 <= t < V for t in eos):
            raise ValueError(f"eos_ids must be token ids in [0, {V}), got {eos}")
        self.release(slot)
        self.params[slot] = params
        greedy = params.temperature < TEMPERATURE_FLOOR
        self.temperature[slot] = 0.0 if greedy else params.temperature
        self.top_k[slot] = params.top_k if params.top_k < V else 0
        self.top_p[slot], self.min_p[slot] = params.top_p, params.min_p
        self.presence[slot], self.frequency[slot] = params.presence_penalty, params.frequency_penalty
        self.repetition[slot], self.min_tokens[slot] = params.repetition_penalty, params.min_tokens
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.seeds[slot] = torch.tensor(seed_words(seed))
        stops = sorted({*eos, *params.stop_token_ids})
        if stops:
            self.stop_ids[slot, stops] = True
        if params.forbidden_token_ids:
            self._table("forbidden", torch.bool)[slot, list(params.forbidden_token_ids)] = True
        for token, bias in params.logit_bias:
            if bias <= BAN:
                self._table("banned", torch.bool)[slot, token] = True
            else:
                self._table("bias", torch.float32)[slot, token] = bias
        output = torch.as_tensor(output_ids, dtype=torch.long).reshape(-1).to(self.device)
        self.generated[slot] = output.numel()
        if params.frequency_penalty or params.presence_penalty:
            self._table("counts", torch.float32)[slot] = torch.bincount(output, minlength=V)[:V].float()
        if params.repetition_penalty != 1.0:
            seen = self._table("seen", torch.bool)
            for ids in (prompt_ids, output):
                seen[slot, torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(self.device)] = True

    def move(self, dst: int, src: int) -> None:
        """Slot `dst` takes over `src`'s request (settings, history, seed); `src` is released."""
        self._check_slot(dst)
        self._check_slot(src)
        if dst == src:
            return
        self.params[dst] = self.params[src]
        for table in (*(getattr(self, name) for name in self.NEUTRAL), self.seeds, self.stop_ids,
                      *self._tables.values()):
            table[dst] = table[src]
        self.release(src)

    def release(self, slot: int) -> None:
        """Forget `slot`'s request: its rows go back to neutral settings."""
        self._check_slot(slot)
        self.params[slot] = None
        for name, value in self.NEUTRAL.items():
            getattr(self, name)[slot] = value
        for table in (self.seeds, self.stop_ids, *self._tables.values()):
            table[slot] = 0

    def _rows(self, slots, B: int) -> tuple[torch.Tensor | slice, list[SamplingParams]]:
        """The state rows of a batch (a slice, no copy, when row b is slot b), and the settings
        that decide which optional ops run (every admitted slot when `slots` is a tensor)."""
        if slots is None:
            if B > self.max_slots:
                raise ValueError(f"a batch of {B} rows needs `slots`, or max_slots >= {B} (have {self.max_slots})")
            index, chosen = slice(0, B), self.params[:B]
        elif isinstance(slots, torch.Tensor):
            index, chosen = slots.to(self.device, torch.long), self.params
        else:
            slots = [int(s) for s in slots]
            for s in slots:
                self._check_slot(s)
            index, chosen = torch.tensor(slots, dtype=torch.long, device=self.device), [self.params[s] for s in slots]
        return index, [p for p in chosen if p is not None]

    def adjust(self, logits: torch.Tensor, rows, params: list[SamplingParams],
               allowed: torch.Tensor | None = None, ahead: torch.Tensor | None = None,
               prior: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`adjust_logits` for a batch: logits [B, V] -> float32 [B, V] after the grammar mask, bias,
        bans (lifted per row when they leave nothing) and penalties, in `adjust_logits`' order.
        `ahead` / `prior` (see `sample`): a row's history also holds the `ahead` tokens before it,
        `prior` = (tokens [B, P], mask [B, P]) those of them not yet appended."""
        x = logits.float()
        extra = None  # counts [B, V] of the prior tokens, when a penalty needs them
        if prior is not None and any(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0
                                     for p in params):
            tokens, mask = prior
            extra = torch.zeros(x.shape, dtype=torch.float32, device=x.device).scatter_add_(
                1, tokens.to(x.device, torch.long), mask.to(x.device, torch.float32))
        if allowed is not None:
            x = x.masked_fill(~allowed.to(x.device, torch.bool), float("-inf"))
        if "forbidden" in self._tables and any(p.forbidden_token_ids for p in params):
            x = x.masked_fill(self._tables["forbidden"][rows], float("-inf"))  # with the mask: never lifted
        if "bias" in self._tables and any(b > BAN for p in params for _, b in p.logit_bias):
            x = x + self._tables["bias"][rows]
        if "banned" in self._tables or any(p.min_tokens for p in params):
            generated = self.generated[rows] if ahead is None else self.generated[rows] + ahead
            banned = self.stop_ids[rows] & (generated < self.min_tokens[rows]).unsqueeze(-1)
            if "banned" in self._tables:
                banned = banned | self._tables["banned"][rows]
            kept = x.masked_fill(banned, float("-inf"))
            x = torch.where(_anything_left(kept).unsqueeze(-1), kept, x)  # all banned: lift
        if any(p.repetition_penalty != 1.0 for p in params):
            p = self.repetition[rows].unsqueeze(-1)
            seen = self._table("seen", torch.bool)[rows]
            if extra is not None:
                seen = seen | (extra > 0)
            x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            counts = self._table("counts", torch.float32)[rows]
            if extra is not None:
                counts = counts + extra
            x = x - counts * self.frequency[rows].unsqueeze(-1) - (counts > 0).float() * self.presence[rows].unsqueeze(-1)
        return x

    def _filtered(self, x: torch.Tensor, rows, sampled: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy rows [B], the temperature-scaled and filtered logits [B, V]) of adjusted logits."""
        temperature = self.temperature[rows]
        greedy = temperature == 0
        scaled = x / torch.where(greedy, 1.0, temperature).unsqueeze(-1)
        max_top_k = max(p.top_k for p in sampled)
        return greedy, filter_logits(
            scaled, top_k=self.top_k[rows] if max_top_k else None,
            top_p=self.top_p[rows] if any(p.top_p < 1 for p in sampled) else None,
            min_p=self.min_p[rows] if any(p.min_p > 0 for p in sampled) else None, max_top_k=max_top_k)

    def probabilities(self, logits: torch.Tensor, slots: Sequence[int] | torch.Tensor | None = None,
                      allowed: torch.Tensor | None = None, ahead: torch.Tensor | None = None,
                      prior: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The distribution [B, V] (float32) `sample` draws each row from (with the same `allowed`,
        `ahead` and `prior`): after the adjustments, the temperature and the filters; a greedy row
        is one-hot on its argmax."""
        rows, params = self._rows(slots, logits.shape[0])
        x = self.adjust(logits, rows, params, allowed, ahead, prior)
        onehot = torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
        sampled = [p for p in params if p.temperature >= TEMPERATURE_FLOOR]
        if not sampled:
            return onehot
        greedy, scaled = self._filtered(x, rows, sampled)
        return torch.where(greedy.unsqueeze(-1), onehot, torch.softmax(scaled, dim=-1))

    def sample(self, logits: torch.Tensor, allowed: torch.Tensor | None = None, logprobs: int | None = None,
               slots: Sequence[int] | torch.Tensor | None = None, ahead: torch.Tensor | None = None,
               tokens_only: bool = False, prior: tuple[torch.Tensor, torch.Tensor] | None = None) -> SampledTokens:
        """The next token of every row of `logits` [B, V]. `allowed`: bool [B, V], the tokens each
        row's grammar allows (all True for a row without one), never lifted. `logprobs` k: the
        chosen token's raw logprob and the k best (k = the most any row asked for; None: none).
        A row whose logits hold NaN or inf, or that allows no token, comes back `failed` (its
        token is meaningless); the other rows are unaffected. `ahead` (int64 [B]): row b samples
        the token `ahead[b]` places after its slot's next one (its noise position moves on by
        that much; the history the penalties see does not): speculative decoding's drafts and
        verified positions, one row each; `min_tokens` counts the `ahead` tokens as generated, and
        `prior` = (tokens [B, P], mask [B, P] bool) are those of them the penalties should see that
        are not appended yet (a verified row's drafts before it), so the row draws as plain decoding
        would after them. `tokens_only`: the tokens alone (`failed` and `stop`
        None, no logprobs): the same tokens, fewer ops (speculation's drafts and verified rows)."""
        if logits.dim() != 2 or logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits must be [batch, {self.vocab_size}], got shape {tuple(logits.shape)}")
        B = logits.shape[0]
        if allowed is not None and tuple(allowed.shape) != (B, self.vocab_size):
            raise ValueError(f"allowed must be a bool mask [{B}, {self.vocab_size}], got shape {tuple(allowed.shape)}")
        rows, params = self._rows(slots, B)
        x = self.adjust(logits, rows, params, allowed, ahead, prior)
        tokens = torch.argmax(x, dim=-1)
        sampled = [p for p in params if p.temperature >= TEMPERATURE_FLOOR]
        if sampled:
            greedy, scaled = self._filtered(x, rows, sampled)
            position = self.generated[rows] if ahead is None else self.generated[rows] + ahead
            drawn = torch.argmax(scaled + gumbel_noise(self.seeds[rows], position, self.vocab_size), dim=-1)
            tokens = torch.where(greedy, tokens, drawn)
        if tokens_only:
            return SampledTokens(tokens, None, None)
        # NaN or inf anywhere in a row shows in its max or min (two passes; isfinite().all() takes five)
        failed = ~(torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))) | ~_anything_left(x)
        out = SampledTokens(tokens, failed, self.stop_ids[rows].gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
        if logprobs is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            out.logprob = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            out.top_logprobs, out.top_ids = torch.topk(lp, min(int(logprobs), self.vocab_size), dim=-1)
        return out

    def append(self, tokens: torch.Tensor, slots: Sequence[int] | torch.Tensor | None = None) -> None:
        """Record the tokens the rows actually generated (the sampled ones, or what a grammar forced
        instead): the penalties' counts, `min_tokens` and the noise position move on."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        rows, _ = self._rows(slots, tokens.numel())
        if isinstance(rows, slice):
            rows = torch.arange(rows.start, rows.stop, device=self.device)
        self.generated.index_add_(0, rows, torch.ones_like(rows))
        if "counts" in self._tables:
            self._tables["counts"].index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32),
                                              accumulate=True)
        if "seen" in self._tables:
            self._tables["seen"][rows, tokens] = True
