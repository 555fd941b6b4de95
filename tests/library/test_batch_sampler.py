"""The batched sampler (`BatchSampler`): every setting against a per-row reference (the per-row
`adjust_logits`, the filters written out from their definitions, and the noise hash recomputed
with Python integers), batch invariance, greedy equal to `sample()`, and the draw's distribution."""
from __future__ import annotations

import math

import pytest
import torch

from ds4_torch.sampling import (TEMPERATURE_FLOOR, BatchSampler, SamplingParams, adjust_logits, filter_logits,
                                gumbel_noise, gumbel_of_bits, noise_bits, sample, seed_words)

V = 12
WORD = 0xFFFFFFFF


def py_mix(x: int) -> int:
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & WORD
    return x ^ (x >> 16)


def py_noise(seed: int, position: int, token: int) -> float:
    """The Gumbel noise of (seed, position, token) from its definition, in Python integers: three
    Feistel rounds of (seed, position), two 32-bit words per token, 53 bits k, u = (2k + 1) / 2**54."""
    x, y = (seed % 2 ** 64) & WORD, (seed % 2 ** 64) >> 32
    y ^= py_mix(x ^ 0x2545F491)
    x ^= py_mix(y ^ (position & WORD))
    y ^= py_mix(x ^ 0x68E31DA4)
    k = (py_mix(x ^ py_mix(token + 0x9E3779B9)) << 21) | (py_mix(y ^ py_mix(token + 0x7F4A7C15)) >> 11)
    # -log(u), with 2k + 1 and 2**54 - (2k + 1) each exact in a float64 on its side of 1/2
    e = -math.log((2 * k + 1) / 2 ** 54) if k < 2 ** 52 else -math.log1p(-(2 ** 54 - 2 * k - 1) / 2 ** 54)
    return -math.log(e)


def py_filter(scaled: list[float], p: SamplingParams) -> list[bool]:
    """Which tokens survive top-k, top-p and min-p (in that order), from their definitions."""
    keep = [not math.isinf(v) for v in scaled]
    if 0 < p.top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[p.top_k - 1]
        keep = [k and v >= kth for k, v in zip(keep, scaled)]
    if p.top_p < 1:
        live = [v for v, k in zip(scaled, keep) if k]
        top, total = max(live), sum(math.exp(v - max(live)) for v in live)
        mass = 0.0
        for i in sorted((i for i in range(len(scaled)) if keep[i]), key=lambda i: (-scaled[i], i)):
            prob = math.exp(scaled[i] - top) / total
            keep[i] = mass < p.top_p
            mass += prob
    if p.min_p > 0:
        top = max(v for v, k in zip(scaled, keep) if k)
        keep = [k and math.exp(v - top) >= p.min_p for k, v in zip(keep, scaled)]
    return keep


def reference_token(logits, p, seed, position, output, prompt=(), eos=(), allowed=None) -> int:
    """One row, sequentially: `adjust_logits`, then (sampled) the filters and Gumbel-max with the
    same noise."""
    x = adjust_logits(logits, p, output, prompt, eos, allowed).double()
    if p.temperature < TEMPERATURE_FLOOR:
        return int(torch.argmax(x))
    scaled = (x / p.temperature).tolist()
    keep = py_filter(scaled, p)
    scores = [v + py_noise(seed, position, t) if k else -math.inf for t, (v, k) in enumerate(zip(scaled, keep))]
    return max(range(len(scores)), key=scores.__getitem__)


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2


FEATURES = [
    SamplingParams(),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.3, seed=2, top_k=4),
    SamplingParams(temperature=0.9, seed=3, top_p=0.7),
    SamplingParams(temperature=1.1, seed=4, min_p=0.15),
    SamplingParams(temperature=1.0, seed=5, top_k=6, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.7, seed=6, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(temperature=0.7, seed=7, repetition_penalty=1.8),
    SamplingParams(temperature=1.2, seed=8, logit_bias={2: 4.0, 5: -100, 9: -3.0}),
    SamplingParams(temperature=1.0, seed=9, min_tokens=3, stop_token_ids=[1, 4]),
    SamplingParams(presence_penalty=-1.0, repetition_penalty=1.4, logit_bias={0: 2.5}),  # greedy
    SamplingParams(temperature=TEMPERATURE_FLOOR / 2, seed=10),  # below the floor: greedy
    SamplingParams(temperature=0.9, seed=-(2 ** 70) + 5, top_p=0.9),  # any integer seeds
    SamplingParams(temperature=0.6, seed=11),  # + a grammar mask (below)
]
GRAMMAR_ROW = len(FEATURES) - 1
EOS = [0]
PROMPT = [3, 7, 7]


