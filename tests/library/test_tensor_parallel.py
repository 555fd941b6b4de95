"""Tensor + expert parallelism (ds4_torch.parallel) on CPU with gloo: two processes, started by the
test with the launcher's environment, against the single-process model on the same checkpoint."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds4_torch import DS4ForCausalLM
from ds4_torch.kernels import attention_ops
from helpers import free_port, rank_env
from oracle import make_oracle
from test_parity import TieWatch
from tp_worker import prefill_decode_logits

TESTS = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TOL = 1e-5
PREFILL, DECODE = 20, 40

CONFIGS = {
    # every layer kind (sliding, CSA rate 4, HCA rate 8), hash layers; vocab even so it splits
    "base": dict(vocab_size=102),
    # other shapes: 8 heads in 4 output groups, 16 indexer heads, 8 experts, CSA rate 2
    "alt": dict(vocab_size=104, num_attention_heads=8, o_groups=4, index_n_heads=16, n_routed_experts=8,
                moe_intermediate_size=48, sliding_window=11, index_topk=2, num_hidden_layers=4,
                compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 5},
                layer_types=["compressed_sparse_attention", "sliding_attention",
                             "heavily_compressed_attention", "compressed_sparse_attention"],
                mlp_layer_types=["hash_moe", "moe", "moe", "moe"]),
}


def run_ranks(args: list[str], world: int = 2, timeout: float = 240) -> None:
    port = free_port()
    procs = [subprocess.Popen([PYTHON, str(TESTS / "tp_worker.py"), *args], env=rank_env(r, world, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out}"


def reference_logits(checkpoint, decode: int, tmp_path_factory, **load):
    """The reference: ids (saved for the ranks), and the single-process model's logits on them,
    with the indexer watched so that no top-k boundary is a tie (a tie would make the comparison
    meaningless)."""
    model = DS4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **load)
    watch = TieWatch()
    model.ops = dataclasses.replace(attention_ops("torch"), indexer_topk=watch)
    ids = torch.randint(2, model.config.vocab_size, (1, PREFILL + decode), generator=torch.Generator().manual_seed(7))
    expected = prefill_decode_logits(model, ids, PREFILL)
    assert watch.calls > 0 and watch.min_gap > 1e-4, f"indexer tie at the top-k boundary (gap {watch.min_gap})"
    ids_path = tmp_path_factory.mktemp("ids") / "ids.pt"
    torch.save(ids, ids_path)
    return ids_path, expected


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """Per config: its checkpoint, and `reference_logits` on it."""
    refs = {}
    for name, config in CONFIGS.items():
        _, path = make_oracle(tmp_path_factory.mktemp(name), seed=3, **config)
        refs[name] = (path, *reference_logits(path, DECODE, tmp_path_factory))
    return refs


# Each config once and each decode mode once (the graph path's collectives are the same code for both
# configs; the alt shapes' splits are the same in both modes).
LOGITS_CASES = [("base", "graph"), ("alt", "eager")]


@pytest.fixture(scope="module")
def tp2_logits(single_process, keep_checkpoint, keep_reference, tmp_path_factory):
    """Every --tp 2 logits run of this module from one launch (one start of the two ranks): per
    run, each rank's logits."""
    import json

    out = tmp_path_factory.mktemp("tp2_logits")
    jobs = {f"{name}-{mode}": dict(checkpoint=str(single_process[name][0]), ids=str(single_process[name][1]),
                                   mode=mode, quantized="dequantize") for name, mode in LOGITS_CASES}
    jobs["keep"] = dict(checkpoint=str(keep_checkpoint), ids=str(keep_reference[0]), mode="eager", quantized="keep")
    (out / "jobs.json").write_text(json.dumps(jobs))
    run_ranks(["logits", str(out / "jobs.json"), str(PREFILL), str(out)])
    return {name: [torch.load(out / f"{name}.rank{rank}.pt") for rank in range(2)] for name in jobs}


