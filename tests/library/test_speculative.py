"""The MTP layer and speculative decoding (issue #24): loading under both name styles, and
speculation giving exactly plain decoding's tokens and verified logits, with rollback across
window and compression boundaries; the rejection-sampling path against the distribution."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ckpt_utils import fp8_checkpoint, save_single
from ds4_torch import DS4Config, DS4ForCausalLM, generate
from ds4_torch.config import CSA, SLIDING
from ds4_torch.decode import make_decoder, prefill
from ds4_torch.sampling import BatchSampler, SamplingParams, adjust_logits, filter_logits
from ds4_torch.speculative import SpeculationStats, Speculator, rejection_sample
from oracle import randomise

torch.set_num_threads(1)

# Window 5 and rates 2 and 3: 70 tokens cross the window fill, many ring wraps and emits of every
# rate, so rejected drafts keep closing compressed rows (and CSA overlaps) that must not survive.
SMALL = dict(
    vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
    head_dim=16, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=5,
    compress_ratios=[2, 0, 3, 2],  # upstream spelling: the last slot is the MTP layer's (CSA, rate 2)
    num_nextn_predict_layers=1, compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 3},
    mlp_layer_types=["hash_moe", "moe", "moe"], index_n_heads=8, index_head_dim=8, index_topk=3,
    n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=5,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 128},
)
PROMPTS = [[3], list(range(1, 8)), [5, 9, 11, 2, 40, 33, 7, 7, 1, 60, 22, 13]]
NEW = 70


@pytest.fixture(scope="module")
def model():
    m = DS4ForCausalLM(DS4Config.from_dict(SMALL))
    randomise(m, 3)
    return m.eval()


@pytest.fixture(scope="module")
def plain(model):
    """Plain decoding's tokens (`generate` without drafts), each run once per module: several
    tests and parametrizations compare speculation with the same plain runs."""
    runs = {}

    def tokens(prompt, n=NEW, **settings):
        key = (tuple(prompt), n, tuple(sorted(settings.items())))
        if key not in runs:
            runs[key] = list(generate(model, prompt, n, **settings))
        return runs[key]

    return tokens


def test_config_keeps_the_mtp_slot():
    config = DS4Config.from_dict(SMALL)
    assert config.num_nextn_predict_layers == 1 and config.mtp_layer_types == (CSA,)
    assert config.layer_types == ("compressed_sparse_attention", SLIDING, "heavily_compressed_attention")
    assert DS4Config.from_dict(config.to_hf_dict()) == config
    without = dict(SMALL, num_nextn_predict_layers=0)
    assert DS4Config.from_dict(without).mtp_layer_types == ()


@torch.no_grad()
def plain_decode(model, prompt, n):
    """Greedy tokens and the fp32 logits each came from, one token per eager decode step."""
    cache = model.new_cache(1, len(prompt) + n)
    logits = prefill(model, cache, torch.tensor([prompt], device=model.device), 4)[0]
    decoder = make_decoder(model, cache, "eager")
    tokens, rows = [], []
    for i in range(n):
        rows.append(logits.float())
        tokens.append(int(logits.argmax()))
        if i + 1 < n:
            logits = decoder.step(torch.tensor([tokens[-1]], device=model.device))[0]
    return tokens, torch.stack(rows)


@pytest.mark.parametrize("draft_tokens", [1, 2, 3])
def test_greedy_speculation_is_plain_greedy(model, plain, draft_tokens):
    for prompt in PROMPTS:
        want = plain(prompt, prefill_chunk=4)
        stats = SpeculationStats()
        spec = list(generate(model, prompt, NEW, prefill_chunk=4, speculative_tokens=draft_tokens, stats=stats))
        assert spec == want
        assert stats.emitted == NEW - 1 and stats.drafted > 0


def test_speculation_after_a_rewind_is_plain_greedy(model):
    """A cache that already holds a conversation, rewound to a checkpoint (main layers only; the
    MTP layer's state is then stale, which costs acceptance, never exactness), continues with
    speculation exactly as without."""
    first, second = PROMPTS[2], [4, 8, 15, 16, 23, 42]
    truth = list(generate(model, first, 24))
    for n in range(2, 24, 3):  # stopped by EOS or by the caller after n tokens, whatever the step accepted
        for eos in [None] + ([truth[n - 1]] if truth[n - 1] not in truth[:n - 1] else []):
            cache = model.new_cache(1, 60)
            tokens = generate(model, first, 40, cache=cache, speculative_tokens=3, eos_token_id=eos)
            got = [next(tokens) for _ in range(n)]
            tokens.close()
            assert got == truth[:n]
            plain = model.new_cache(1, 60)
            list(generate(model, first, n, cache=plain))
            assert int(cache.positions[0]) == int(plain.positions[0])  # every token but the last
            ours, theirs = cache.take_checkpoint(0), plain.take_checkpoint(0)
            for name in theirs:  # the same state (chunked and one-token forwards round alike to 1e-5)
                torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=0)
    outs = []
    for n in (0, 2):
        cache = model.new_cache(1, 160)
        list(generate(model, first, 5, cache=cache, speculative_tokens=n))
        assert int(cache.positions[0]) == len(first) + 4  # every token but the last, as plain decoding
        checkpoint = cache.take_checkpoint(0)
        list(generate(model, second, 30, cache=cache, speculative_tokens=n))
        cache.restore_checkpoint(0, checkpoint)
        outs.append(list(generate(model, second, NEW, cache=cache, speculative_tokens=n)))
    assert outs[0] == outs[1]


def test_checkpoints_can_cover_the_mtp_state(model):
    """take_checkpoint(mtp=True) holds the MTP layer's state too, and a restore rewinds both
    exactly (the MTP layer here is CSA: ring, open windows, overlaps, rows)."""
    cache = model.new_cache(1, 120)
    list(generate(model, PROMPTS[2], 10, cache=cache, speculative_tokens=2))
    checkpoint = cache.take_checkpoint(0, mtp=True)
    assert any(k.startswith("mtp.layers.0.compressor.") for k in checkpoint)
    before = (cache.export_sequence(0), cache.mtp.export_sequence(0))
    list(generate(model, [7, 7, 7], 30, cache=cache, speculative_tokens=2))
    assert int(cache.mtp.positions[0]) > int(before[1]["position"])
    cache.restore_checkpoint(0, checkpoint)
    for got, want in zip((cache.export_sequence(0), cache.mtp.export_sequence(0)), before):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    from ds4_torch.cache import DS4Cache

    without = DS4Cache(model.config.replace(num_nextn_predict_layers=0, mtp_layer_types=()), 1, 120)
    with pytest.raises(ValueError, match="no MTP layers"):
        without.restore_checkpoint(0, checkpoint)


class OracleDrafts(Speculator):
    """Drafts from the known plain continuation, the first `pattern[step]` of them right and
    the rest wrong: every acceptance count, including none and all, at every phase."""

    def __init__(self, truth, pattern, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.truth, self.pattern, self.emitted, self.steps = truth, pattern, 1, 0

    def _draft(self, forwards, n, width):
        right = self.pattern[self.steps % len(self.pattern)]
        drafts = [t if i < right else (t + 1) % 64 for i, t in enumerate(self.truth[self.emitted:self.emitted + n])]
        self.steps += 1
        return torch.tensor([drafts])


@pytest.fixture(scope="module")
def plain_decodes(model):
    """`plain_decode` of each prompt, run once for both parametrizations below."""
    return {tuple(prompt): plain_decode(model, prompt, NEW) for prompt in PROMPTS}


@pytest.mark.parametrize("draft_tokens,pattern", [(1, [0, 1, 1]), (3, [3, 0, 2, 1, 3, 3])])
def test_verified_logits_are_plain_decodes(model, plain_decodes, draft_tokens, pattern):
    """Rollback is exact: the tokens and the fp32 logits of every verified position equal plain
    decoding's (<= 1e-5), whatever was accepted and rejected before."""
    for prompt in PROMPTS:
        truth, plain_rows = plain_decodes[tuple(prompt)]
        sampler = BatchSampler(1, 64)
        sampler.admit(0, SamplingParams())
        cache = model.new_cache(1, len(prompt) + NEW)
        spec = OracleDrafts(truth, pattern, model, cache, sampler, draft_tokens)
        with torch.no_grad():
            first, first_row = spec.start(torch.tensor([prompt]), 4)
            tokens, rows = [first], [first_row.float()[None]]
            while len(tokens) < NEW:
                got, got_rows = spec.step(NEW - len(tokens))
                spec.emitted += len(got)
                tokens += got
                rows.append(got_rows)
        assert tokens == truth
        torch.testing.assert_close(torch.cat(rows), plain_rows, atol=1e-5, rtol=0)
        assert spec.stats.accepted > 0 and spec.stats.accepted < spec.stats.drafted


@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_seeded_sampling_gives_plain_seeded_tokens(model, plain, draft_tokens):
    """Noise of (seed, position) only, and a draft accepted exactly when it is the token the
    target samples there: the same tokens as plain seeded decoding."""
    for i, prompt in enumerate(PROMPTS):
        settings = dict(temperature=0.9, top_k=40, top_p=0.95, seed=100 + i, prefill_chunk=4)
        want = plain(prompt, **settings)
        stats = SpeculationStats()
        assert list(generate(model, prompt, NEW, speculative_tokens=draft_tokens, stats=stats, **settings)) == want
        assert plain(prompt, **dict(settings, seed=999)) != want  # the seed matters


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert int(counts[~keep].sum()) == 0  # nothing drawn where the target has no mass
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_matches_the_target():
    """Each emitted token is distributed as the target at its position, whatever the drafts'
    distribution; the acceptance rate of a draft is sum(min(p, q)). Fixed seeds."""
    g = torch.Generator().manual_seed(7)
    V, runs = 6, 20000
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    p[0, 5] = 0.0
    p[0] /= p[0].sum()  # a token the target never emits
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    first, second = torch.zeros(V), torch.zeros(V)
    accepted_first = 0
    for _ in range(runs):
        drafts = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(2)])
        out = rejection_sample(p, q, drafts, g)
        first[out[0]] += 1
        if len(out) > 1:
            accepted_first += 1
            second[out[1]] += 1
    # chi-square critical value, 5 degrees of freedom, p = 0.001: 20.52
    assert _chi2(first, p[0]) < 20.52
    assert _chi2(second, p[1]) < 20.52
    rate = float(torch.minimum(p[0], q[0]).sum())
    assert abs(accepted_first / runs - rate) < 4 * math.sqrt(rate * (1 - rate) / runs)


