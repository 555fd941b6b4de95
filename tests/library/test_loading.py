"""Checkpoint loading (ds4_torch.loading) and quantized formats (ds4_torch.quant).

Targets are transformers' DeepseekV4ForCausalLM built from tiny configs (their
state-dict names are the contract), so these tests do not depend on ds4_torch.model.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ckpt_utils import (
    fp4_experts,
    fp4_quantize,
    fp4_upstream_checkpoint,
    fp8_checkpoint,
    fp8_quantize,
    fp8_reference,
    hf_config,
    new_model,
    randomise,
    save_sharded,
    save_single,
    state_of,
    to_upstream,
    upstream_state,
    write_config,
    zeroed,
)
from ds4_torch import quant as Q
from ds4_torch.loading import (
    FINGERPRINT_SAMPLE_BYTES,
    FINGERPRINT_SAMPLE_POINTS,
    CheckpointError,
    checkpoint_fingerprint,
    checkpoint_tensor_names,
    load_checkpoint_into,
    read_config_dict,
    rename_checkpoint_key,
)

torch.set_num_threads(1)



@pytest.fixture(scope="module")
def source():
    return randomise(new_model(hf_config()), seed=0)


@pytest.fixture(scope="module")
def source300():
    """vocab 300: the FP8 lm_head spans 3 row blocks (128, 128, 44) and 1 partial column block."""
    return randomise(new_model(hf_config(vocab_size=300)), seed=1)


def fresh(model):
    return zeroed(new_model(model.config))


def assert_loaded(model, expected: dict):
    got = model.state_dict()
    assert set(got) == set(expected)
    bad = [k for k in expected if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])]
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:5]}"


# ----------------------------------------------------------------------------- names


def test_rename_table_matches_transformers(source):
    """Every HF key -> upstream name (ours) -> HF key, both with our table and transformers'."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conv = get_checkpoint_conversion_mapping("deepseek_v4")
    renamings = [c for c in conv if isinstance(c, WeightRenaming)]
    converters = [c for c in conv if isinstance(c, WeightConverter)]
    state = source.state_dict()
    up = upstream_state(state)
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.ffn.gate.tid2eid",
            "layers.1.attn.indexer.compressor.ape", "layers.2.attn.compressor.norm.weight",
            "layers.1.ffn.gate.bias", "layers.3.ffn.experts.2.w3.weight"} <= set(up)
    seen = set()
    for name in up:
        theirs, _ = rename_source_key(name, renamings, converters, base_model_prefix="model", meta_state_dict=state)
        ours = rename_checkpoint_key(name)
        m = re.fullmatch(r"(layers\.\d+\.mlp\.experts)\.\d+\.(w[123])\.weight", ours)
        if m:
            ours = f"{m[1]}.{'down_proj' if m[2] == 'w2' else 'gate_up_proj'}"
        ours = ours if ours in state else "model." + ours
        assert ours == theirs, (name, ours, theirs)
        assert ours in state, name
        seen.add(ours)
    assert seen == set(state)
    # the top-level norm must not be caught by the ".norm." -> ".kv_norm." rule
    assert rename_checkpoint_key("norm.weight") == "norm.weight"
    assert rename_checkpoint_key("model.layers.0.attn.norm.weight") == "layers.0.self_attn.kv_norm.weight"


# ----------------------------------------------------------------------------- plain layouts


def test_load_hf_single_file(source, tmp_path):
    expected = state_of(source)
    save_single(expected, tmp_path, config_model=source)
    assert set(checkpoint_tensor_names(tmp_path)) == set(expected)
    target = fresh(source)
    load_checkpoint_into(target, tmp_path, progress=False)
    assert_loaded(target, expected)


def test_load_transformers_save_pretrained(source, tmp_path):
    """transformers' save_pretrained writes reverse-mapped (upstream-like, 'model.'-prefixed) names."""
    source.save_pretrained(tmp_path)
    target = fresh(source)
    load_checkpoint_into(target, tmp_path)
    assert_loaded(target, state_of(source))


