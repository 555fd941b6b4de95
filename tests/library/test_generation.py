"""generate() and sample_next() against a stand-in model with an obvious next token."""
import pytest
import torch

from ds4_torch.generation import generate
from ds4_torch.sampling import SamplingParams, sample, stop_token_ids

V = 16


class FakeCache:
    """Just the bookkeeping of DS4Cache that generation and the decoder rely on."""

    batch_size = 1
    device = torch.device("cpu")

    def __init__(self, max_context):
        self.positions = torch.zeros(1, dtype=torch.long)
        self.max_context = max_context
        self.invalid = set()

    def narrow(self, n):
        return self

    def take_tokens(self, input_ids):  # rows reserved: nothing to take (a paged cache takes blocks)
        pass

    def commit_tokens(self, index=None):  # nothing to register (a paged cache registers its blocks)
        pass

    def check_usable(self, n=None):
        assert not self.invalid

    def check_room(self, new_tokens, n=None):
        if int(self.positions[0]) + new_tokens > self.max_context:
            raise ValueError("cache is full")

    def invalidate(self, indices):
        self.invalid.update(indices)


class CountingModel(torch.nn.Module):
    """Next token is (token + 1) % V; records the length of every call."""

    def __init__(self):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))  # generate() reads the device from here
        self.calls = []

    def new_cache(self, batch_size, max_context):
        return FakeCache(max_context)

    def forward(self, ids, cache, logits_to_keep=0):
        logits = self._forward(ids, cache)
        return logits[:, -logits_to_keep:] if logits_to_keep else logits

    def _forward(self, ids, cache):  # what the decoder calls (checks done by the caller)
        t = ids.shape[1]
        if int(cache.positions[0]) + t > cache.max_context:
            raise ValueError("cache full")  # the real model's contract
        self.calls.append(t)
        cache.positions += t
        logits = torch.linspace(0, 1, V).repeat(1, t, 1)  # a spread of weaker candidates
        logits[0, torch.arange(t), (ids[0] + 1) % V] = 5.0
        return logits


def test_greedy_prefill_then_one_token_per_step():
    model = CountingModel()
    out = list(generate(model, [3, 7, 2], 6))
    assert out == [3, 4, 5, 6, 7, 8]
    assert model.calls == [3] + [1] * 5  # the last token is never fed back


def test_prefill_in_chunks():
    model = CountingModel()
    out = list(generate(model, list(range(10)), 2, prefill_chunk=4))
    assert model.calls == [4, 4, 2, 1]
    assert out == [10, 11]


def test_stops_at_eos_after_yielding_it():
    assert list(generate(CountingModel(), [1], 10, eos_token_id=4)) == [2, 3, 4]
    assert list(generate(CountingModel(), [1], 10, eos_token_id=[9, 3])) == [2, 3]


def test_stops_cleanly_when_cache_is_full():
    model = CountingModel()
    cache = FakeCache(max_context=5)
    out = list(generate(model, [0, 1, 2], 10, cache=cache))
    assert out == [3, 4, 5]  # 3 prompt + 2 fed-back tokens fill the cache; the 3rd needs no slot
    assert int(cache.positions[0]) == 5


def test_continues_an_existing_cache():
    model = CountingModel()
    cache = FakeCache(max_context=10)
    list(generate(model, [0, 1], 2, cache=cache))
    assert int(cache.positions[0]) == 3
    assert list(generate(model, [8], 2, cache=cache)) == [9, 10]
    assert int(cache.positions[0]) == 5


def test_prompt_too_long_raises_before_yielding():
    with pytest.raises(ValueError, match="does not fit"):
        next(generate(CountingModel(), [1, 2, 3], 4, cache=FakeCache(max_context=2)))


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1},
                                    {"prefill_chunk": 0}])
def test_bad_settings_raise(kwargs):
    with pytest.raises(ValueError):
        next(generate(CountingModel(), [1], 4, **kwargs))
    with pytest.raises(ValueError, match="at least one token"):
        next(generate(CountingModel(), [], 4))


def test_no_tokens_requested():
    model = CountingModel()
    assert list(generate(model, [1], 0)) == []
    assert model.calls == []


def test_seeded_sampling_is_reproducible():
    a = list(generate(CountingModel(), [0], 20, temperature=2.0, seed=123))
    b = list(generate(CountingModel(), [0], 20, temperature=2.0, seed=123))
    c = list(generate(CountingModel(), [0], 20, temperature=2.0, seed=124))
    assert a == b
    assert a != c
    assert a != list(generate(CountingModel(), [0], 20))  # temperature 2 does leave the argmax


def sample_next(logits, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, generator=None):
    return sample(logits, SamplingParams(temperature, top_p, top_k, min_p), generator)


def test_sampler_filters():
    logits = torch.tensor([0.0, 3.0, 2.9, 1.0, -5.0])
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits) == 1
    assert {sample_next(logits, 5.0, top_k=1, generator=g) for _ in range(50)} == {1}
    assert {sample_next(logits, 5.0, top_k=2, generator=g) for _ in range(200)} == {1, 2}
    # top_p keeps the smallest head reaching p: token 1 alone holds 0.48, tokens 1 and 2 hold 0.91.
    assert {sample_next(logits, 1.0, top_p=0.6, generator=g) for _ in range(200)} == {1, 2}
    assert {sample_next(logits, 1.0, top_p=1e-6, generator=g) for _ in range(50)} == {1}
    assert {sample_next(logits, 100.0, generator=g) for _ in range(400)} == {0, 1, 2, 3, 4}
    # min_p keeps p_i >= min_p * p_max. At T=1: p(2)/p(1) = e^-0.1 = 0.905, p(3)/p(1) = e^-2 = 0.135.
    assert {sample_next(logits, 1.0, min_p=0.5, generator=g) for _ in range(200)} == {1, 2}
    assert {sample_next(logits, 1.0, min_p=0.1, generator=g) for _ in range(400)} == {1, 2, 3}
    # ... on the temperature-scaled distribution: at T=10 p(0)/p(1) = e^-0.3 = 0.74, p(4)/p(1) = e^-0.8 = 0.45.
    assert {sample_next(logits, 10.0, min_p=0.5, generator=g) for _ in range(400)} == {0, 1, 2, 3}


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-2), dict(top_k=1.5), dict(min_p=1.5), dict(seed="x")])
def test_sampling_params_name_the_bad_setting(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_seeded_generators_reproduce():
    logits = torch.linspace(0, 1, 50)
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [[sample(logits, params, g) for _ in range(20)] for g in (params.generator("cpu"), params.generator("cpu"))]
    assert draws[0] == draws[1] and len(set(draws[0])) > 3


def test_one_eos_set():
    class Config:
        eos_token_ids = [1, 7]

    class Tok:
        eos_token_id = 2

    assert stop_token_ids(Config(), Tok(), extra=9) == {1, 2, 7, 9}
    assert stop_token_ids(extra=[3, 4]) == {3, 4}
    assert stop_token_ids() == frozenset()