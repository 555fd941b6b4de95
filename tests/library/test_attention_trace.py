"""trace_attention returns the softmax the model really used."""

import torch

from ds4_torch import DS4Config, DS4ForCausalLM
from ds4_torch.attention_trace import trace_attention
from oracle import randomise
from test_decode import SMALL


def test_trace_is_a_distribution_that_respects_the_masks():
    model = DS4ForCausalLM(DS4Config.from_dict(SMALL))
    randomise(model, 4)
    ids = torch.randint(2, 64, (1, 30), generator=torch.Generator().manual_seed(0))
    before = model(ids)
    traces = trace_attention(model, ids)
    assert torch.equal(model(ids), before)  # tracing leaves the model as it was
    assert [t.kind for t in traces] == list(model.config.layer_types)
    W = model.config.sliding_window
    t_idx = torch.arange(30)
    for tr in traces:
        total = tr.window_share + tr.compressed_share + tr.sink_share
        assert torch.allclose(total, torch.ones_like(total), atol=1e-5)
        outside = (t_idx[None, :] > t_idx[:, None]) | (t_idx[:, None] - t_idx[None, :] >= W)
        assert tr.window_probs[:, outside].abs().max() == 0  # nothing outside the sliding window
        if tr.rate:
            visible = torch.arange(tr.compressed_probs.shape[-1])[None, :] < ((t_idx + 1) // tr.rate)[:, None]
            assert tr.compressed_probs[:, ~visible].abs().max() == 0  # no future compressed row
            assert tr.compressed_share[:, -1].min() > 0
        if tr.selected is not None:  # CSA: mass only on the indexer's picks
            for t in range(30):
                picked = set(tr.selected[t][tr.selected[t] >= 0].tolist())
                used = set(torch.nonzero(tr.compressed_probs[:, t].sum(0)).flatten().tolist())
                assert used <= picked
