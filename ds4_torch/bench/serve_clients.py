"""The HTTP clients of `ds4-torch bench serve`, in a process of their own (`run_clients`), as
real clients would be: in the server's process they would compete with its threads for the GIL
and slow down what is being measured. This module imports no torch, so the client process
starts in a fraction of a second."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time


async def _client(http, url: str, prompt: list[int], new_tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    start = time.perf_counter()
    stamps: list[float] = []
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices", ()):
                now = time.perf_counter()
                stamps.extend([now] * len(choice.get("token_ids") or ()))
    return {"ttft": stamps[0] - start, "stamps": stamps, "tokens": len(stamps)}


async def _run_clients(url: str, prompts: list[list[int]], new_tokens: int, late: list[int] | None = None) -> dict:
    """`prompts` stream concurrently; with `late`, a request with that prompt is sent once every
    stream has produced a few tokens, and its send/answer times are returned."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        start, cpu = time.perf_counter(), time.process_time()
        tasks = [asyncio.ensure_future(_client(http, url, p, new_tokens)) for p in prompts]
        window = None
        if late is not None:
            await asyncio.sleep(0.5)  # the streams are past their prefills and decoding
            sent = time.perf_counter()
            r = await http.post(url + "/v1/completions", json={"model": "bench", "prompt": late, "max_tokens": 1})
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            window = (sent, time.perf_counter())
        results = await asyncio.gather(*tasks)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"ttft": [r["ttft"] for r in results], "stamps": [r["stamps"] for r in results],
            "tokens": sum(r["tokens"] for r in results), "wall": wall, "window": window, "client_cores": cpu / wall}


def main() -> None:
    """Entry point of the client process: spec as JSON on stdin, results as JSON on stdout."""
    spec = json.load(sys.stdin)
    json.dump(asyncio.run(_run_clients(spec["url"], spec["prompts"], spec["new_tokens"], spec.get("late"))),
              sys.stdout)


def run_clients(url: str, prompts: list[list[int]], new_tokens: int, late: list[int] | None = None) -> dict:
    """`_run_clients` in a client process: its results (ttft, stamps, tokens, wall, the late
    request's window, the client's CPU cores)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds ds4_torch/
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "ds4_torch.bench.serve_clients"],
                          input=json.dumps({"url": url, "prompts": prompts, "new_tokens": new_tokens, "late": late}),
                          capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"the client process failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


if __name__ == "__main__":
    main()