@pytest.mark.parametrize("config,mode", LOGITS_CASES)
def test_tp2_logits_equal_single_process(single_process, tp2_logits, config, mode):
    _, _, expected = single_process[config]
    for rank, got in enumerate(tp2_logits[f"{config}-{mode}"]):
        assert got.shape == expected.shape
        err = (got - expected).abs().max().item()
        assert err <= TOL, f"rank {rank} ({mode}): max logit error {err:.3g}"


# --------------------------------------------------------------------------- sharded loading
# Loading needs only the split plan, not a live group: each rank's model is built on meta, split
# (parallelize), then filled by the loader, which reads only that rank's slices.

def load_rank(path, rank: int, world: int = 2, quantized: str = "dequantize"):
    from ds4_torch.config import DS4Config
    from ds4_torch.loading import load_checkpoint_into
    from ds4_torch.parallel import TensorParallel, parallelize

    with torch.device("meta"):
        model = DS4ForCausalLM(DS4Config.from_pretrained(path))
    parallelize(model, TensorParallel(None, rank, world))
    load_checkpoint_into(model, path, allocate_meta=True, shards=model.tp_slices, quantized=quantized)
    return model


def assert_rank_slices(model, expected: dict):
    got = model.state_dict()
    assert set(got) == set(expected)
    split = 0
    for name, full in expected.items():
        want = full
        if name in model.tp_slices:
            dim, start, n, size = model.tp_slices[name]
            assert size == full.shape[dim]
            want, split = full.narrow(dim, start, n), split + 1
        assert torch.equal(got[name], want.to(got[name].dtype)), name
    assert split >= 10  # the plan really split the attention, indexer, experts and vocabulary


@pytest.fixture(scope="module")
def loading_source():
    from ckpt_utils import hf_config, new_model, randomise

    # vocab 300: each rank's half of the FP8 lm_head starts or ends inside a 128-row block
    return randomise(new_model(hf_config(vocab_size=300)), seed=1)


@pytest.mark.parametrize("layout", ["sharded_index", "fp8_upstream", "fp8_hf", "fp4_upstream", "fp4_hf_stacked"])
def test_each_rank_loads_its_slices(loading_source, tmp_path, layout):
    from ckpt_utils import fp4_experts, fp4_upstream_checkpoint, fp8_checkpoint, save_sharded, state_of

    if layout == "sharded_index":
        ckpt = expected = state_of(loading_source)
    elif layout.startswith("fp8"):
        ckpt, expected = fp8_checkpoint(loading_source, "e8m0", upstream=layout == "fp8_upstream")
    elif layout == "fp4_upstream":
        ckpt, expected, _ = fp4_upstream_checkpoint(loading_source)
    else:
        quantized, expected = fp4_experts(loading_source)
        ckpt = state_of(loading_source)
        for k, (packed, scale) in quantized.items():
            ckpt[k], ckpt[k + "_scale_inv"] = packed, scale
    save_sharded(ckpt, tmp_path, n_shards=3, config_model=loading_source)
    for rank in range(2):
        assert_rank_slices(load_rank(tmp_path, rank), expected)


# --------------------------------------------------------------------------- kept quantized
KEEP_BLOCK = 16  # FP8 blocks small enough that most splits of the tiny model fall on block borders