def grammar_masks(rows: int, step: int) -> torch.Tensor:
    allowed = torch.ones(rows, V, dtype=torch.bool)
    allowed[GRAMMAR_ROW] = False
    allowed[GRAMMAR_ROW, [(step + i) % V for i in range(0, V, 3)]] = True
    return allowed


def test_noise_is_the_hash_of_seed_position_and_token():
    seeds = [0, 1, 2 ** 40 + 3, -7, 2 ** 64 + 9]
    positions = [0, 5, 2 ** 33 + 1, 17, 3]
    got = gumbel_noise(torch.tensor([seed_words(s) for s in seeds]), torch.tensor(positions), V)
    want = torch.tensor([[py_noise(s, q, t) for t in range(V)] for s, q in zip(seeds, positions)], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()


def test_noise_has_53_bits_of_resolution():
    """The integers behind the noise: every one of the 53 bits is a fair coin over a million
    (seed, position, token) triples, and no two of them collide (2**53 values: ~0.00006 collisions
    expected; 23 bits would give ~58,000)."""
    seeds = torch.tensor([seed_words(s * 7919 + 3) for s in range(64)])
    bits = noise_bits(seeds, torch.arange(64) * 3, 2 ** 14).reshape(-1)
    n = bits.numel()
    assert bits.min() >= 0 and bits.max() < 2 ** 53
    ones = torch.stack([((bits >> i) & 1).sum() for i in range(53)]).double() / n
    assert (ones - 0.5).abs().max() < 5 * 0.5 / math.sqrt(n), ones  # 5 sigma
    assert torch.unique(bits).numel() == n
    # one token over many seeds: the row state carries the resolution too (a 32-bit one would
    # leave each token only 2**32 values)
    one = noise_bits(torch.tensor([seed_words(s) for s in range(2 ** 16)]), torch.zeros(2 ** 16, dtype=torch.long), 1)
    assert torch.unique(one).numel() == 2 ** 16 and ((one & (2 ** 21 - 1)) != 0).all()


def test_noise_tail_matches_the_gumbel_far_out():
    """The noise's exact distribution (the share of the 2**53 integers whose value passes t, found
    by bisection: the map is monotone) against the Gumbel's, 1 - exp(-exp(-t)), from t = -3.3 to
    30: a token 25 nats below the best is drawable with the probability exact sampling gives it.
    23-bit noise stops at 16.6 (nothing ~19.5 nats below the best could ever be drawn)."""
    top = 2 ** 53

    def first_above(t: float) -> int:  # the smallest k with g(k) > t
        lo, hi = 0, top
        while lo < hi:
            mid = (lo + hi) // 2
            if float(gumbel_of_bits(torch.tensor([mid]))) > t:
                hi = mid
            else:
                lo = mid + 1
        return lo

    for t in [-3.3, -3.0, -2.0, -1.0, 0.0, 1.0, 3.0, 6.0, 10.0, 14.0, 17.0, 20.0, 25.0, 30.0]:
        above = (top - first_above(t)) / top
        want = -math.expm1(-math.exp(-t))
        assert above == pytest.approx(want, rel=2e-3), t
        below = 1 - above if t > 0 else first_above(t) / top
        assert below == pytest.approx(math.exp(-math.exp(-t)), rel=2e-3, abs=1e-12), t
    assert float(gumbel_of_bits(torch.tensor([top - 1]))) > 37  # the largest value: 37.43


def test_long_tail_draws_follow_the_softmax_on_a_large_vocabulary():
    """2,048 seeded draws from 8,192 tokens whose logits fall 0 to 16 nats below the best, binned by
    whole nats below 0 (the best token alone, everything past 7 nats in one bin): chi-square
    against the softmax's mass per bin (8 degrees of freedom, p = 0.001: 26.12). (The 23-bit
    noise's loss past ~17 nats is too rare to show at this size: a chi-square would need ~3e9
    token draws to see it; `test_noise_tail_matches_the_gumbel_far_out` checks it exactly.)"""
    vocab, slots, steps = 8192, 256, 8
    logits = -torch.linspace(0, 1, vocab) ** 0.5 * 16.0  # a long tail: most tokens far below
    logits[0] = 2.0
    sampler = BatchSampler(slots, vocab)
    for s in range(slots):
        sampler.admit(s, SamplingParams(temperature=1.0, seed=10_000 + s))
    which = (torch.floor(-logits).clamp(-1, 7) + 1).long()  # 0: the best token
    counts = torch.zeros(9)
    for _ in range(steps):
        tokens = sampler.sample(logits.expand(slots, vocab), tokens_only=True).tokens
        sampler.append(tokens)
        counts += torch.bincount(which[tokens], minlength=9).float()
    mass = torch.zeros(9, dtype=torch.float64).index_add_(0, which, torch.softmax(logits.double(), 0))
    assert (mass * slots * steps).min() > 10  # every bin expects enough draws for the statistic
    assert chi_square(counts.tolist(), mass.tolist()) < 26.12, (counts.tolist(), mass.tolist())


def run_batch(params, steps, logits_of_step, slots=None, masks=None, max_slots=None):
    """Admit `params` (row b in slot `slots[b]`) and sample `steps` steps; tokens [steps][B]."""
    slots = list(range(len(params))) if slots is None else slots
    sampler = BatchSampler(max_slots or len(params), V)
    for slot, p in zip(slots, params):
        sampler.admit(slot, p, prompt_ids=PROMPT, eos_ids=EOS)
    out = []
    for step in range(steps):
        res = sampler.sample(logits_of_step(step), allowed=None if masks is None else masks(step),
                             slots=None if slots == list(range(len(params))) else slots)
        assert not res.failed.any()
        sampler.append(res.tokens, slots=None if slots == list(range(len(params))) else slots)
        out.append(res.tokens.tolist())
    return out


def test_every_setting_matches_the_sequential_per_row_reference():
    rows, steps = len(FEATURES), 6
    got = run_batch(FEATURES, steps, lambda s: random_logits(rows, s), masks=lambda s: grammar_masks(rows, s))
    for b, p in enumerate(FEATURES):
        output = []
        seed = p.seed if p.seed is not None else 0
        for step in range(steps):
            allowed = grammar_masks(rows, step)[b] if b == GRAMMAR_ROW else None
            want = reference_token(random_logits(rows, step)[b], p, seed, step, output, PROMPT, EOS, allowed)
            assert got[step][b] == want, (b, p, step)
            output.append(want)


def test_tokens_only_gives_the_same_tokens():
    """sample(tokens_only=True) (what speculation calls): every setting's tokens as a full call's."""
    rows = len(FEATURES)
    sampler = BatchSampler(rows, V)
    for slot, p in enumerate(FEATURES):
        sampler.admit(slot, p, prompt_ids=PROMPT, eos_ids=EOS)
    for step in range(6):
        logits, allowed = random_logits(rows, step), grammar_masks(rows, step)
        ahead = torch.full((rows,), step)
        full = sampler.sample(logits, allowed=allowed, ahead=ahead)
        fast = sampler.sample(logits, allowed=allowed, ahead=ahead, tokens_only=True)
        assert torch.equal(full.tokens, fast.tokens) and fast.failed is None and fast.stop is None


def test_ahead_and_prior_are_history_for_min_tokens_and_penalties():
    """A row `ahead` tokens on counts them for min_tokens, and its `prior` tokens (not appended
    yet) for the penalties: it draws as the same sampler would after appending them."""
    logits = torch.zeros(2, V)
    logits[:, 5], logits[:, 7] = 3.0, 2.0  # 5 is the argmax, 7 next
    sampler = BatchSampler(1, V)
    sampler.admit(0, SamplingParams(min_tokens=2, repetition_penalty=4.0), eos_ids=[5])
    sampler.append(torch.tensor([9]))  # one generated: EOS 5 still banned for the next token
    ahead = torch.tensor([0, 1])
    got = sampler.sample(logits, slots=[0, 0], ahead=ahead).tokens
    assert got.tolist() == [7, 5]  # the row one ahead is the third token: no longer banned
    prior = (torch.tensor([[0], [5]]), torch.tensor([[False], [True]]))
    got = sampler.sample(logits, slots=[0, 0], ahead=ahead, prior=prior).tokens
    assert got.tolist() == [7, 7]  # 5 before it: penalised 3 -> 0.75 below 7's 2
    sampler.append(torch.tensor([5]))
    assert sampler.sample(logits[1:], slots=[0]).tokens.tolist() == [7]  # the same, appended


def test_adjusted_logits_equal_adjust_logits_row_by_row():
    rows = len(FEATURES)
    sampler = BatchSampler(rows, V)
    history = [[4, 4, 9, 2], [], [1]]
    for b, p in enumerate(FEATURES):
        sampler.admit(b, p, prompt_ids=PROMPT, output_ids=history[b % 3], eos_ids=EOS)
    logits, allowed = random_logits(rows, 99), grammar_masks(rows, 0)
    got = sampler.adjust(logits, slice(0, rows), FEATURES, allowed)
    for b, p in enumerate(FEATURES):
        mask = allowed[b] if b == GRAMMAR_ROW else None
        want = adjust_logits(logits[b], p, history[b % 3], PROMPT, EOS, mask)
        torch.testing.assert_close(got[b], want, rtol=0, atol=1e-6)


def test_filters_keep_what_their_definitions_keep():
    logits = random_logits(len(FEATURES), 5)
    ps = [p for p in FEATURES if p.temperature >= TEMPERATURE_FLOOR]
    got = filter_logits(logits[:len(ps)], top_k=torch.tensor([p.top_k for p in ps]),
                        top_p=torch.tensor([p.top_p for p in ps]), min_p=torch.tensor([p.min_p for p in ps]))
    for b, p in enumerate(ps):
        assert torch.isfinite(got[b]).tolist() == py_filter(logits[b].tolist(), p), p
    # Top-k alone, its k-th values from a top-k of the largest k (no sort): the same cut.
    top_k = torch.tensor([0, 3, 6, 1])
    got = filter_logits(logits[:4], top_k=top_k, max_top_k=6)
    assert torch.equal(got, filter_logits(logits[:4], top_k=top_k))
    for b, k in enumerate(top_k.tolist()):
        assert torch.isfinite(got[b]).tolist() == py_filter(logits[b].tolist(), SamplingParams(top_k=k)), k


def test_greedy_rows_equal_sample():
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4),
              SamplingParams(logit_bias={3: 5.0, 6: -100}, min_tokens=2, stop_token_ids=[2]),
              SamplingParams(temperature=1e-6, presence_penalty=2.0)]
    sampler = BatchSampler(len(params), V)
    for b, p in enumerate(params):
        sampler.admit(b, p, prompt_ids=PROMPT, eos_ids=EOS)
    outputs = [[] for _ in params]
    for step in range(8):
        logits = random_logits(len(params), 100 + step)
        tokens = sampler.sample(logits).tokens.tolist()
        for b, p in enumerate(params[:3]):  # sample() has no temperature floor of its own
            assert tokens[b] == sample(logits[b], p, output_ids=outputs[b], prompt_ids=PROMPT, stop_ids=EOS)
        assert tokens[3] == sample(logits[3], SamplingParams(presence_penalty=2.0), output_ids=outputs[3],
                                   prompt_ids=PROMPT, stop_ids=EOS)
        for b, t in enumerate(tokens):
            outputs[b].append(t)
        sampler.append(torch.tensor(tokens))


