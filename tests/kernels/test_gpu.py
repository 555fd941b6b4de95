"""The GPU suite: `pytest -m gpu` on a machine with a CUDA GPU (skipped, saying why, without one).

- every Triton kernel natively (compiled for the GPU, not interpreted) in fp32, bf16 and fp16
  against the torch reference: test_kernels' cases plus V4-Flash sizes, the indexer's tie rule;
- a real CUDA-graph capture of the decode step replayed across the window, emit, top-k and
  ring-wrap boundaries, one sequence and a staggered batch, against eager decoding;
- the model end to end on CUDA against transformers (fp32, logits within 1e-4);
- `ds4-torch bench kernels` reporting GB/s against the device's peak;
- ds4::fp8_linear and the MoE reading packed FP4/FP8 experts, natively, in every dtype;
- speculative decoding with the MTP layer, eager and through real CUDA graphs, against plain greedy.
The checks live in `gpu_checks.py` and run as child processes: this session sets TRITON_INTERPRET
(conftest), which would turn every kernel into an interpreted one.

Without a GPU, `bench kernels` must say it needs one (exit status 2, one line, no traceback).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_checks(name: str, timeout=1800) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # gpu_checks reuses test modules of several rooms: every test folder is on its path.
    rooms = sorted({str(p.parent) for p in (ROOT / "tests").rglob("test_*.py")})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), *rooms, env.get("PYTHONPATH")]))
    child = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu_checks.py"), name], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=timeout)
    assert child.returncode == 0, f"GPU check {name!r} failed:\n{child.stdout[-6000:]}\n{child.stderr[-8000:]}"
    return child.stdout


@pytest.mark.gpu
def test_triton_kernels_natively_in_every_dtype():
    out = run_checks("kernels")
    assert "ok attention flash_csa_decode_16k" in out and "ok indexer tie rule" in out


@pytest.mark.gpu
def test_cuda_graph_decode_across_boundaries():
    out = run_checks("graph")
    assert "batch of 3" in out


@pytest.mark.gpu
def test_model_on_cuda_matches_transformers():
    out = run_checks("model")
    assert "ok prefill +" in out


@pytest.mark.gpu
def test_quantized_weight_kernels_natively():
    """ds4::fp8_linear and the MoE on packed FP4/FP8 experts, compiled, in every dtype."""
    out = run_checks("quant")
    assert "ok fp8_linear q_b_proj" in out and "ok moe packed fp4" in out


@pytest.mark.gpu
def test_speculative_decoding_on_cuda_eager_and_cuda_graphs():
    out = run_checks("speculative")
    assert "ok speculative graph N=3" in out


@pytest.mark.gpu
def test_the_server_speculates_on_cuda():
    out = run_checks("serve_speculative")
    assert "ok serve speculative on cuda" in out


@pytest.mark.gpu
def test_bench_kernels_reports_bandwidth():
    run_checks("bench")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: bench kernels runs (see the gpu tests)")
def test_bench_kernels_without_a_gpu_says_so(capsys):
    from ds4_torch.cli import main

    assert main(["bench", "kernels"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err and "Traceback" not in err