@pytest.fixture(scope="module")
def keep_checkpoint(loading_source, tmp_path_factory):
    """FP8 linears (16x16 blocks, e8m0 scales) and FP4 stacked experts. Each rank's half of
    q_b_proj, o_b_proj, the indexer's q_b_proj and the shared expert starts on a block border;
    lm_head's (150 of 300 rows) does not, so that one rank's slice is dequantized instead."""
    import json
    import re

    from ckpt_utils import FP8_LINEARS, fp4_experts, fp8_quantize, save_sharded, state_of

    ckpt = state_of(loading_source)
    for k in list(ckpt):
        if FP8_LINEARS.search(re.sub(r"^model\.layers\.\d+\.", "", k)):
            ckpt[k], ckpt[k[:-len(".weight")] + ".weight_scale_inv"] = fp8_quantize(ckpt[k], "e8m0", block=KEEP_BLOCK)
    for k, (packed, scale) in fp4_experts(loading_source)[0].items():
        ckpt[k], ckpt[k + "_scale_inv"] = packed, scale
    path = save_sharded(ckpt, tmp_path_factory.mktemp("keep"), n_shards=3, config_model=loading_source)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [KEEP_BLOCK, KEEP_BLOCK]}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_kept_quantized_each_rank_keeps_only_its_slices(keep_checkpoint):
    from ds4_torch import quant as Q

    for rank in range(2):
        model = load_rank(keep_checkpoint, rank, quantized="keep")
        attn, layer = model.model.layers[1].self_attn, model.model.layers[1]
        for linear, shape in ((attn.q_b_proj, (64, 32)), (attn.o_b_proj, (64, 16)),
                              (layer.mlp.shared_experts.down_proj, (64, 16))):
            assert isinstance(linear, Q.FP8BlockLinear) and linear.weight.dtype == torch.float8_e4m3fn
            assert tuple(linear.weight.shape) == shape
            assert tuple(linear.weight_scale_inv.shape) == (shape[0] // KEEP_BLOCK, shape[1] // KEEP_BLOCK)
        assert attn.o_b_proj._forward_hooks  # its all-reduce moved with it
        experts = layer.mlp.experts
        assert isinstance(experts, Q.FP4Experts) and experts.gate_up_proj.shape[0] == 2 and experts.num_experts == 2
        assert not isinstance(model.lm_head, Q.FP8BlockLinear) and model.lm_head.weight.shape == (150, 64)


@pytest.fixture(scope="module")
def keep_reference(keep_checkpoint, tmp_path_factory):
    """`reference_logits` of the single-process model with the checkpoint kept quantized."""
    return reference_logits(keep_checkpoint, 12, tmp_path_factory, quantized="keep")


def test_kept_quantized_tp2_logits_equal_single_process(keep_reference, tp2_logits):
    _, expected = keep_reference
    for rank, got in enumerate(tp2_logits["keep"]):
        err = (got - expected).abs().max().item()
        assert err <= TOL, f"rank {rank}: max logit error {err:.3g}"


def test_load_model_keeps_a_checkpoint_quantized_when_asked(keep_checkpoint):
    """`--quantized keep` (generate, serve, bench) reaches the loader: FP8/FP4 storage, the
    dequantized model's logits."""
    from ds4_torch import quant as Q
    from ds4_torch.runtime import load_model

    kept = load_model(str(keep_checkpoint), device="cpu", quantized="keep")
    dense = load_model(str(keep_checkpoint), device="cpu")
    assert isinstance(kept.model.layers[1].self_attn.q_b_proj, Q.FP8BlockLinear)
    assert isinstance(kept.model.layers[1].mlp.experts, Q.FP4Experts)
    assert not any(isinstance(m, (Q.FP8BlockLinear, Q.FP4Experts)) for m in dense.modules())
    ids = torch.randint(2, dense.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(kept(ids), dense(ids), atol=1e-4, rtol=1e-4)


def test_sizes_that_do_not_divide_are_refused_at_load(tmp_path):
    from ds4_torch.config import DS4Config
    from ds4_torch.parallel import TensorParallel, parallelize

    config = DS4Config(vocab_size=101, hidden_size=64, num_attention_heads=6, head_dim=32, q_lora_rank=32,
                       o_groups=2, o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                       num_hidden_layers=1, qk_rope_head_dim=8, layer_types=("sliding_attention",),
                       mlp_layer_types=("moe",))
    with torch.device("meta"):
        model = DS4ForCausalLM(config)
    with pytest.raises(ValueError, match=r"over 4 ranks: num_attention_heads=6, o_groups=2, vocab_size=101"):
        parallelize(model, TensorParallel(None, 0, 4))


# --------------------------------------------------------------------------- the CLI under torchrun
def test_cli_generate_under_torchrun_prints_the_single_process_text():
    """The command line under torchrun, seeded sampling (greedy tokens and the graph path under
    --tp are test_tp2_logits_equal_single_process's)."""
    args = ["-m", "ds4_torch", "generate", "-p", "ROMEO:", "-n", "40", "--temperature", "0.8", "--seed", "5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS.parent)}
    one = subprocess.run([PYTHON, *args], env=env, capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), *args, "--tp", "2"],
                         env=env, capture_output=True, text=True, timeout=240)
    assert two.returncode == 0, two.stderr
    assert len(one.stdout.strip()) > 20
    assert two.stdout == one.stdout


def test_cli_tp_without_a_launcher_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([PYTHON, "-m", "ds4_torch", "generate", "-p", "x", "-n", "1", "--tp", "2"],
                       env={**env, "PYTHONPATH": str(TESTS.parent)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "torchrun --nproc-per-node 2" in r.stderr and "Traceback" not in r.stderr


def test_the_missing_launcher_is_named_before_anything_loads(tmp_path, monkeypatch, capsys):
    """--tp 2 with no launcher and a model directory that does not exist: the launcher is what the
    error names (checked first), so the user waits for no tokenizer or weights to learn it."""
    from ds4_torch.cli import main

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(["generate", "-p", "x", "-n", "1", "--tp", "2", "--model", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc-per-node 2" in err and "absent" not in err, err


def test_each_rank_takes_the_gpu_of_its_local_rank(monkeypatch):
    """torchrun starts N ranks on one machine with LOCAL_RANK 0..N-1: `--device cuda` (no index)
    must mean cuda:LOCAL_RANK, or every rank would load onto cuda:0. Named devices stay as named."""
    from ds4_torch.parallel import rank_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert rank_device("cuda:1") == torch.device("cuda", 1)
    assert rank_device("cpu") == torch.device("cpu")
    monkeypatch.delenv("LOCAL_RANK")
    assert rank_device("cuda") == torch.device("cuda", 0)


# --------------------------------------------------------------------------- speculative decoding
@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A checkpoint with an MTP layer (CSA, rate 2; every size splits over 2 ranks)."""
    from ds4_torch import DS4Config
    from oracle import randomise
    from test_speculative import SMALL

    model = DS4ForCausalLM(DS4Config.from_dict(SMALL))
    randomise(model, 3)
    model.eval()
    path = tmp_path_factory.mktemp("mtp")
    model.save_pretrained(path)
    return model, path


SPEC_CASES = [("eager", None), ("graph", 4)]
SPEC_NEW = 40


@pytest.fixture(scope="module")
def tp2_speculation(mtp_checkpoint, tmp_path_factory):
    """Both cases below from one --tp 2 launch (one model load per rank): per rank, per case, what
    `tp_worker.speculate` wrote."""
    out = tmp_path_factory.mktemp("speculate")
    cases = [mode if seed is None else f"{mode}:{seed}" for mode, seed in SPEC_CASES]
    run_ranks(["speculate", str(mtp_checkpoint[1]), str(out), "2", str(SPEC_NEW), *cases])
    results = [torch.load(out / f"rank{rank}.pt") for rank in range(2)]
    return [{case: result[name] for case, name in zip(SPEC_CASES, cases)} for result in results]


@pytest.mark.parametrize("mode,seed", SPEC_CASES)
def test_tp2_speculation_gives_single_process_plain_tokens(mtp_checkpoint, tp2_speculation, mode, seed):
    """Speculative decoding under --tp 2 (the MTP layer split like the others; every rank drafts,
    verifies and rolls back alike): greedy and seeded tokens equal single-process plain decoding
    (one sequence through generate, two through one batched Speculator), drafts accepted."""
    from ds4_torch import generate
    from tp_worker import SPEC_PROMPTS

    model, _ = mtp_checkpoint
    settings = dict(temperature=0.9, seed=seed) if seed is not None else {}
    plain = list(generate(model, SPEC_PROMPTS[0], SPEC_NEW, prefill_chunk=4, **settings))
    plain_batch = [list(generate(model, p, SPEC_NEW, prefill_chunk=4)) for p in SPEC_PROMPTS]
    for rank in range(2):
        got = tp2_speculation[rank][mode, seed]
        assert got["tokens"] == plain, f"rank {rank}"
        assert got["batch"] == plain_batch, f"rank {rank}"
        assert 0 < got["accepted"] <= got["drafted"]