def test_a_seeded_row_is_the_same_alone_and_in_any_batch():
    row = SamplingParams(temperature=0.9, seed=1234, top_p=0.95, top_k=8)
    own = lambda step: random_logits(1, 500 + step)  # noqa: E731 - the row's logits at each step
    alone = [t[0] for t in run_batch([row], 10, own)]
    neighbours = [p for p in FEATURES if p.seed != row.seed] + [SamplingParams(temperature=1.0, seed=s) for s in (1, 2)]
    batch = neighbours[:7] + [row] + neighbours[7:15]
    assert len(batch) == 16

    def batch_logits(step):
        logits = random_logits(16, 900 + step)
        logits[7] = own(step)[0]
        return logits

    def masks(step):
        allowed = torch.ones(16, V, dtype=torch.bool)
        allowed[3, ::2] = False  # a neighbour's grammar
        return allowed

    in_batch = [t[7] for t in run_batch(batch, 10, batch_logits, masks=masks)]
    assert in_batch == alone
    # In slot 5 of 8, with the others' rows in another order, through explicit slots.
    slots = [5, 0, 3]
    others = [FEATURES[6], FEATURES[8]]
    mixed = run_batch([row, *others], 10, lambda s: torch.cat([own(s), random_logits(2, 70 + s)]), slots=slots,
                      max_slots=8)
    assert [t[0] for t in mixed] == alone
    assert len(set(alone)) > 2  # it really samples


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, probs) if q > 0)


