"""Our model against transformers' DeepseekV4ForCausalLM (fp32, tiny random configs).

Every test loads the oracle's `save_pretrained` checkpoint with our `from_pretrained`, so the
loader is on the path too. Tolerance: 1e-4 on logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ds4_torch import DS4ForCausalLM
from ds4_torch.kernels import attention_ops, reference
from oracle import hf_logits_incremental, make_oracle

TOL = 1e-4


class TieWatch:
    """Wraps the reference indexer and records, over every call, the smallest gap between the
    k-th and (k+1)-th best visible score: a tie there would make the selection arbitrary."""

    def __init__(self):
        self.min_gap = float("inf")
        self.calls = 0

    def __call__(self, q, head_weights, rows, start, rate, k):
        visible = reference.visible_rows(start, q.shape[1], rows.shape[1], rate)
        scores = reference.indexer_scores(q, head_weights, rows).masked_fill(~visible, float("-inf"))
        if scores.shape[-1] > k:
            top = scores.topk(k + 1, dim=-1).values
            active = visible.sum(-1) > k  # only queries where the indexer actually drops rows
            if active.any():
                self.calls += 1
                self.min_gap = min(self.min_gap, float((top[..., k - 1] - top[..., k])[active].min()))
        return reference.indexer_topk(q, head_weights, rows, start, rate, k)


def load_ours(path, watch: TieWatch | None = None):
    model = DS4ForCausalLM.from_pretrained(path, dtype=torch.float32)
    if watch is not None:
        model.ops = dataclasses.replace(attention_ops("torch"), indexer_topk=watch)
    return model


def random_ids(batch, length, vocab=101, seed=1):
    return torch.randint(2, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


CONFIGS = {
    # every layer kind, CSA rate 4 != HCA rate 8, window 6 (a multiple of neither), hash layers
    "base": {},
    # another shape: larger window than the HCA rate, CSA rate 2, two hc streams, topk 2
    "alt": dict(sliding_window=11, compress_rates={"compressed_sparse_attention": 2,
                                                   "heavily_compressed_attention": 5},
                hc_mult=2, index_topk=2, num_hidden_layers=4,
                layer_types=["compressed_sparse_attention", "sliding_attention",
                             "heavily_compressed_attention", "compressed_sparse_attention"],
                mlp_layer_types=["hash_moe", "moe", "moe", "moe"]),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def oracle(request, tmp_path_factory):
    hf, path = make_oracle(tmp_path_factory.mktemp(request.param), seed=len(request.param), **CONFIGS[request.param])
    return hf, path


@torch.no_grad()
def test_stateless_forward_matches(oracle):
    hf, path = oracle
    watch = TieWatch()
    ours = load_ours(path, watch)
    ids = random_ids(1, 48)
    diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= TOL
    assert watch.calls > 0 and watch.min_gap > 1e-5


@torch.no_grad()
def test_chunked_prefill_uneven_chunks(oracle):
    hf, path = oracle
    ours = load_ours(path)
    ids = random_ids(1, 53, seed=2)
    expected = hf(ids).logits
    cache = ours.new_cache(1, 64)
    chunks, got, pos = [5, 1, 13, 3, 2, 17, 12], [], 0
    for n in chunks:
        got.append(ours(ids[:, pos:pos + n], cache=cache))
        pos += n
    assert pos == 53 and int(cache.positions[0]) == 53
    assert (torch.cat(got, 1) - expected).abs().max().item() <= TOL


@torch.no_grad()
def test_decode_past_window_and_compressions(oracle):
    hf, path = oracle
    watch = TieWatch()
    ours = load_ours(path, watch)
    prompt, steps = 9, 48  # 48 decodes: many ring wraps and >= 5 compressions of each rate
    ids = random_ids(1, prompt + steps, seed=3)
    expected = hf_logits_incremental(hf, ids, [prompt] + [1] * steps)
    cache = ours.new_cache(1, 80)
    got = [ours(ids[:, :prompt], cache=cache)]
    got += [ours(ids[:, t:t + 1], cache=cache) for t in range(prompt, prompt + steps)]
    diffs = (torch.cat(got, 1) - expected).abs().amax(dim=(0, 2))
    assert diffs.max().item() <= TOL, f"worst step {int(diffs.argmax())}: {diffs.max().item()}"
    assert watch.calls > 0 and watch.min_gap > 1e-5


@torch.no_grad()
def test_batch_of_two(oracle):
    hf, path = oracle
    ours = load_ours(path)
    ids = random_ids(2, 30, seed=4)
    expected = hf_logits_incremental(hf, ids, [11] + [1] * 19)
    cache = ours.new_cache(2, 40)
    got = [ours(ids[:, :11], cache=cache)] + [ours(ids[:, t:t + 1], cache=cache) for t in range(11, 30)]
    assert (torch.cat(got, 1) - expected).abs().max().item() <= TOL
    assert (ours(ids) - hf(ids).logits).abs().max().item() <= TOL


@torch.no_grad()
def test_batch_at_staggered_positions(oracle):
    """Sequences at different positions share one batched decode and each still matches its own
    transformers run."""
    hf, path = oracle
    ours = load_ours(path)
    prompt_lens, steps = (3, 14, 25), 17
    seqs = [random_ids(1, n + steps, seed=10 + n) for n in prompt_lens]
    batch = ours.new_cache(len(seqs), 64)
    for i, (ids, n) in enumerate(zip(seqs, prompt_lens)):
        single = ours.new_cache(1, 64)
        ours(ids[:, :n], cache=single)
        batch.copy_sequence(i, 0, single)
    assert batch.positions.tolist() == list(prompt_lens)
    got = []
    for s in range(steps):
        step_ids = torch.cat([ids[:, n + s:n + s + 1] for ids, n in zip(seqs, prompt_lens)])
        got.append(ours(step_ids, cache=batch))
    got = torch.cat(got, 1)
    for i, (ids, n) in enumerate(zip(seqs, prompt_lens)):
        expected = hf(ids).logits[:, n:]
        assert (got[i:i + 1] - expected).abs().max().item() <= TOL, f"sequence {i}"