def test_load_sharded_with_progress(source, tmp_path, capsys):
    expected = state_of(source)
    save_sharded(expected, tmp_path, n_shards=2, config_model=source)
    names = checkpoint_tensor_names(tmp_path)
    assert len(set(names.values())) == 2 and set(names) == set(expected)
    target = fresh(source)
    load_checkpoint_into(target, tmp_path, progress=True)
    assert "Loading checkpoint" in capsys.readouterr().err
    assert_loaded(target, expected)


def test_load_upstream_names_matches_transformers(source, tmp_path):
    expected = state_of(source)
    up = upstream_state(expected)
    up["mtp.0.emb.weight"] = torch.zeros(3)  # MTP tensors are ignored, as transformers does
    up["model.mtp.1.norm.weight"] = torch.zeros(3)
    save_single(up, tmp_path, config_model=source)
    target = fresh(source)
    load_checkpoint_into(target, tmp_path)
    assert_loaded(target, expected)

    # transformers' own converter agrees on this upstream checkpoint (validates the test's mapping)
    from transformers import DeepseekV4ForCausalLM

    theirs = DeepseekV4ForCausalLM.from_pretrained(tmp_path)
    assert_loaded(theirs, expected)


def test_load_into_bf16_model_keeps_fp32_params(source, tmp_path):
    expected = state_of(source)
    save_sharded(upstream_state(expected), tmp_path, n_shards=3)
    target = fresh(source).to(torch.bfloat16)
    target.model.hc_head.float()  # a module kept in fp32 inside a bf16 model
    load_checkpoint_into(target, tmp_path)
    got = target.state_dict()
    assert got["model.hc_head.hc_fn"].dtype == torch.float32
    for k, v in expected.items():
        assert torch.equal(got[k], v.to(got[k].dtype)), k


def test_tied_embeddings_need_one_copy(tmp_path):
    model = randomise(new_model(hf_config(tie_word_embeddings=True)), seed=3)
    state = state_of(model)
    del state["lm_head.weight"]
    save_single(state, tmp_path)
    target = fresh(model)
    load_checkpoint_into(target, tmp_path)
    assert torch.equal(target.lm_head.weight, model.model.embed_tokens.weight)


# ----------------------------------------------------------------------------- dequantization


def test_dequant_formulas_match_transformers_and_reference():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    theirs = Fp8Dequantize(None)
    g = torch.Generator().manual_seed(0)
    # FP8, divisible shape: same as transformers for fp32 / e8m0 / uint8 scales
    w = torch.randn(256, 384, generator=g)
    for fmt in ("float32", "e8m0", "uint8"):
        q, s = fp8_quantize(w, fmt)
        ours = Q.dequantize(q, s, torch.float32)
        assert torch.equal(ours, theirs._dequantize_one(q, s, torch.float32)), fmt
        assert torch.equal(ours, fp8_reference(q, s)), fmt
    # FP8, shapes that are not multiples of 128 (cropped edge blocks)
    for shape in ((300, 200), (97, 64), (129, 257)):
        q, s = fp8_quantize(torch.randn(*shape, generator=g))
        assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
        assert torch.equal(Q.dequantize(q, s, torch.float32), fp8_reference(q, s)), shape
        assert torch.equal(Q.dequantize(q, s, torch.bfloat16), fp8_reference(q, s).to(torch.bfloat16))
    # FP4: int8 / uint8 / float4_e2m1fn_x2 storage, e8m0 as float8_e8m0fnu or uint8
    w = torch.randn(64, 128, generator=g)
    packed, scale, exact = fp4_quantize(w, "e8m0")
    _, scale_u8, _ = fp4_quantize(w, "uint8")
    assert torch.equal(theirs._dequantize_one(packed, scale, torch.float32), exact)
    assert torch.equal(Q.dequantize(packed, scale, torch.float32), exact)
    assert torch.equal(Q.dequantize(packed, scale_u8, torch.float32), exact)
    assert torch.equal(Q.dequantize(packed.view(torch.float4_e2m1fn_x2), scale, torch.float32), exact)
    # stacked experts [E, out, in]
    stacked = Q.dequantize(torch.stack([packed, packed]), torch.stack([scale, scale]), torch.float32)
    assert torch.equal(stacked, torch.stack([exact, exact]))
    # the nibble order: element 2j is the low nibble
    one = torch.tensor([[0x71]], dtype=torch.uint8).view(torch.int8)  # low=1 (0.5), high=7 (6.0)
    assert Q.unpack_fp4(one).tolist() == [[0.5, 6.0]]


