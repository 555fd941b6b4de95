"""The lightning indexer's training objective (`Indexer.distillation_loss`): the top-k passes no
gradient, so the indexer learns from the KL divergence between the main attention over the
compressed rows (heads summed) and its own scores' softmax (DeepSeek-V3.2)."""

from __future__ import annotations

import pytest
import torch

from ds4_torch import DS4Config, DS4ForCausalLM
from ds4_torch.kernels import AttentionOps, reference
from oracle import randomise

CONFIG = dict(
    vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
    head_dim=16, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=4,
    layer_types=["compressed_sparse_attention", "sliding_attention"],
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    mlp_layer_types=["hash_moe", "moe"], index_n_heads=8, index_head_dim=8, index_topk=3,
    n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=5,
)


def training_model(seed: int = 0):
    model = DS4ForCausalLM(DS4Config.from_dict(CONFIG))
    randomise(model, seed)
    recorded = []

    def attention(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale):
        recorded.append((q.detach().clone(), comp.detach().clone(), comp_sel, scale))
        return reference.attention(q, ring, chunk_kv, start, comp, comp_sel, rate, sinks, scale)

    model.ops = AttentionOps("reference", attention, reference.compress_rows, reference.indexer_topk)
    indexer = model.model.layers[0].self_attn.compressor.indexer
    return model.train(), indexer, recorded


def test_loss_is_the_kl_from_attention_to_the_indexer_scores(monkeypatch):
    """Against an independent float64 computation: the main heads' softmax over the visible
    compressed rows (keys as attention reads them), summed and renormalised, vs the softmax of
    sum_h w_h relu(q_h . k) over the same rows; KL averaged over the queries that see a row."""
    model, indexer, recorded = training_model()
    losses = indexer.distillation_losses = []
    T = 24
    ids = torch.randint(2, 64, (2, T), generator=torch.Generator().manual_seed(1))
    captured = {}
    orig = reference.indexer_scores

    def scores_spy(q, head_weights, rows):
        captured.update(q=q.detach().double(), w=head_weights.detach().double(), rows=rows.detach().double())
        return orig(q, head_weights, rows)

    monkeypatch.setattr(reference, "indexer_scores", scores_spy)  # the top-k's call: the loss scores the same
    model(ids)
    assert len(losses) == 1
    q, comp, _, scale = recorded[0]
    C = captured["rows"].shape[1]
    pos = torch.arange(T)
    visible = (torch.arange(C)[None, :] < ((pos + 1) // 2)[:, None])  # rate 2, start 0
    logits = torch.einsum("bthd,bcd->bthc", q.double(), comp[:, :C].double()) * scale
    probs = torch.softmax(logits.masked_fill(~visible[None, :, None], float("-inf")), -1).nan_to_num(0).sum(2)
    target = probs / probs.sum(-1, keepdim=True).clamp(min=1e-300)
    dots = torch.einsum("bthd,bcd->bthc", captured["q"], captured["rows"]).relu()
    scores = (dots * captured["w"][..., None]).sum(2) * captured["q"].shape[-1] ** -0.5
    log_q = torch.log_softmax(scores.masked_fill(~visible[None], float("-inf")), -1)
    kl = torch.where(target > 0, target * (target.clamp(min=1e-300).log() - log_q), 0.0).sum(-1)
    seen = visible.any(-1)
    want = kl[:, seen].mean()
    torch.testing.assert_close(losses[0].double(), want, rtol=1e-4, atol=1e-6)
    assert want > 0


def test_gradient_reaches_only_the_indexer():
    model, indexer, _ = training_model(2)
    losses = indexer.distillation_losses = []
    model(torch.randint(2, 64, (1, 20), generator=torch.Generator().manual_seed(2)))
    losses[0].backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad and all(".indexer." in n for n in with_grad), sorted(with_grad)
    assert any("q_b_proj" in n for n in with_grad) and any("weights_proj" in n for n in with_grad)


def test_model_loss_gives_the_indexer_no_gradient_and_is_unchanged_by_collecting():
    """The top-k passes no gradient, so the language-model loss never reaches the indexer; and
    collecting the indexer loss leaves the logits as they were."""
    model, indexer, _ = training_model(3)
    ids = torch.randint(2, 64, (1, 20), generator=torch.Generator().manual_seed(3))
    plain = model(ids)
    plain.logsumexp(-1).sum().backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for n, p in model.named_parameters() if ".indexer." in n)
    indexer.distillation_losses = []
    assert torch.equal(model(ids), plain)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_training_on_the_loss_moves_the_picks_towards_attention(seed):
    """100 Adam steps on the indexer alone: the loss falls on text it did not train on, and the
    attention mass on the rows the indexer picks grows."""
    model, indexer, recorded = training_model(seed)
    with torch.no_grad():  # peaked attention over the rows: a target worth following
        model.model.layers[0].self_attn.compressor.kv_norm.weight.mul_(4)
    for name, p in model.named_parameters():
        p.requires_grad_(".indexer." in name)
    g = torch.Generator().manual_seed(10 + seed)
    held = torch.randint(2, 64, (2, 40), generator=g)

    def measure():
        losses = indexer.distillation_losses = []
        recorded.clear()
        model(held)
        q, comp, sel, scale = recorded[0]
        C = comp.shape[1]
        pos = torch.arange(40)
        visible = torch.arange(C)[None] < ((pos + 1) // 2)[:, None]
        probs = torch.softmax((torch.einsum("bthd,bcd->bthc", q, comp) * scale)
                              .masked_fill(~visible[None, :, None], float("-inf")), -1).nan_to_num(0).sum(2)
        probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-30)
        many = visible.sum(-1) > 3  # queries with more rows than picks
        mass = probs.gather(-1, sel.clamp(min=0)).masked_fill(sel < 0, 0).sum(-1)
        return losses[0].item(), mass[:, many].mean().item()

    before = measure()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(100):
        losses = indexer.distillation_losses = []
        model(torch.randint(2, 64, (4, 40), generator=g))
        opt.zero_grad()
        losses[0].backward()
        opt.step()
    after = measure()
    assert after[0] < before[0] * 0.9, (before, after)
    assert after[1] > before[1], (before, after)
