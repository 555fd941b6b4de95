"""Helpers several test modules share."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent


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


def held_state(cache, index: int) -> list[torch.Tensor]:
    """Copies of everything sequence `index` of `cache` holds: its checkpoint (ring, open windows,
    position) and its compressed and indexer rows (gathered through its block table when paged;
    a paged slot's own tensors are the whole pool, which other sequences write)."""
    view = cache.slot(index)
    n = int(view.positions[0])
    out = [t.clone() for t in view.take_checkpoint(0).values()]
    out += [state.visible(n // layer.rate).clone() for layer in view.layers for state in layer.states]
    return out


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


@contextlib.contextmanager
def serve_process(*args: str, env_extra: dict | None = None, timeout: float = 90.0):
    """`python -m serve --port 0 *args`, a real process from the repository root (no injected
    faults unless `env_extra` sets them): yielded once /health answers 200, with `.url`, `.lines`
    (its output, still growing) and `.drain` (the thread reading it); killed at exit if running."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("DS4_TORCH_FAULT", None)
    env.update(env_extra or {})
    proc = subprocess.Popen([sys.executable, "-m", "serve", "--port", "0", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.lines = []
    try:
        deadline = time.monotonic() + timeout
        port = None
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            proc.lines.append(line)
            m = re.search(r"(?:Uvicorn running|API processes answering) on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        assert port, "".join(proc.lines)
        proc.drain = threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True)
        proc.drain.start()
        proc.url = f"http://127.0.0.1:{port}"
        wait_healthy(proc.url, deadline, lambda: "".join(proc.lines))
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def wait_healthy(url: str, deadline: float, output=lambda: "") -> None:
    """Until `url`/health answers 200 (not listening yet, then 503 "warming up" first), or fail
    with `output()` at `deadline` (time.monotonic())."""
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.ConnectError:
            pass
        assert time.monotonic() < deadline, output()
        time.sleep(0.1)


def gone(pid: int) -> bool:
    """Process `pid` has exited (a zombie waiting for its parent counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


def interrupt(proc) -> str:
    """Ctrl-C (SIGINT) to a `serve_process`: it must exit 0; its whole output."""
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0, "".join(proc.lines)
    proc.drain.join(10)
    return "".join(proc.lines)
