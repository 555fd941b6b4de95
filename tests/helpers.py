"""Helpers several test modules share."""
from __future__ import annotations

import time

import torch


def assert_close(actual, expected, dtype):
    """Kernel outputs against a higher-precision reference on the same (already rounded) inputs:
    fp32 within 1e-5 absolute; fp16/bf16 within 8 ulps (8 * eps, relative, 1 absolute floor): the
    kernels accumulate in fp32 and round once."""
    assert actual.dtype == dtype and actual.shape == expected.shape
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all()
    if dtype == torch.float32:
        tol = 1e-5 * torch.ones_like(expected)
    else:
        tol = 8 * torch.finfo(dtype).eps * expected.abs().clamp(min=1.0)
    err = (actual - expected).abs()
    assert (err <= tol).all(), f"max error {err.max().item():.3g} (tolerance {tol.max().item():.3g})"


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def reference_logprobs(model, ids):
    """log_softmax of a stateless forward over `ids` [T, V]: row i predicts token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


def penalised_greedy(model, ids, n, presence, frequency, repetition):
    """Greedy decoding with OpenAI's presence/frequency and vLLM's repetition penalty, written from
    their definitions over stateless forwards."""
    gen = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids + gen]))[0, -1].float()
        for t in set(ids + gen):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(gen):
            logits[t] -= gen.count(t) * frequency + presence
        gen.append(int(torch.argmax(logits)))
    return gen


def metric(srv, name: str, **labels) -> float:
    """A metric's current value on a test server (0 when absent)."""
    return srv.app.state.metrics.value(name, **labels)