@pytest.mark.parametrize("params, df_limit", [
    (SamplingParams(temperature=0.8), 20.52),        # chi-square, 5 degrees of freedom, p = 0.001
    (SamplingParams(temperature=1.5, top_k=4), 16.27),  # 3 degrees of freedom
])
def test_seeded_draws_follow_the_softmax(params, df_limit):
    """2,000 seeds x 10 positions: the draws' histogram against softmax(l / T) over the kept set.
    Fixed seeds make the statistic a fixed number (no flakes); a wrong noise formula (a bias in u,
    a sign, a wrong temperature) moves it far past the limit."""
    logits = torch.tensor([1.0, 0.2, -0.5, 0.9, -1.5, 0.0])
    slots, steps = 2000, 10
    sampler = BatchSampler(slots, 6)
    for s in range(slots):
        sampler.admit(s, SamplingParams(temperature=params.temperature, top_k=params.top_k, seed=s))
    counts = [0] * 6
    for _ in range(steps):
        tokens = sampler.sample(logits.expand(slots, 6)).tokens
        sampler.append(tokens)
        for t, c in enumerate(torch.bincount(tokens, minlength=6).tolist()):
            counts[t] += c
    scaled = (logits / params.temperature).tolist()
    keep = py_filter(scaled, params)
    weights = [math.exp(v) if k else 0.0 for v, k in zip(scaled, keep)]
    probs = [w / sum(weights) for w in weights]
    assert all(c == 0 for c, q in zip(counts, probs) if q == 0)
    assert chi_square(counts, probs) < df_limit, (counts, probs)


