"""The sampler's penalties, bias, bans and mask, against values computed by hand from their
definitions (OpenAI's presence/frequency penalties, vLLM's repetition penalty and order)."""
from __future__ import annotations

import pytest
import torch

from ds4_torch.sampling import TEMPERATURE_FLOOR, SamplingParams, adjust_logits, sample

LOGITS = [2.0, -1.0, 0.5, 3.0, 0.0]


def adjusted(params, output_ids=(), prompt_ids=(), stop_ids=(), allowed=None):
    return adjust_logits(torch.tensor(LOGITS), params, output_ids, prompt_ids, stop_ids, allowed).tolist()


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    # token 3 generated twice, token 0 once; token 2 only in the prompt (not penalised).
    got = adjusted(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), output_ids=[3, 0, 3], prompt_ids=[2])
    assert got == pytest.approx([2.0 - 0.5 - 0.25, -1.0, 0.5, 3.0 - 2 * 0.5 - 0.25, 0.0])
    # Negative penalties encourage repetition.
    got = adjusted(SamplingParams(frequency_penalty=-1.0), output_ids=[1])
    assert got == pytest.approx([2.0, 0.0, 0.5, 3.0, 0.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # Seen: 1 and 2 in the prompt, 3 in the output; 0 and 4 unseen.
    got = adjusted(SamplingParams(repetition_penalty=2.0), output_ids=[3], prompt_ids=[1, 2])
    assert got == pytest.approx([2.0, -2.0, 0.25, 1.5, 0.0])


def test_bias_then_repetition_then_frequency_and_presence():
    # vLLM's order: bias on the raw logit, then repetition, then frequency and presence.
    p = SamplingParams(logit_bias={3: 1.0}, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = adjusted(p, output_ids=[3])
    assert got[3] == pytest.approx((3.0 + 1.0) / 2.0 - 0.5 - 0.25)


def test_logit_bias_adds_and_minus_100_bans():
    p = SamplingParams(logit_bias={1: 5.0, "3": -100})  # JSON object keys arrive as strings
    got = adjusted(p)
    assert got[1] == pytest.approx(4.0) and got[3] == float("-inf") and got[0] == 2.0
    assert sample(torch.tensor(LOGITS), p) == 1  # greedy: 3 is banned, 1 now leads
    assert sample(torch.tensor(LOGITS), SamplingParams(logit_bias={3: -100})) == 0


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    p = SamplingParams(min_tokens=2, stop_token_ids=[0])
    logits = torch.tensor(LOGITS)
    # One token so far: both EOS (3, the caller's) and the stop token 0 are banned.
    assert adjusted(p, output_ids=[4], stop_ids={3}) == [float("-inf"), -1.0, 0.5, float("-inf"), 0.0]
    assert sample(logits, p, output_ids=[4], stop_ids={3}) == 2
    assert sample(logits, p, output_ids=[4, 4], stop_ids={3}) == 3  # reached: nothing banned


def test_bans_are_lifted_when_they_leave_nothing_but_the_mask_never_is():
    everything = SamplingParams(logit_bias={t: -100 for t in range(5)})
    assert sample(torch.tensor(LOGITS), everything) == 3
    allowed = torch.tensor([False, True, True, False, False])
    assert sample(torch.tensor(LOGITS), SamplingParams(), allowed=allowed) == 2
    banned_in_mask = SamplingParams(logit_bias={1: -100, 2: -100})
    assert sample(torch.tensor(LOGITS), banned_in_mask, allowed=allowed) == 2
    got = adjusted(SamplingParams(), allowed=allowed)
    assert got == [float("-inf"), -1.0, 0.5, float("-inf"), float("-inf")]


def test_sampled_draw_follows_the_adjusted_distribution():
    """With temperature, the draw is from softmax(adjusted / T): the same generator state gives the
    same token as a multinomial over the hand-computed distribution."""
    p = SamplingParams(temperature=0.7, seed=11, frequency_penalty=0.8, presence_penalty=0.3, logit_bias={4: 2.0})
    expected = torch.tensor([2.0 - 0.8 - 0.3, -1.0, 0.5, 3.0 - 1.6 - 0.3, 0.0 + 2.0]) / 0.7
    g1, g2 = p.generator("cpu"), p.generator("cpu")
    for _ in range(50):
        want = int(torch.multinomial(torch.softmax(expected, -1), 1, generator=g2))
        assert sample(torch.tensor(LOGITS), p, g1, output_ids=[3, 0, 3]) == want


def test_the_callers_logits_are_left_intact():
    logits = torch.tensor(LOGITS)
    sample(logits, SamplingParams(logit_bias={3: -100}, repetition_penalty=1.5, presence_penalty=1.0),
           output_ids=[0], allowed=torch.tensor([True, True, False, True, True]))
    assert logits.tolist() == LOGITS


@pytest.mark.parametrize("bad, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty=1e-30), "repetition_penalty"),  # seen logits would overflow to inf
    (dict(repetition_penalty=101.0), "repetition_penalty"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={5: "a"}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"),
    (dict(stop_token_ids="12"), "stop_token_ids"),
    (dict(stop_token_ids=[3, -4]), "stop_token_ids"),
])
def test_bad_settings_name_their_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_a_temperature_below_the_floor_is_greedy():
    """logits / 1e-45 overflows float32 (softmax NaN, multinomial raises): such a temperature is
    greedy, the argmax, with no generator to draw from."""
    logits = torch.tensor(LOGITS)
    for t in (1e-45, TEMPERATURE_FLOOR / 2):
        p = SamplingParams(temperature=t, seed=3)
        assert p.greedy and p.generator("cpu") is None
        assert sample(logits, p) == int(torch.argmax(logits))
    assert not SamplingParams(temperature=TEMPERATURE_FLOOR).greedy


def test_check_names_ids_outside_the_vocabulary_and_min_tokens_past_max_tokens():
    with pytest.raises(ValueError, match="logit_bias.*1024"):
        SamplingParams(logit_bias={1024: 1.0}).check(vocab_size=1024)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[5000]).check(vocab_size=1024)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=9).check(max_tokens=8)
    SamplingParams(logit_bias={1023: 1.0}, stop_token_ids=[0], min_tokens=8).check(vocab_size=1024, max_tokens=8)


def test_choice_seeds_are_seed_plus_index():
    p = SamplingParams(temperature=1.0, seed=10, presence_penalty=0.5)
    assert p.for_choice(0) is p
    assert p.for_choice(2) == SamplingParams(temperature=1.0, seed=12, presence_penalty=0.5)
    assert SamplingParams(temperature=1.0).for_choice(3).seed is None