def test_rejection_speculator_samples_the_model(model):
    """End to end through the model: the first two tokens after a prompt (the second from one
    verify step with one draft, accepted or not) are distributed as the model's own two steps.
    1000 independent runs as the rows of one batch (each row its own seed and draws)."""
    prompt, runs = [5, 9, 11, 2, 40, 33, 7], 1000
    sampler = BatchSampler(1, 64)
    sampler.admit(0, SamplingParams(temperature=1.5, top_k=4))
    with torch.no_grad():
        first = sampler.probabilities(prefill(model, model.new_cache(1, 8), torch.tensor([prompt])))[0]
        joint = torch.zeros(64, 64)
        for t in torch.nonzero(first).flatten().tolist():
            logits = prefill(model, model.new_cache(1, 8), torch.tensor([prompt + [t]]))
            joint[t] = first[t] * sampler.probabilities(logits)[0]
        sampler = BatchSampler(runs, 64)
        for run in range(runs):
            sampler.admit(run, SamplingParams(temperature=1.5, top_k=4, seed=run))
        cache = model.new_cache(runs, len(prompt) + 2)
        spec = Speculator(model, cache, sampler, 1, acceptance="rejection", generator=torch.Generator().manual_seed(11),
                          batch=runs)
        firsts, _ = spec.start_batch([prompt] * runs, 8)
        seconds, _ = spec.step_batch([2] * runs)
        counts = torch.zeros(64, 64)
        for t, out in zip(firsts, seconds):
            counts[t, out[0]] += 1
    support = joint > 0
    assert int(counts[~support].sum()) == 0
    assert spec.stats.drafted == runs and 0 < spec.stats.accepted < runs  # both paths taken
    # 16 cells (top-k 4 twice): chi-square, 15 degrees of freedom, p = 0.001: 37.70
    assert _chi2(counts[support], joint[support]) < 37.70


