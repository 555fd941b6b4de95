"""`ds4::sinkhorn` (kernels/sinkhorn.py; the Triton kernel under the interpreter, see conftest)
against transformers' loop written out here in float64, and the model's use of it."""
from __future__ import annotations

import pytest
import torch

from ds4_torch.kernels.sinkhorn import sinkhorn, sinkhorn_torch


def loop(comb, iters, eps):
    """transformers' DeepseekV4HyperConnection loop, in float64."""
    comb = comb.double()
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def matrices(shape, seed):
    """As the model makes them: a softmax over each row plus eps, so entries lie in (0, 1]."""
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2
    return torch.softmax(logits, dim=-1) + 1e-6


# decode (one matrix, a batch), prefill (many: more than one program), V4's n = 4 and other n
SHAPES = [(1, 1, 4, 4), (3, 1, 4, 4), (2, 37, 4, 4), (5, 2, 2), (2, 3, 3)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@torch.no_grad()
def test_op_matches_the_loop(shape, backend):
    comb = matrices(shape, seed=len(shape) + shape[0])
    before = comb.clone()
    got = torch.ops.ds4.sinkhorn(comb, 20, 1e-6, backend)
    assert got.shape == comb.shape and got.dtype == torch.float32
    assert (got.double() - loop(comb, 20, 1e-6)).abs().max().item() <= 1e-6
    assert torch.equal(comb, before)  # the input is left intact
    assert got.sum(-2).sub(1).abs().max() < 1e-4  # columns stochastic after the last step


@pytest.mark.parametrize("iters", [1, 2, 7])
def test_iteration_counts(iters):
    comb = matrices((4, 4, 4), seed=iters)
    for backend in ("torch", "triton"):
        got = torch.ops.ds4.sinkhorn(comb, iters, 1e-3, backend)
        assert (got.double() - loop(comb, iters, 1e-3)).abs().max().item() <= 1e-6, backend


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_op_passes_opcheck(backend):
    torch.library.opcheck(torch.ops.ds4.sinkhorn.default, (matrices((2, 3, 4, 4), seed=1), 20, 1e-6, backend))


def test_the_op_refuses_a_backward_saying_why():
    """The ops are inference kernels: a backward through one is an error naming it, not a
    silent zero gradient (training runs the torch loop: `sinkhorn` calls it when autograd records)."""
    comb = matrices((2, 4, 4), 0).requires_grad_()
    out = torch.ops.ds4.sinkhorn(comb, 20, 1e-6, "torch")
    with pytest.raises(RuntimeError, match="ds4::sinkhorn is forward-only"):
        out.sum().backward()

def test_op_has_a_cuda_kernel_and_a_fake_and_traces_as_one_node():
    from torch.fx.experimental.proxy_tensor import make_fx

    name = torch.ops.ds4.sinkhorn.default.name()
    for key in ("CUDA", "CompositeExplicitAutograd", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), key
    graph = make_fx(lambda c: sinkhorn(c, 20, 1e-6, "triton"), tracing_mode="fake")(matrices((1, 1, 4, 4), 0))
    assert [n.target for n in graph.graph.nodes if n.op == "call_function"] == [torch.ops.ds4.sinkhorn.default]


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="float32"):
        torch.ops.ds4.sinkhorn(matrices((2, 4, 4), 0).double(), 20, 1e-6, "torch")
    with pytest.raises(ValueError, match=r"\[\.\.\., n, n\]"):
        torch.ops.ds4.sinkhorn(torch.ones(2, 4, 3), 20, 1e-6, "torch")
    with pytest.raises(ValueError, match="iters"):
        torch.ops.ds4.sinkhorn(matrices((2, 4, 4), 0), 0, 1e-6, "torch")
    with pytest.raises(ValueError, match="auto, torch, triton"):
        torch.ops.ds4.sinkhorn(matrices((2, 4, 4), 0), 20, 1e-6, "flash")