@pytest.mark.parametrize("scale_fmt,upstream", [("float32", True), ("e8m0", False), ("uint8", False)])
def test_load_fp8_block_quantized(source300, tmp_path, scale_fmt, upstream):
    ckpt, expected = fp8_checkpoint(source300, scale_fmt, upstream)
    assert ckpt["head.weight" if upstream else "lm_head.weight"].dtype == torch.float8_e4m3fn
    save_sharded(ckpt, tmp_path, n_shards=3, config_model=source300)  # scales sit in other shards
    target = fresh(source300)
    load_checkpoint_into(target, tmp_path)
    assert_loaded(target, expected)


@pytest.mark.parametrize("layout,scale_fmt", [("upstream", "e8m0"), ("upstream", "uint8"),
                                               ("upstream_f4", "e8m0"), ("hf_stacked", "e8m0")])
def test_loadfp4_experts(source, tmp_path, layout, scale_fmt):
    if layout == "hf_stacked":
        quantized, expected = fp4_experts(source, scale_fmt)
        ckpt = state_of(source)
        for k, (packed, scale) in quantized.items():
            ckpt[k], ckpt[k + "_scale_inv"] = packed, scale
    else:
        ckpt, expected, _ = fp4_upstream_checkpoint(source, scale_fmt, f4_dtype=layout == "upstream_f4")
    save_single(ckpt, tmp_path)
    target = fresh(source)
    load_checkpoint_into(target, tmp_path)
    assert_loaded(target, expected)


# ----------------------------------------------------------------------------- keep mode


@functools.cache
def _experts_class():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    class EWExperts(DeepseekV4Experts):
        """transformers' experts, but reading weights only through expert_weights (our model's contract)."""

        def expert_weights(self, expert_ids):
            return self.gate_up_proj[expert_ids], self.down_proj[expert_ids]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            final = torch.zeros_like(hidden_states)
            for e in range(self.num_experts):
                tok, pos = torch.where(top_k_index == e)
                if tok.numel() == 0:
                    continue
                gate_up, down = self.expert_weights(torch.tensor([e]))
                h = self._apply_gate(F.linear(hidden_states[tok], gate_up[0]))
                final.index_add_(0, tok, F.linear(h, down[0]) * top_k_weights[tok, pos, None])
            return final

    return DeepseekV4Experts, EWExperts


def _with_ew_experts(model):
    base, ew = _experts_class()
    for m in model.modules():
        if type(m) is base:
            m.__class__ = ew
    return model