def plain_probabilities(logits, params, output, prompt, eos, allowed=None):
    """The distribution plain sampling (`sample()`) draws from after `output`, step by step from
    its definition: `adjust_logits` (mask, min_tokens bans, penalties), the temperature, the filters."""
    x = adjust_logits(logits, params, output, prompt, eos, allowed) / params.temperature
    kept = filter_logits(x[None], top_k=torch.tensor([params.top_k]) if params.top_k else None,
                         top_p=torch.tensor([params.top_p]) if params.top_p < 1 else None)[0]
    return torch.softmax(kept, -1)


def test_rejection_targets_are_plain_sampling_after_the_drafts(model, monkeypatch):
    """acceptance="rejection": the target at verified position j is the distribution plain
    sampling uses after the tokens so far and drafts d0..d(j-1): the penalties count those drafts,
    and min_tokens counts them as generated (the stop tokens' ban ends inside the step)."""
    import ds4_torch.speculative as speculative

    prompt, eos = [5, 9, 11, 2, 40, 33, 7], [7, 9, 33]
    params = SamplingParams(temperature=1.3, top_k=20, top_p=0.95, presence_penalty=1.5, frequency_penalty=0.8,
                            repetition_penalty=1.6, min_tokens=3, stop_token_ids=[11, 40])
    seen = []
    accept, sample_rejection = Speculator._accept, speculative.rejection_sample

    def spy_accept(self, rows, drafts, n, *args, **kwargs):
        seen.append({"rows": rows[0].clone(), "drafts": drafts[0].tolist()})
        return accept(self, rows, drafts, n, *args, **kwargs)

    def spy_rejection(target, draft, drafts, generator=None):
        seen[-1]["target"] = target.clone()
        return sample_rejection(target, draft, drafts, generator)

    monkeypatch.setattr(Speculator, "_accept", spy_accept)
    monkeypatch.setattr(speculative, "rejection_sample", spy_rejection)
    sampler = BatchSampler(1, 64)
    sampler.admit(0, params, prompt_ids=prompt, eos_ids=eos)
    cache = model.new_cache(1, len(prompt) + 16)
    spec = Speculator(model, cache, sampler, 3, acceptance="rejection", generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        output = [spec.start(torch.tensor([prompt]), 8)[0]]
        for _ in range(3):
            before = list(output)
            output += spec.step(4)[0]
            step = seen[-1]
            assert len(step["drafts"]) == 3
            for j in range(4):
                want = plain_probabilities(step["rows"][j], params, before + step["drafts"][:j], prompt, eos)
                torch.testing.assert_close(step["target"][j], want, rtol=1e-5, atol=1e-6)
    # the min_tokens ban ended inside the first step: its first rows ban the stop tokens, later ones not
    first = seen[0]["target"]
    assert first[0, [7, 9, 33, 11, 40]].sum() == 0 and first[2, [7, 9, 33, 11, 40]].sum() > 0


def test_rejection_speculation_never_emits_a_masked_token(model, monkeypatch):
    """A grammar mask handed to a rejection-sampling step (`allowed`, limit 1) allowing the odd
    token ids only: the target is plain sampling's masked distribution, and 100 seeded sequences
    (the rows of one batched step) emit only allowed tokens (unmasked, about half of the model's
    mass is on even ids)."""
    import ds4_torch.speculative as speculative

    prompt, runs = [5, 9, 11, 2, 40, 33, 7], 100
    allowed = torch.arange(64) % 2 == 1
    targets, sample_rejection = [], speculative.rejection_sample
    monkeypatch.setattr(speculative, "rejection_sample",
                        lambda target, *args: targets.append(target.clone()) or sample_rejection(target, *args))
    sampler = BatchSampler(runs, 64)
    params = [SamplingParams(temperature=1.0, seed=run) for run in range(runs)]
    for run in range(runs):
        sampler.admit(run, params[run])
    cache = model.new_cache(runs, len(prompt) + 2)
    with torch.no_grad():
        spec = Speculator(model, cache, sampler, 2, acceptance="rejection", generator=torch.Generator().manual_seed(3),
                          batch=runs)
        firsts, _ = spec.start_batch([prompt] * runs, 8)
        tokens, rows = spec.step_batch([1] * runs, allowed=allowed.expand(runs, -1))
        with pytest.raises(ValueError, match="steps every row"):  # an idle row would lose its draft's distribution
            spec.step_batch([1] * (runs - 1) + [0])
    assert len(targets) == runs  # row by row
    masked_mass = []
    for run in range(runs):
        assert len(tokens[run]) == 1 and allowed[tokens[run][0]], (run, tokens[run])
        want = plain_probabilities(rows[run][0], params[run], [firsts[run]], prompt, [], allowed)
        torch.testing.assert_close(targets[run][0], want, rtol=1e-5, atol=1e-6)
        masked_mass.append(float(torch.softmax(rows[run][0], -1)[~allowed].sum()))
    assert sum(masked_mass) / len(masked_mass) > 0.3  # the mask really cuts


def test_rejection_speculator_reused_for_a_new_sequence_judges_drafts_by_their_own_distribution(model, monkeypatch):
    """A Speculator started again on another prompt (or after reset()): rejection_sample is told
    the distribution each draft was drawn from, not one left over from the previous sequence."""
    import ds4_torch.speculative as speculative

    picks, pick, sample_rejection = [], Speculator._pick, speculative.rejection_sample

    def spy_pick(self, *args):
        drafts = pick(self, *args)
        picks.append((int(drafts[0]), self.draft_probs[-1][0].clone()))  # (row 0 of [B, V])
        return drafts

    def spy_rejection(target, draft, drafts, generator=None):
        token, q = picks[-1]  # one draft a step: the last pick drew it
        assert int(drafts[0]) == token and torch.equal(draft[0], q)
        return sample_rejection(target, draft, drafts, generator)

    monkeypatch.setattr(Speculator, "_pick", spy_pick)
    monkeypatch.setattr(speculative, "rejection_sample", spy_rejection)
    sampler = BatchSampler(1, 64)
    cache = model.new_cache(1, 24)
    spec = Speculator(model, cache, sampler, 1, acceptance="rejection", generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            cache.reset()
            if i == 2:
                spec.reset()
            sampler.admit(0, SamplingParams(temperature=1.0, seed=i))
            spec.start(torch.tensor([prompt]), 8)
            for _ in range(2):
                spec.step(2)
    assert len(picks) == 3 * 3


def test_mtp_checkpoint_loads_in_both_name_styles(model, tmp_path):
    """A real-layout synthetic checkpoint with mtp.* weights: HF-style names, and DeepSeek's
    upstream names with FP8 block-quantized linears (the MTP layer's too); both load exactly
    and speculate."""
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    loaded = DS4ForCausalLM.from_pretrained(hf)
    assert {k for k in loaded.state_dict() if k.startswith("mtp.0.")} >= {"mtp.0.e_proj.weight", "mtp.0.norm.weight",
                                                                          "mtp.0.hc_head.hc_fn"}
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k

    ckpt, expected = fp8_checkpoint(model, "float32", upstream=True)
    assert ckpt["mtp.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn and "mtp.0.attn.wq_a.scale" in ckpt
    assert {"mtp.0.hc_head_fn", "mtp.0.norm.weight", "mtp.0.enorm.weight", "mtp.0.ffn.experts.3.w2.weight",
            "mtp.0.attn.compressor.norm.weight", "mtp.0.attn.indexer.wq_b.weight"} <= set(ckpt)
    up = save_single(ckpt, tmp_path / "upstream")
    model.config.save(up)
    loaded = DS4ForCausalLM.from_pretrained(up)
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    plain = list(generate(loaded, PROMPTS[1], 20))
    assert list(generate(loaded, PROMPTS[1], 20, speculative_tokens=2)) == plain


def test_checkpoint_without_mtp_weights_loads_without_the_layer(model, tmp_path):
    """A config naming an MTP layer whose checkpoint ships none (transformers' save_pretrained
    drops them) loads the main model alone, with the same logits; speculation then says why not."""
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    save_single(state, tmp_path)
    model.config.save(tmp_path)
    loaded = DS4ForCausalLM.from_pretrained(tmp_path)
    assert not hasattr(loaded, "mtp") and loaded.new_cache(1, 8).mtp is None
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    with pytest.raises(ValueError, match="MTP layer"):
        next(generate(loaded, [1], 4, speculative_tokens=1))


# --------------------------------------------------------------------------- the embedded model
HELD_OUT = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare_held_out.txt"


@pytest.fixture(scope="module")
def embedded():
    from ds4_torch.default_model import build_default_model, default_tokenizer

    return build_default_model(), default_tokenizer()


def test_embedded_mtp_drafts_well_on_held_out_text(embedded):
    """The shipped MTP layer is the trained one: on held-out Shakespeare, greedy, one draft token,
    it emits well over one token per verify step (an untrained layer: about 1.1), and the tokens
    are plain greedy's."""
    model, tok = embedded
    assert model.config.num_nextn_predict_layers == 1 and model.mtp is not None
    text = HELD_OUT.read_text(encoding="utf-8")
    stats = SpeculationStats()
    for start in (0, 800, 1600):
        ids = tok.encode(text[start:start + 200])
        plain = list(generate(model, ids, 48))
        assert list(generate(model, ids, 48, speculative_tokens=1, stats=stats)) == plain
    assert stats.acceptance_length > 1.5
    seeded = SpeculationStats()  # sampled at 0.7 with a seed: plain seeded decoding's tokens, drafts accepted
    for n in (1, 3):
        ids = tok.encode(text[400:600])
        plain = list(generate(model, ids, 48, temperature=0.7, seed=5))
        assert list(generate(model, ids, 48, temperature=0.7, seed=5, speculative_tokens=n, stats=seeded)) == plain
    assert seeded.accepted > seeded.drafted / 3


def test_cli_speculative_tokens(embedded, capsys):
    from ds4_torch.cli import main

    outs = []
    for n in ("0", "2"):
        assert main(["generate", "-p", "To be, or not to be", "-n", "40", "--speculative-tokens", n]) == 0
        captured = capsys.readouterr()
        outs.append(captured.out)
    assert outs[0] == outs[1]
    assert "accepted" in captured.err and "tokens per verify step" in captured.err
    with pytest.raises(SystemExit):  # argparse: 0-3 only
        main(["generate", "-p", "x", "--speculative-tokens", "4"])


def test_bench_speculative_reports_counts_and_costs(embedded, capsys, tmp_path):
    """`bench speculative`: per N the drafted and accepted counts (consistent with the acceptance
    length), the cost ratios, the prediction from them and the V4-Flash projection's formula."""
    import csv

    from ds4_torch.cli import main

    table = tmp_path / "spec.csv"
    assert main(["bench", "speculative", "--new-tokens", "12", "--speculative-tokens", "1", "2", "--repeats", "1",
                 "--threads", "1", "--csv", str(table)]) == 0
    out = capsys.readouterr().out
    assert "V4-Flash" in out and "12/12" in out
    rows = list(csv.DictReader(table.open()))
    assert [int(r["draft_tokens"]) for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        n, a = int(r["draft_tokens"]), float(r["acceptance_length"])
        drafted, accepted = int(r["drafted"]), int(r["accepted"])
        steps = (11 - accepted) if n else 0  # 11 tokens after the first: emitted = accepted + steps
        assert 0 < drafted <= n * steps and a == pytest.approx(11 / steps)
        assert float(r["v4_flash_speedup"]) == pytest.approx(a / (1 + n / 43))
        assert float(r["predicted_speedup"]) == pytest.approx(a / (float(r["verify_cost"]) + float(r["mtp_cost"])))
        assert float(r["verify_cost"]) > 0 and float(r["mtp_cost"]) > 0  # timed ratios: their sizes are the machine's
