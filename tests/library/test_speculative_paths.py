"""Speculative decoding through every decode path (issue #24): batches of prompts of different
lengths, greedy, 70 tokens each (window 5, rates 2 and 3: many window ends, ring wraps and
compressed rows crossed by accepted and rejected drafts), eager, captured (the CUDA-graph path;
on a CPU its make_fx emulator, which freezes host-read values as a CUDA graph would) and
torch.compile: the tokens of plain greedy decoding of each prompt alone, and the fp32 logits of
every verified position those of plain one-token decode steps (<= 1e-5)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from ds4_torch import DS4Config, DS4ForCausalLM
from ds4_torch.cache import Rollback
from ds4_torch.decode import CompiledForwards, GraphForwards, make_decoder, prefill
from ds4_torch.paged import PagedDS4Cache
from ds4_torch.sampling import BatchSampler, SamplingParams
from ds4_torch.speculative import Speculator
from oracle import randomise
from test_speculative import NEW, SMALL, plain_decode

torch.set_num_threads(1)

PROMPTS = [[3], list(range(1, 8)), [5, 9, 11, 2, 40, 33, 7, 7, 1, 60, 22, 13]]


@pytest.fixture(scope="module")
def model():
    m = DS4ForCausalLM(DS4Config.from_dict(SMALL))
    randomise(m, 3)
    return m.eval()


@pytest.fixture(scope="module")
def truth(model):
    return [plain_decode(model, p, NEW) for p in PROMPTS]


def speculate_batch(model, prompts, n, mode="eager", forwards=None, new=NEW, cut=True, paged=False, room=None):
    """Greedy speculation of every prompt in one batch: per prompt, its first `new` tokens and
    the fp32 logits each came from; and the speculator (stats, forwards). `cut`: the last steps
    draft fewer tokens to stop at `new` (else every step drafts n, and the extra is dropped).
    `paged`: over a `PagedDS4Cache` of 6-token blocks. `room`: the cache sized for that many new
    tokens (default `new`; the cache's size is in its shapes, so runs compared bit for bit share it)."""
    B = len(prompts)
    ctx = max(map(len, prompts)) + (room or new) + 2 * n + 2
    cache = PagedDS4Cache(model.config, B, ctx, block_tokens=6) if paged else model.new_cache(B, ctx)
    sampler = BatchSampler(B, model.config.vocab_size, model.device)
    for b in range(B):
        sampler.admit(b, SamplingParams())
    spec = Speculator(model, cache, sampler, n, batch=B, mode=mode)
    if forwards is not None:
        spec.forwards = spec._forwards[B] = forwards(spec.cache)  # every step runs the B rows
        spec.grad_off = torch.no_grad
    with torch.no_grad():
        firsts, first_rows = spec.start_batch(prompts, 4)
        tokens = [[t] for t in firsts]
        rows = [[r.float()[None]] for r in first_rows]
        while min(map(len, tokens)) < new:
            got, got_rows = spec.step_batch([max(1, new - len(t)) if cut else n + 1 for t in tokens])
            for b in range(B):
                tokens[b] += got[b]
                rows[b].append(got_rows[b])
    return [t[:new] for t in tokens], [torch.cat(r)[:new] for r in rows], spec


def check(truth, tokens, rows):
    for (want_tokens, want_rows), got_tokens, got_rows in zip(truth, tokens, rows):
        assert got_tokens == want_tokens
        torch.testing.assert_close(got_rows, want_rows, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_eager_batch_is_plain_greedy(model, truth, n):
    tokens, rows, spec = speculate_batch(model, PROMPTS, n)
    check(truth, tokens, rows)
    assert 0 < spec.stats.accepted < spec.stats.drafted


@pytest.mark.parametrize("n", [1, 3])
def test_graph_path_batch_is_plain_greedy(model, truth, n):
    """Captured forwards (emulator here): one capture per kind and shape, replayed every step."""
    tokens, rows, spec = speculate_batch(model, PROMPTS, n, mode="graph")
    assert isinstance(spec.forwards, GraphForwards) and spec.forwards.backend in ("emulator", "cuda")
    check(truth, tokens, rows)
    # one capture per kind, of the one 1 + n bucket (the last steps keep fewer tokens, not a new shape)
    # (and each one-token draft pass of a step its own, so its record lives until its rollback),
    # each with its captured rollback
    keys = [("verify", 0, (3, 1 + n)), ("catch_up", 0, (3, 1 + n, 2, 32), (3, 1 + n), (3,))]
    keys += [("mtp", k, (3, 1, 2, 32), (3, 1)) for k in range(1, n)]
    assert sorted(spec.forwards.graphs) == sorted(spec.forwards.rollbacks) == sorted(keys)
    assert 0 < spec.stats.accepted < spec.stats.drafted


def test_graph_path_refuses_a_host_read_in_a_step(model, monkeypatch):
    """The emulator checks the speculative forwards as it checks decode steps: a rollback whose
    start is read back to the host (an int() in the step) cannot be captured."""
    original = Rollback.begin

    def reads_position(self, cache, T):
        original(self, cache, T)
        self.start = torch.full_like(self.start, int(cache.positions[0]))

    monkeypatch.setattr(Rollback, "begin", reads_position)
    with pytest.raises(RuntimeError, match="tracing tensor"):
        speculate_batch(model, PROMPTS[:1], 2, mode="graph", new=10)
    monkeypatch.setattr(Rollback, "begin", original)
    tokens, _, _ = speculate_batch(model, PROMPTS[:1], 2, mode="eager", new=10)  # eager takes it
    apply = Rollback.apply

    def reads_keep(self, keep):  # the rollback is captured too: a branch on the acceptance fails
        if int(keep[0]) < self.T:
            apply(self, keep)

    monkeypatch.setattr(Rollback, "apply", reads_keep)
    with pytest.raises(RuntimeError, match="tracing tensor"):
        speculate_batch(model, PROMPTS[:1], 2, mode="graph", new=10)


@pytest.fixture(scope="module")
def compiled(model):
    """torch.compile(fullgraph=True) of the three forwards (aot_eager: dynamo's capture without
    the C++ build), N = 2, every step drafting N (so a run's first k tokens are those of any
    longer run): two batches in turn (the second a new cache and speculator, as the next request
    is), and dynamo's graph-break and unique-graph counts over both. Compiled once for the tests
    below."""
    torch._dynamo.reset()
    counters.clear()
    runs = [speculate_batch(model, PROMPTS, 2, cut=False,
                            forwards=lambda cache: CompiledForwards(model, cache, backend="aot_eager"))[:2]
            for _ in range(2)]
    return runs, dict(counters["graph_break"]), counters["stats"]["unique_graphs"]


def test_compiled_batch_is_plain_greedy_without_graph_breaks(truth, compiled):
    """One graph per kind and shape, none recompiled across positions or for a new cache."""
    runs, graph_breaks, unique_graphs = compiled
    for tokens, rows in runs:  # the second reuses the compiled functions
        check(truth, tokens, rows)
    assert not graph_breaks
    assert unique_graphs <= 3


@torch.no_grad()
def test_compiled_batch_over_a_paged_cache_is_the_static_ones(model, truth, compiled):
    """The compiled forwards over a paged cache: the static cache's tokens and logits, bit for bit
    (a cache of the same size: the static run's first 30 tokens are those of a 30-token run)."""
    static = [tokens[:30] for tokens in compiled[0][0][0]], [rows[:30] for rows in compiled[0][0][1]]
    counters.clear()
    paged = speculate_batch(model, PROMPTS, 2, cut=False, paged=True, new=30, room=NEW,
                            forwards=lambda cache: CompiledForwards(model, cache, backend="aot_eager"))
    check([(tokens[:30], rows[:30]) for tokens, rows in truth], *paged[:2])
    assert paged[0] == static[0] and all(torch.equal(a, b) for a, b in zip(paged[1], static[1]))
    assert not counters["graph_break"]


@torch.no_grad()
def test_graph_path_stopped_mid_step_leaves_plain_decodings_cache(model):
    """Stopped by the caller mid-step, the captured rollback runs again with fewer tokens kept:
    the cache holds what plain decoding's holds (every token but the last one taken)."""
    from ds4_torch import generate

    prompt = PROMPTS[2]
    truth = list(generate(model, prompt, 30))
    for n in (3, 8, 13):
        cache = model.new_cache(1, 60)
        tokens = generate(model, prompt, 40, cache=cache, speculative_tokens=3, decode_mode="graph")
        got = [next(tokens) for _ in range(n)]
        tokens.close()
        assert got == truth[:n]
        plain = model.new_cache(1, 60)
        list(generate(model, prompt, n, cache=plain))
        assert int(cache.positions[0]) == int(plain.positions[0])
        ours, theirs = cache.take_checkpoint(0), plain.take_checkpoint(0)
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_rows_join_and_idle_in_a_running_batch(model, truth, mode):
    """Continuous batching: row 2 joins after 3 steps (start_row), row 0 sits idle (limit 0) for
    two steps in the middle; every row's tokens and logits are still plain greedy's."""
    B, n = 3, 2
    cache = model.new_cache(B, 120)
    sampler = BatchSampler(B, model.config.vocab_size)
    for b in range(B):
        sampler.admit(b, SamplingParams())
    spec = Speculator(model, cache, sampler, n, batch=B, mode=mode)
    tokens, rows = [[] for _ in range(B)], [[] for _ in range(B)]

    def start(b):
        t, r = spec.start_row(b, PROMPTS[b], 4)
        tokens[b].append(t)
        rows[b].append(r.float()[None])

    with torch.no_grad():
        start(0)
        start(1)
        for step in range(40):
            if step == 3:
                start(2)
            limits = [n + 1] * B
            if step < 3:
                limits[2] = 0  # not started yet
            if step in (6, 7):
                limits[0] = 0
            got, got_rows = spec.step_batch(limits)
            for b in range(B):
                tokens[b] += got[b]
                rows[b].append(got_rows[b])
                if limits[b] == 0:
                    assert got[b] == []
    for b, (want_tokens, want_rows) in enumerate(truth):
        k = min(len(tokens[b]), NEW)
        assert k >= 37 and tokens[b][:k] == want_tokens[:k]
        torch.testing.assert_close(torch.cat(rows[b])[:k], want_rows[:k], atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("n", [1, 3])
def test_penalties_and_min_tokens_see_the_drafts_before_a_verified_row(model, n):
    """With repetition, frequency and presence penalties and min_tokens, seeded: the verified row
    after accepted drafts is drawn with them in its history (and counted for min_tokens), so the
    tokens are plain seeded decoding's with the same sampler settings."""
    settings = [SamplingParams(temperature=0.5, seed=3, repetition_penalty=3.0, min_tokens=12),
                SamplingParams(frequency_penalty=2.0, presence_penalty=1.0, min_tokens=5),  # greedy
                SamplingParams(repetition_penalty=5.0)]  # greedy
    eos = [36]  # a token plain greedy decoding of these prompts emits: min_tokens bans it early
    B, new = len(PROMPTS), 40
    plain = []
    for b, prompt in enumerate(PROMPTS):
        sampler = BatchSampler(1, model.config.vocab_size)
        sampler.admit(0, settings[b], prompt_ids=prompt, eos_ids=eos)
        cache = model.new_cache(1, len(prompt) + new)
        logits = prefill(model, cache, torch.tensor([prompt]), 4)
        decoder, out = make_decoder(model, cache, "eager"), []
        for i in range(new):
            token = sampler.sample(logits).tokens
            sampler.append(token)
            out.append(int(token))
            if i + 1 < new:
                logits = decoder.step(token)
        plain.append(out)

    class Oracle(Speculator):  # drafts from the plain continuation: every one right, all accepted
        def _draft(self, forwards, k, width):
            return torch.tensor([(plain[b] + [0] * 8)[len(tokens[b]):len(tokens[b]) + k] for b in range(B)])

    for cls in (Speculator, Oracle):
        sampler = BatchSampler(B, model.config.vocab_size)
        for b, prompt in enumerate(PROMPTS):
            sampler.admit(b, settings[b], prompt_ids=prompt, eos_ids=eos)
        spec = cls(model, model.new_cache(B, 64), sampler, n, batch=B)
        tokens = [[t] for t in spec.start_batch(PROMPTS, 4)[0]]
        while min(map(len, tokens)) < new:
            for b, got in enumerate(spec.step_batch([n + 1] * B)[0]):
                tokens[b] += got
        assert [t[:new] for t in tokens] == plain, cls.__name__
        assert spec.stats.accepted > (spec.stats.drafted * 0.9 if cls is Oracle else 0)
