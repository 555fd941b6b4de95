"""Replicas of the server behind vllm-router on loopback: `python -m serve` processes, each
publishing its KV events (`--kv-events` on a free port, found by the router through GET
/kv_event_sources), and `vllm-router` in front of them with one policy. What `ds4-torch bench
serve --scenario agents --replicas N` measures through (docs/scaling-out.md shows the same by hand).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

ROUTER = "vllm-router"  # the console script of PyPI's vllm-router (a prebuilt Rust binary in its wheel)


def router_executable(given: str | None = None) -> str | None:
    """`given`, else the vllm-router installed beside this Python (the dev extra's), else one on PATH."""
    if given:
        return given
    beside = os.path.join(os.path.dirname(sys.executable), ROUTER)
    return beside if os.access(beside, os.X_OK) else shutil.which(ROUTER)


@dataclass
class Process:
    proc: subprocess.Popen
    url: str = ""
    lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        """Gone at once, as a crash leaves it (SIGKILL; its engine core follows its parent)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def _drain(p: Process) -> None:
    threading.Thread(target=lambda: p.lines.extend(p.proc.stdout), daemon=True).start()


def _wait_ok(url: str, deadline: float, p: Process, what: str) -> None:
    import httpx

    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if p.proc.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise RuntimeError(f"{what} did not start (exit status {p.proc.poll()}):\n{p.output()[-4000:]}")
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(serve_args: list[str], timeout: float = 300.0) -> Process:
    """`python -m serve --port P --kv-events ... *serve_args` on a free port P, once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "serve", "--port", str(port), "--kv-events", "tcp://127.0.0.1:*",
           "--kv-events-replay", "tcp://127.0.0.1:*", *serve_args]
    p = Process(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
                url=f"http://127.0.0.1:{port}")
    _drain(p)
    _wait_ok(p.url + "/health", time.monotonic() + timeout, p, "a replica")
    return p


def start_router(executable: str, urls: list[str], policy: str, extra: tuple[str, ...] = (),
                 timeout: float = 120.0) -> Process:
    """`vllm-router --policy POLICY --worker-urls *urls` on a free loopback port, once it answers
    /health. Health checks every 2 s, a worker out after one failure (a dead replica is noticed
    quickly); its Prometheus exporter on a free port too (several routers may run); `extra`: more
    of its flags."""
    port = free_port()
    cmd = [executable, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
           "--health-check-interval-secs", "2", "--health-failure-threshold", "1", "--log-level", "warning",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *extra]
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    p = Process(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env),
                url=f"http://127.0.0.1:{port}")
    _drain(p)
    _wait_ok(p.url + "/health", time.monotonic() + timeout, p, f"vllm-router ({executable})")
    return p


@contextlib.contextmanager
def replicas_behind_router(n: int, serve_args: list[str], policy: str, executable: str,
                           router_extra: tuple[str, ...] = ()):
    """`n` replicas (started one after another) and a router in front of them: yields (router,
    replicas); all stopped at exit."""
    started: list[Process] = []
    try:
        for _ in range(n):
            started.append(start_replica(serve_args))
        router = start_router(executable, [r.url for r in started], policy, router_extra)
        started.append(router)
        yield router, started[:-1]
    finally:
        for p in reversed(started):
            p.stop()
