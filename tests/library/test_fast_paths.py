"""The fast paths of the model and the reference ops against plain, independent formulations.

Each fast path (blocked indexer scan, key-based top-k, Sinkhorn in its matmul layout, RoPE from
tables, attention by parts, the one-token compressor step, the output head on the last tokens
only) is checked here against the straightforward way of computing the same thing, written in
the test; the transformers parity tests check the whole model on top.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ds4_torch import DS4Config, DS4ForCausalLM
from ds4_torch.kernels import reference
from ds4_torch.kernels.sinkhorn import sinkhorn_torch as sinkhorn
from oracle import randomise
from test_decode import SMALL


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- indexer
def plain_scores(q, w, rows):
    """sum_h w_h * relu(q_h . row) * dI^-1/2, all at once in fp32 (transformers' order of ops)."""
    dots = torch.einsum("bthd,bcd->bthc", q.float(), rows.float())
    return (torch.relu(dots) * q.shape[-1] ** -0.5 * w.float()[..., None]).sum(2)


@pytest.mark.parametrize("T,C", [(1, 5000), (3, 700), (1, 70000)])
def test_blocked_scan_equals_plain_scores(T, C):
    """Several row blocks (4096 rows at T=1), a partial last one, and the oneDNN path for big
    blocks: the same scores as the one-shot formula."""
    q, w, rows = randn(1, T, 8, 16, seed=1), randn(1, T, 8, seed=2) * 8 ** -0.5, randn(1, C, 16, seed=3)
    with torch.no_grad():
        got = reference.indexer_scores(q, w, rows)
    expected = plain_scores(q, w, rows)
    assert got.shape == (1, T, C)
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_bf16_rows_are_scored_in_fp32():
    q, w, rows = randn(1, 1, 8, 16, seed=4), randn(1, 1, 8, seed=5), randn(1, 9000, 16, seed=6).bfloat16()
    with torch.no_grad():
        got = reference.indexer_scores(q, w, rows)
    assert got.dtype == torch.float32
    assert (got - plain_scores(q, w, rows.float())).abs().max().item() <= 1e-5 * got.abs().max().item()


def stable_sort_topk(scores, k):
    """The tie rule spelled out: a stable descending sort keeps equal scores in index order."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


@pytest.mark.parametrize("C,k", [(10, 3), (300, 17), (5000, 512), (70000, 512)])
def test_topk_lower_index_wins_equals_stable_sort(C, k):
    """Scores with many exact ties (a few distinct values, +0.0 and -0.0, negatives, -inf for
    invisible rows): the key-based top-k picks what a stable sort picks, in the same order."""
    g = torch.Generator().manual_seed(C)
    values = torch.tensor([1.5, 0.25, 0.0, -0.0, -0.75, -3.0, float("-inf")])
    scores = values[torch.randint(len(values), (2, 3, C), generator=g)]
    scores[0, 0, : C // 2] = float("-inf")  # a query that sees only the second half
    got = reference.topk_lower_index_wins(scores, k)
    assert got.tolist() == stable_sort_topk(scores, k).tolist()


def test_indexer_topk_matches_sort_based_rule():
    """The whole indexer op against the plain scores + stable sort + -1 past the visible rows,
    across visibility edges (rows becoming visible as the query advances)."""
    q, w, rows = randn(2, 4, 8, 16, seed=7), randn(2, 4, 8, seed=8) * 8 ** -0.5, randn(2, 40, 16, seed=9)
    start, rate, k = torch.tensor([9, 150]), 2, 6
    got = reference.indexer_topk(q, w, rows, start, rate, k)
    visible = torch.arange(40) < ((start[:, None] + torch.arange(4) + 1) // rate)[..., None]
    order = stable_sort_topk(plain_scores(q, w, rows).masked_fill(~visible, float("-inf")), k)
    expected = torch.where(visible.gather(-1, order), order, -1)
    assert got.tolist() == expected.tolist()
    assert (got[0, 0] == -1).sum() == k - 5  # query at position 9 sees 5 rows


# --------------------------------------------------------------------------- Sinkhorn, RoPE
def plain_sinkhorn(comb, iters, eps):
    """transformers' loop."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("shape", [(1, 1, 4, 4), (2, 150, 4, 4), (1, 3, 2, 2)])
@pytest.mark.parametrize("grad", [False, True])
def test_sinkhorn_equals_the_plain_loop(shape, grad):
    comb = torch.rand(shape, generator=torch.Generator().manual_seed(1)) + 0.05
    comb.requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        got = sinkhorn(comb, 20, 1e-6)
        expected = plain_sinkhorn(comb, 20, 1e-6)
    assert got.shape == shape and got.is_contiguous()
    assert (got - expected).abs().max().item() <= 1e-6
    if grad:  # differentiable where autograd records (training)
        (g_got,) = torch.autograd.grad(got.square().sum(), comb)
        (g_exp,) = torch.autograd.grad(expected.square().sum(), comb)
        assert (g_got - g_exp).abs().max().item() <= 1e-5


def plain_rope(x, cos, sin):
    """Interleaved RoPE as transformers writes it: full-width cos/sin, rotate_half."""
    if x.dim() == cos.dim() + 1:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    R = cos.shape[-1]
    rope = x[..., -R:]
    half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([x[..., :-R], rope * cos + half * sin], dim=-1)


@pytest.mark.parametrize("heads", [False, True])
def test_rope_tables_equal_the_plain_formula(heads):
    x = randn(2, 5, 3, 32, seed=1) if heads else randn(2, 5, 32, seed=1)
    angles = randn(2, 5, 8, seed=2) * 4
    cos, sin = angles.cos(), angles.sin()
    expected = plain_rope(x, cos, sin)
    assert (reference.apply_rope(x, cos, sin) - expected).abs().max().item() <= 1e-6
    assert (reference.rotate(x, reference.rope_tables(cos, sin)) - expected).abs().max().item() <= 1e-6
    back = reference.rotate(expected, reference.rope_tables(cos, -sin))  # angle -t undoes angle t
    assert (back - x).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------- attention
@pytest.mark.parametrize("T,starts,K", [(1, [0, 3, 11], None), (1, [4, 40, 97], 3), (3, [0, 2, 30], None),
                                       (9, [0, 5, 60], 2), (9, [1, 6, 64], None)])
def test_attention_by_parts_equals_one_softmax(T, starts, K):
    """Window by sliding keys, compressed rows in place or gathered, against `attention_probs`
    (one softmax over every key, masks spelled out): decode and chunks longer than the window,
    ring wraps, the first positions, staggered starts."""
    B, H, D, W, C, rate = 3, 2, 16, 4, 40, 2
    q, ring, chunk = randn(B, T, H, D, seed=1), randn(B, W, D, seed=2), randn(B, T, D, seed=3)
    comp, sinks = randn(B, C, D, seed=4), randn(H, seed=5)
    sel = None
    if K:
        g = torch.Generator().manual_seed(6)
        sel = torch.stack([torch.randperm(C, generator=g)[:K] for _ in range(B * T)]).view(B, T, K)
        sel[0, 0, -1] = -1
    start = torch.tensor(starts)
    got = reference.attention(q, ring, chunk, start, comp, sel, rate, sinks, D ** -0.5)
    probs, keys = reference.attention_probs(q, ring, chunk, start, comp, sel, rate, sinks, D ** -0.5)
    expected = torch.einsum("bhts,bsd->bthd", probs[..., :-1], keys)
    assert (got - expected).abs().max().item() <= 1e-6


# --------------------------------------------------------------------------- the model
@pytest.fixture(scope="module")
def model():
    m = DS4ForCausalLM(DS4Config.from_dict(SMALL))
    randomise(m, 11)
    return m.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_one_token_steps_leave_the_cache_a_chunk_leaves(model, dtype):
    """Feeding 37 tokens one at a time (the compressor's one-token path: no gathers, open windows
    pooled into the scratch row) leaves every live cache tensor exactly as one 37-token chunk
    does (the gather path): the same compressed and indexer rows, open windows, overlaps and ring,
    across every emit phase of both rates and several ring wraps."""
    m = copy.deepcopy(model).to_dtype(dtype)
    ids = torch.randint(2, 64, (1, 37), generator=torch.Generator().manual_seed(3))
    chunked, stepped = m.new_cache(1, 40), m.new_cache(1, 40)
    m(ids, cache=chunked)
    for t in range(37):
        m(ids[:, t:t + 1], cache=stepped)
    a, b = chunked.export_sequence(0), stepped.export_sequence(0)
    assert a.keys() == b.keys()
    for name in a:
        tol = 0 if dtype == torch.float32 else 2 ** -6  # bf16: the two paths round their sums differently
        assert (a[name].float() - b[name].float()).abs().max().item() <= max(tol, 1e-5), name


@torch.no_grad()
def test_logits_to_keep(model):
    ids = torch.randint(2, 64, (2, 13), generator=torch.Generator().manual_seed(4))
    full_cache, last_cache = model.new_cache(2, 16), model.new_cache(2, 16)
    full = model(ids, cache=full_cache)
    last = model(ids, cache=last_cache, logits_to_keep=1)
    # (a matmul over fewer rows may round its last bit differently)
    assert last.shape == (2, 1, 64) and (last - full[:, -1:]).abs().max().item() <= 1e-5
    assert all(torch.equal(x, y) for x, y in zip(full_cache.tensors(), last_cache.tensors()))
    assert (model(ids, logits_to_keep=5) - model(ids)[:, -5:]).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=-1)