def test_a_bad_row_fails_alone():
    params = [SamplingParams(temperature=0.9, seed=s) for s in range(4)]
    logits = random_logits(4, 3)
    clean = BatchSampler(4, V)
    for b, p in enumerate(params):
        clean.admit(b, p)
    want = clean.sample(logits).tokens
    bad = logits.clone()
    bad[1, 5] = float("nan")
    bad[2, 0] = float("inf")
    allowed = torch.ones(4, V, dtype=torch.bool)
    allowed[3] = False  # a grammar that allows nothing
    out = clean.sample(bad, allowed=allowed)
    assert out.failed.tolist() == [False, True, True, True]
    assert out.tokens[0] == want[0]


def test_logprobs_are_the_raw_log_softmax():
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3, logit_bias={1: 9.0})]
    sampler = BatchSampler(2, V)
    for b, p in enumerate(params):
        sampler.admit(b, p)
    logits = random_logits(2, 8)
    out = sampler.sample(logits, logprobs=3)
    for b in range(2):
        row = logits[b].double()
        lse = math.log(sum(math.exp(v) for v in row.tolist()))
        assert out.logprob[b].item() == pytest.approx(row[out.tokens[b]].item() - lse, abs=1e-5)
        best = sorted(range(V), key=lambda t: -row[t].item())[:3]
        assert out.top_ids[b].tolist() == best
        assert out.top_logprobs[b].tolist() == pytest.approx([row[t].item() - lse for t in best], abs=1e-5)


