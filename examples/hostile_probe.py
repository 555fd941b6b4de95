"""How long a normal stream stalls beside each hostile request (issue #20's probe).

    python examples/hostile_probe.py [--model DIR] [--new-tokens 128] [--threads 1]

Starts `ds4-torch serve` (a separate process, as a user runs it), then for each hostile request:
one normal greedy stream (`/v1/completions`, `ignore_eos`) is started, and once its first token
arrived the hostile request is sent beside it. Prints the hostile request's status and time, the
normal stream's largest inter-token gap, and its gap without any hostile request (the baseline),
and checks the stream got the same tokens as alone. A measurement, not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx

HOSTILE = {
    "4 MB prompt of token ids": ("/v1/completions", lambda: {"model": "m", "prompt": [0] * 2_000_000, "max_tokens": 1}),
    "32 MiB body of values": ("/v1/completions", lambda: b'{"model": "m", "prompt": [' + b"0," * 16_000_000 + b"0]}"),
    "200K stop sequences": ("/v1/messages", lambda: {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"}], "stop_sequences": [f"s{i}" for i in range(200_000)]}),
    "10K tools": ("/v1/chat/completions", lambda: {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                                      for i in range(10_000)]}),
    "100K logit_bias entries": ("/v1/chat/completions", lambda: {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}], "logit_bias": {str(i % 1000): 1 for i in range(100_000)} |
        {f"x{i}": 1 for i in range(100_000)}}),
    "temperature 1e-45": ("/v1/chat/completions", lambda: {"model": "m", "max_tokens": 8, "temperature": 1e-45,
                                                           "messages": [{"role": "user", "content": "hi"}]}),
    "malformed tool schema": ("/v1/chat/completions", lambda: {"model": "m", "max_tokens": 16, "messages": [
        {"role": "user", "content": "What is the weather in Paris?"}], "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object", "required": 5, "anyOf": 5}}}]}),
    "nesting 100K deep": ("/v1/chat/completions", lambda: b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000
                          + b"}"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream(http: httpx.AsyncClient, first: asyncio.Event, new_tokens: int) -> tuple[list[float], list[int]]:
    body = {"model": "m", "prompt": "To be, or not to be", "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    stamps, ids = [], []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "choices" not in chunk:  # an error event: the normal stream failed
                    raise RuntimeError(f"the normal stream failed: {line[:300]}")
                got = chunk["choices"][0].get("token_ids") or []
                if got:
                    ids += got
                    stamps.append(time.perf_counter())
                    first.set()
    return stamps, ids


async def probe(url: str, path: str | None, make, new_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        first = asyncio.Event()
        task = asyncio.create_task(stream(http, first, new_tokens))
        hostile = None
        if path is not None:
            await first.wait()
            body = make()
            t0 = time.perf_counter()
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = await http.post(path, headers={"content-type": "application/json"}, **kw)
            hostile = (r.status_code, time.perf_counter() - t0, r.text[:120])
        stamps, ids = await task
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"max_gap": max(gaps) if gaps else float("nan"), "ids": ids, "hostile": hostile}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    port = _free_port()
    cmd = [sys.executable, "-m", "ds4_torch", "serve", "--port", str(port), "--log-level", "warning"] + \
        (["--model", a.model] if a.model else [])
    server = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(a.threads)))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        base = asyncio.run(probe(url, None, None, a.new_tokens))
        print(f"{'hostile request':28} {'status':>6} {'took':>8} {'largest gap':>12}  same tokens")
        print(f"{'(none: baseline)':28} {'':>6} {'':>8} {base['max_gap'] * 1e3:9.1f} ms")
        for name, (path, make) in HOSTILE.items():
            try:
                r = asyncio.run(probe(url, path, make, a.new_tokens))
            except Exception as e:  # noqa: BLE001 - a measurement: report and go on
                print(f"{name:28} failed: {type(e).__name__}: {e}", flush=True)
                continue
            status, took, _ = r["hostile"]
            print(f"{name:28} {status:>6} {took:7.2f}s {r['max_gap'] * 1e3:9.1f} ms  {r['ids'] == base['ids']}",
                  flush=True)
        alive = httpx.post(url + "/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]}).status_code
        print(f"a normal request afterwards: {alive}")
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