def test_fp8_block_linear_forward():
    g = torch.Generator().manual_seed(0)
    q, s = fp8_quantize(torch.randn(300, 200, generator=g))
    lin = nn.Linear(200, 300, bias=True)
    fp8 = Q.FP8BlockLinear.from_linear(lin, scale_shape=s.shape)
    assert fp8.bias is lin.bias and fp8.block_size == (128, 128)
    fp8.weight.copy_(q)
    fp8.weight_scale_inv.copy_(s)
    x = torch.randn(5, 200, generator=g)
    # the ds4::fp8_linear op sums in its own order: fp32 agrees to fp32 rounding, bf16 to bf16's
    with torch.no_grad():
        ref = F.linear(x.double(), fp8_reference(q, s).double(), lin.bias.double())
        torch.testing.assert_close(fp8(x).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        ref16 = F.linear(x.bfloat16(), fp8_reference(q, s).bfloat16(), lin.bias.bfloat16())
        torch.testing.assert_close(fp8(x.bfloat16()).float(), ref16.float(), rtol=2 ** -7,
                                   atol=2 ** -7 * ref16.abs().max().item())


def test_quantized_experts_expert_weights():
    g = torch.Generator().manual_seed(0)
    E, I, H = 3, 32, 64
    gu, dn = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    qs = [fp4_quantize(gu[e]) for e in range(E)], [fp4_quantize(dn[e]) for e in range(E)]
    (gu_q, dn_q) = ([torch.stack([x[i] for x in q]) for i in range(3)] for q in qs)
    fp4 = Q.FP4Experts(gu_q[0], gu_q[1], dn_q[0], dn_q[1], dtype=torch.float32)
    ids = torch.tensor([2, 0, 2])
    a, b = fp4.expert_weights(ids)
    assert torch.equal(a, gu_q[2][ids]) and torch.equal(b, dn_q[2][ids])
    assert fp4.expert_weights(ids, torch.bfloat16)[0].dtype == torch.bfloat16
    # FP8 experts with per-half (w1 | w3) block grids, I not a multiple of 128
    halves = [[fp8_quantize(gu[e, :I]), fp8_quantize(gu[e, I:])] for e in range(E)]
    w = torch.stack([torch.cat([h[0][0], h[1][0]]) for h in halves])
    s = torch.stack([torch.cat([h[0][1], h[1][1]]) for h in halves])
    dq = [fp8_quantize(dn[e]) for e in range(E)]
    fp8 = Q.FP8Experts(w, s, torch.stack([d[0] for d in dq]), torch.stack([d[1] for d in dq]),
                       dtype=torch.float32, split_gate_up=True)
    a, b = fp8.expert_weights(torch.tensor([1]))
    ref = torch.cat([fp8_reference(*halves[1][0]), fp8_reference(*halves[1][1])])
    assert torch.equal(a[0], ref) and torch.equal(b[0], fp8_reference(*dq[1]))


def test_keep_mode_fp8_linears_andfp4_experts(source, tmp_path):
    ckpt, expected = fp8_checkpoint(source, "e8m0", upstream=True)
    fp4_ckpt, fp4_expected, quantized = fp4_upstream_checkpoint(source)
    ckpt = {k: v for k, v in ckpt.items() if ".experts." not in k or "shared" in k}
    ckpt.update({k: v for k, v in fp4_ckpt.items() if ".experts." in k and "shared" not in k})
    expected.update({k: v for k, v in fp4_expected.items() if ".mlp.experts." in k})
    save_sharded(ckpt, tmp_path, n_shards=2, config_model=source)

    dense = _with_ew_experts(fresh(source))
    load_checkpoint_into(dense, tmp_path)
    assert_loaded(dense, expected)

    kept = _with_ew_experts(fresh(source))
    load_checkpoint_into(kept, tmp_path, quantized="keep")
    attn = kept.model.layers[1].self_attn
    assert isinstance(attn.q_a_proj, Q.FP8BlockLinear) and isinstance(kept.lm_head, Q.FP8BlockLinear)
    assert attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    assert attn.q_a_proj.weight_scale_inv.dtype == torch.float32
    assert type(attn.compressor.kv_proj) is nn.Linear  # bf16 in the checkpoint: untouched
    assert not isinstance(attn.o_a_proj, Q.FP8BlockLinear)  # nn.Linear subclass: dequantized
    assert torch.equal(attn.o_a_proj.weight, expected["model.layers.1.self_attn.o_a_proj.weight"])
    assert torch.equal(attn.q_a_proj.dequantized_weight(torch.float32),
                       expected["model.layers.1.self_attn.q_a_proj.weight"])

    for i, layer in enumerate(kept.model.layers):
        ex = layer.mlp.experts
        assert isinstance(ex, Q.FP4Experts) and isinstance(ex, _experts_class()[1])
        assert ex.limit == source.config.swiglu_limit and ex.num_experts == 4
        key = f"model.layers.{i}.mlp.experts."
        assert ex.gate_up_proj.dtype == torch.int8 and ex.gate_up_proj_scale_inv.dtype == torch.uint8
        assert torch.equal(ex.gate_up_proj, quantized[key + "gate_up_proj"][0])
        assert torch.equal(ex.down_proj, quantized[key + "down_proj"][0])
        ids = torch.tensor([3, 1])
        gate_up, down = ex.expert_weights(ids)
        assert gate_up.dtype == torch.float32
        assert torch.equal(gate_up, expected[key + "gate_up_proj"][ids])
        assert torch.equal(down, expected[key + "down_proj"][ids])
    assert "model.layers.0.mlp.experts.gate_up_proj_scale_inv" in kept.state_dict()

    ids = torch.randint(2, 97, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = dense(ids, use_cache=False).logits
        b = kept(ids, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["upstream", "hf_stacked"])
def test_keep_mode_fp8_experts(source, tmp_path, layout):
    expected = state_of(source)
    ckpt = {} if layout == "upstream" else dict(expected)
    if layout == "upstream":
        ckpt = {k: v for k, v in upstream_state(expected).items() if ".experts." not in k or "shared" in k}
    for k in [k for k in expected if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        layer = k.split(".")[2]
        w = expected[k]
        if layout == "hf_stacked":
            qs = [fp8_quantize(w[e], "e8m0") for e in range(w.shape[0])]
            ckpt[k] = torch.stack([q for q, _ in qs])
            ckpt[k + "_scale_inv"] = torch.stack([s for _, s in qs])
            expected[k] = torch.stack([fp8_reference(q, s) for q, s in qs])
            continue
        deq = []
        for e in range(w.shape[0]):
            parts = ([("w1", w[e, :32]), ("w3", w[e, 32:])] if k.endswith("gate_up_proj") else [("w2", w[e])])
            rows = []
            for name, t in parts:
                q, s = fp8_quantize(t, "float32")
                ckpt[f"layers.{layer}.ffn.experts.{e}.{name}.weight"] = q
                ckpt[f"layers.{layer}.ffn.experts.{e}.{name}.scale"] = s
                rows.append(fp8_reference(q, s))
            deq.append(torch.cat(rows))
        expected[k] = torch.stack(deq)
    save_single(ckpt, tmp_path)
    kept = _with_ew_experts(fresh(source))
    load_checkpoint_into(kept, tmp_path, quantized="keep")
    ex = kept.model.layers[2].mlp.experts
    assert isinstance(ex, Q.FP8Experts) and ex.gate_up_proj.dtype == torch.float8_e4m3fn
    ids = torch.arange(4)
    gate_up, down = ex.expert_weights(ids)
    assert torch.equal(gate_up, expected["model.layers.2.mlp.experts.gate_up_proj"])
    assert torch.equal(down, expected["model.layers.2.mlp.experts.down_proj"])


def test_keep_mode_needs_expert_weights(source, tmp_path):
    ckpt, _, _ = fp4_upstream_checkpoint(source)
    save_single(ckpt, tmp_path)
    with pytest.raises(CheckpointError, match="expert_weights"):
        load_checkpoint_into(fresh(source), tmp_path, quantized="keep")


# ----------------------------------------------------------------------------- errors


def test_missing_tensor_named(source, tmp_path):
    state = state_of(source)
    del state["model.layers.2.self_attn.compressor.kv_norm.weight"]
    save_single(state, tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint_into(fresh(source), tmp_path)
    assert "Missing tensors (1)" in str(err.value)
    assert err.value.missing == ["model.layers.2.self_attn.compressor.kv_norm.weight"]


def test_missing_expert_named(source, tmp_path):
    up = upstream_state(state_of(source))
    del up["layers.1.ffn.experts.3.w3.weight"]
    save_single(up, tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint_into(fresh(source), tmp_path)
    assert err.value.missing == ["model.layers.1.mlp.experts.gate_up_proj[expert 3 w3/up]"]


def test_many_missing_are_truncated(source, tmp_path):
    state = {k: v for k, v in state_of(source).items() if not k.startswith("model.layers.")}
    save_single(state, tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint_into(fresh(source), tmp_path)
    n = len(err.value.missing)
    assert n > 100 and f"... and {n - 20} more" in str(err.value)


def test_unexpected_tensor_named(source, tmp_path):
    state = state_of(source)
    state["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    state["layers.9.ffn.experts.0.w1.weight"] = torch.zeros(2)  # layer out of range
    state["layers.1.ffn.experts.7.w1.weight"] = torch.zeros(32, 64)  # expert out of range
    save_single(state, tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint_into(fresh(source), tmp_path)
    msg = str(err.value)
    assert "Unexpected tensors (3)" in msg and "model.layers.0.self_attn.bogus.weight" in msg
    assert "layers.9.ffn.experts.0.w1.weight" in msg and "layers.1.ffn.experts.7.w1.weight" in msg
    assert not err.value.missing


def test_wrong_shape_named(source, tmp_path):
    state = state_of(source)
    state["model.layers.1.self_attn.q_b_proj.weight"] = torch.zeros(128, 31)
    up = upstream_state(state)
    up["layers.2.ffn.experts.1.w2.weight"] = torch.zeros(64, 33)
    save_single(up, tmp_path)
    target = fresh(source)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint_into(target, tmp_path)
    msg = str(err.value)
    assert "layers.1.attn.wq_b.weight: expected (128, 32), found (128, 31)" in msg
    assert "layers.2.ffn.experts.1.w2.weight: expected (64, 32), found (64, 33)" in msg
    assert not err.value.missing and not err.value.unexpected
    assert target.model.embed_tokens.weight.abs().sum() == 0  # raised before copying anything


def test_fp8_bad_scale_grid(source300, tmp_path):
    ckpt, _ = fp8_checkpoint(source300, "float32", upstream=False)
    ckpt["lm_head.weight_scale_inv"] = torch.ones(2, 1)  # 300 rows need 3 row blocks
    save_single(ckpt, tmp_path)
    with pytest.raises(CheckpointError, match=r"lm_head.weight_scale_inv: expected \(3, 1\), found \(2, 1\)"):
        load_checkpoint_into(fresh(source300), tmp_path)


def test_missing_shard_file(source, tmp_path):
    save_sharded(state_of(source), tmp_path, n_shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_checkpoint_into(fresh(source), tmp_path)


def test_corrupt_index_json(source, tmp_path):
    save_sharded(state_of(source), tmp_path, n_shards=2)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        checkpoint_tensor_names(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(CheckpointError, match="weight_map"):
        load_checkpoint_into(fresh(source), tmp_path)


def test_corrupt_shard_and_empty_dir(source, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint_into(fresh(source), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="No model.safetensors.index.json"):
        checkpoint_tensor_names(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_tensor_names(tmp_path / "nope")


def test_read_config_dict(source, tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        read_config_dict(tmp_path)
    write_config(source, tmp_path)
    assert read_config_dict(tmp_path)["model_type"] == "deepseek_v4"
    (tmp_path / "config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="Invalid config file"):
        read_config_dict(tmp_path)


def test_meta_tensors_are_refused(source, tmp_path):
    save_single(state_of(source), tmp_path)
    with torch.device("meta"):
        target = new_model(source.config)
    with pytest.raises(ValueError, match=r"meta device: .*model.embed_tokens.weight.* and 102 more"):
        load_checkpoint_into(target, tmp_path)


def test_allocate_meta_fills_a_meta_built_model(tmp_path):
    model = randomise(new_model(hf_config(tie_word_embeddings=True)), seed=3)
    state = state_of(model)
    del state["lm_head.weight"]
    save_single(state, tmp_path)
    with torch.device("meta"):
        target = new_model(model.config)
    del state["model.norm.weight"]
    save_single(state, tmp_path / "incomplete")
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_checkpoint_into(target, tmp_path / "incomplete", allocate_meta=True)
    assert all(p.is_meta for p in target.parameters())  # checked before anything is allocated

    load_checkpoint_into(target, tmp_path, allocate_meta=True)
    assert_loaded(target, state_of(model))
    assert target.lm_head.weight is target.model.embed_tokens.weight  # still tied
    assert not any(t.is_meta for t in [*target.parameters(), *target.buffers()])


def test_bad_quantized_argument(source, tmp_path):
    with pytest.raises(ValueError, match="quantized"):
        load_checkpoint_into(fresh(source), tmp_path, quantized="fp8")


# ----------------------------------------------------------------------------- fingerprint


def _header(file):
    """(header dict, header length, data start) read straight from the safetensors layout."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), n, 8 + n


def _rewrite_header(file, edit):
    """Apply ``edit`` to the header JSON in place, same length, data bytes untouched."""
    raw = file.read_bytes()
    header, n, _ = _header(file)
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    file.write_bytes(raw[:8] + new.ljust(n, b" ") + raw[8 + n:])


def _flip_byte(file, offset):
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0xFF]))


def test_fingerprint_stable_and_location_independent(source, tmp_path):
    save_sharded(state_of(source), tmp_path / "a", n_shards=2, config_model=source)
    fp = checkpoint_fingerprint(tmp_path / "a")
    assert re.fullmatch(r"[0-9a-f]{64}", fp)
    assert checkpoint_fingerprint(tmp_path / "a") == fp
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert checkpoint_fingerprint(tmp_path / "b") == fp  # a copy elsewhere is the same checkpoint
    save_single(state_of(source), tmp_path / "c", config_model=source)
    assert checkpoint_fingerprint(tmp_path / "c") != fp  # same tensors, other file layout


def test_fingerprint_sees_metadata_changes_with_identical_bytes(source, tmp_path):
    """Name, dtype and shape edits that leave every data byte (hence every sample) unchanged."""
    save_single(state_of(source), tmp_path, config_model=source)
    file = tmp_path / "model.safetensors"
    base = checkpoint_fingerprint(tmp_path)
    key = "model.embed_tokens.weight"
    assert _header(file)[0][key]["dtype"] == "F32" and _header(file)[0][key]["shape"] == [97, 64]

    edits = {
        "name": lambda h: h.__setitem__("model.embed_tokens.weighX", h.pop(key)),
        "dtype": lambda h: h[key].__setitem__("dtype", "I32"),
        "shape": lambda h: h[key].__setitem__("shape", [64, 97]),
    }
    seen = {base}
    original = file.read_bytes()
    for what, edit in edits.items():
        _rewrite_header(file, edit)
        assert file.read_bytes()[_header(file)[2]:] == original[_header(file)[2]:]
        fp = checkpoint_fingerprint(tmp_path)
        assert fp not in seen, what
        seen.add(fp)
        file.write_bytes(original)
    assert checkpoint_fingerprint(tmp_path) == base

    config = json.loads((tmp_path / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_fingerprint(tmp_path) not in seen


def test_fingerprint_sees_sampled_weight_bytes(source, tmp_path):
    """A re-trained checkpoint with identical metadata: bytes at the start, middle and end of the
    data region are sampled."""
    save_single(state_of(source), tmp_path, config_model=source)
    file = tmp_path / "model.safetensors"
    base = checkpoint_fingerprint(tmp_path)
    _, _, start = _header(file)
    size = file.stat().st_size
    original = file.read_bytes()
    for offset in (start, start + (size - start) // 2, size - 1):
        _flip_byte(file, offset)
        assert checkpoint_fingerprint(tmp_path) != base, offset
        file.write_bytes(original)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_fingerprint_reads_a_bounded_number_of_bytes(tmp_path):
    """rchar counts every byte this process gets from read()/pread() syscalls, whoever issues them."""
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(256, 1024, generator=g) for i in range(8)}  # 8 MiB of weights
    save_sharded(state, tmp_path, n_shards=2)
    (tmp_path / "config.json").write_text("{}")
    metadata = sum(_header(f)[2] for f in tmp_path.glob("*.safetensors"))
    metadata += (tmp_path / "model.safetensors.index.json").stat().st_size + 2

    def rchar():
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])

    checkpoint_fingerprint(tmp_path)  # warm imports so only the fingerprint's own reads are counted
    before = rchar()
    checkpoint_fingerprint(tmp_path)
    read = rchar() - before
    samples = 2 * FINGERPRINT_SAMPLE_POINTS * FINGERPRINT_SAMPLE_BYTES
    assert read <= metadata + samples + 16 * 1024, (read, metadata)
    assert read < sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")) // 50


def test_fingerprint_names_a_corrupt_shard(source, tmp_path):
    save_sharded(state_of(source), tmp_path, n_shards=2)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes((10**12).to_bytes(8, "little") + shard.read_bytes()[8:])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors: header length 1000000000000"):
        checkpoint_fingerprint(tmp_path)