def test_stop_flags_and_min_tokens():
    sampler = BatchSampler(2, V)
    sampler.admit(0, SamplingParams(min_tokens=2, stop_token_ids=[4]), eos_ids=[0])
    sampler.admit(1, SamplingParams(stop_token_ids=[4]))  # EOS ignored: no eos_ids
    logits = torch.zeros(2, V)
    logits[:, 0], logits[:, 4], logits[:, 7] = 5.0, 4.0, 3.0
    for step, want in enumerate([[7, 0], [7, 0], [0, 0]]):
        out = sampler.sample(logits)
        assert out.tokens.tolist() == want
        assert out.stop.tolist() == [want[0] == 0, False]
        sampler.append(out.tokens)


def test_release_and_readmit_start_fresh():
    p = SamplingParams(temperature=1.0, seed=42, presence_penalty=2.0, repetition_penalty=2.0)
    fresh = run_batch([p], 5, lambda s: random_logits(1, s))
    sampler = BatchSampler(1, V)
    sampler.admit(0, SamplingParams(temperature=1.0, seed=1, frequency_penalty=2.0, logit_bias={3: -100}))
    for step in range(4):
        sampler.append(sampler.sample(random_logits(1, 40 + step)).tokens)
    sampler.release(0)
    sampler.admit(0, p, prompt_ids=PROMPT, eos_ids=EOS)
    again = []
    for step in range(5):
        tokens = sampler.sample(random_logits(1, step)).tokens
        sampler.append(tokens)
        again.append(tokens.tolist())
    assert again == fresh


def test_bad_input_names_the_problem():
    sampler = BatchSampler(2, V)
    with pytest.raises(ValueError, match="slot"):
        sampler.admit(2, SamplingParams())
    with pytest.raises(ValueError, match="logit_bias"):
        sampler.admit(0, SamplingParams(logit_bias={V: 1.0}))
    with pytest.raises(ValueError, match="eos_ids"):
        sampler.admit(0, SamplingParams(), eos_ids=[V])
    with pytest.raises(ValueError, match="logits"):
        sampler.sample(torch.zeros(2, V + 1))
    with pytest.raises(ValueError, match="allowed"):
        sampler.sample(torch.zeros(2, V), allowed=torch.ones(2, V - 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="slots"):
        sampler.sample(torch.zeros(3, V))


@torch.no_grad()
def test_a_step_reads_nothing_back_to_the_host():
    """Traced once with make_fx (which bakes every Python value read at trace time into the graph,
    as a CUDA-graph capture would), the step replays every later position exactly as eager runs it:
    positions, counts and bans live in tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    rows = len(FEATURES)
    eager, traced = BatchSampler(rows, V), BatchSampler(rows, V)
    for sampler in (eager, traced):
        for b, p in enumerate(FEATURES):
            sampler.admit(b, p, prompt_ids=PROMPT, eos_ids=EOS)

    def step(sampler):
        def run(logits, allowed):
            out = sampler.sample(logits, allowed=allowed, logprobs=2)
            sampler.append(out.tokens)
            return out.tokens, out.top_ids
        return run

    graph = make_fx(step(traced))(random_logits(rows, 0), grammar_masks(rows, 0))  # runs step 0
    step(eager)(random_logits(rows, 0), grammar_masks(rows, 0))
    for t in range(1, 8):
        want = step(eager)(random_logits(rows, t), grammar_masks(rows, t))
        got = graph(random_logits(rows, t), grammar_masks(rows, t))
        assert [g.tolist() for g in got] == [w.tolist() for w in want], t
    assert torch.equal(traced.generated, eager.generated) and traced.generated[0] == 8