def test_training_path_is_differentiable():
    comb = matrices((2, 3, 4, 4), seed=4).requires_grad_(True)
    got = sinkhorn(comb, 20, 1e-6, "triton")  # autograd records: the torch implementation
    (grad,) = torch.autograd.grad(got.square().sum(), comb)
    (want,) = torch.autograd.grad(loop(comb, 20, 1e-6).square().sum(), comb)
    assert (grad.double() - want).abs().max().item() <= 1e-5
    assert torch.equal(sinkhorn_torch(comb.detach(), 20, 1e-6), got.detach())


def test_model_hyper_connections_follow_the_backend():
    from ds4_torch.default_model import build_default_model
    from ds4_torch.model import HyperConnection

    model = build_default_model()
    model.attn_backend = "triton"
    assert {m.backend for m in model.modules() if isinstance(m, HyperConnection)} == {"triton"}
    model.attn_backend = "torch"
    assert {m.backend for m in model.modules() if isinstance(m, HyperConnection)} == {"torch"}


# --------------------------------------------------------------------------- the native CPU loop
def _native_available():
    """Whether the native loop can be built here: with a C compiler it must build (a compiler
    whose build fails is a failure, not a skip)."""
    import os
    import shutil

    from ds4_torch.kernels import native

    if shutil.which(os.environ.get("CC", "cc")) is None or os.environ.get("DS4_TORCH_NATIVE") == "0":
        return False
    assert native.library() is not None, "a C compiler is present but the native Sinkhorn loop did not build"
    return True


@pytest.mark.parametrize("shape", SHAPES + [(0, 4, 4)])
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_native_loop_matches_the_loop(shape, iters):
    from ds4_torch.kernels import native

    if not _native_available():
        pytest.skip("no C compiler: the torch loop serves")
    comb = matrices(shape, seed=iters + len(shape))
    before = comb.clone()
    got = native.sinkhorn(comb, iters, 1e-6)
    assert got.shape == comb.shape and got.dtype == torch.float32 and torch.equal(comb, before)
    if not comb.numel():
        return
    assert (got.double() - loop(comb, iters, 1e-6)).abs().max().item() <= 1e-6
    assert (got - sinkhorn_torch(comb, iters, 1e-6)).abs().max().item() <= 1e-6
    strided = matrices((4, 4, 3), seed=5).transpose(0, 2)  # a non-contiguous input
    assert (native.sinkhorn(strided, iters, 1e-6).double() - loop(strided, iters, 1e-6)).abs().max() <= 1e-6


def test_native_loop_steps_aside_for_traces_autograd_and_when_off(monkeypatch):
    """Inside make_fx, with autograd recording, or with DS4_TORCH_NATIVE=0, `native.sinkhorn`
    gives None and `sinkhorn` runs torch ops (a trace sees them; gradients flow)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ds4_torch.kernels import native

    comb = matrices((1, 1, 4, 4), seed=3)
    with torch.no_grad():
        graph = make_fx(lambda c: sinkhorn(c, 20, 1e-6, "auto"), tracing_mode="real")(comb)
    ops = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert ops and all(t != torch.ops.ds4.sinkhorn.default for t in ops)  # the torch loop, traced
    assert (graph(comb).double() - loop(comb, 20, 1e-6)).abs().max() <= 1e-6
    leaf = comb.clone().requires_grad_()
    assert native.sinkhorn(leaf, 20, 1e-6) is None
    sinkhorn(leaf, 20, 1e-6, "auto").sum().backward()
    assert leaf.grad is not None
    monkeypatch.setattr(native.library, "_tried", False)
    monkeypatch.setattr(native.library, "_lib", None)
    monkeypatch.setenv("DS4_TORCH_NATIVE", "0")
    assert native.sinkhorn(comb, 20, 1e-6) is None
    assert (sinkhorn(comb, 20, 1e-6, "auto").double() - loop(comb, 20, 1e-6)).abs().max() <= 1e-6
