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

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = TESTS / "data"  # the small slices tests read (a fresh clone has no ../shared)
MODEL = "ds4-default"  # the embedded model's served name


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


class PrefillGate:
    """Holds an engine inside its prefill chunks, each until the test lets it run (`held_prefill`):
    `entered` counts the chunks that reached the gate; `allow(n)` lets n more run; `open()` lets
    every one run from then on. What the engine does meanwhile (queueing, cancels, keep-alives)
    is then ordered by the test, not by how fast the machine is."""

    def __init__(self):
        self.entered, self.permits, self.is_open = 0, 0, False
        self.cond = threading.Condition()

    def wait_turn(self) -> None:
        with self.cond:
            self.entered += 1
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: self.is_open or self.permits > 0, timeout=120):
                raise AssertionError("a held prefill chunk was never let through")
            if not self.is_open:
                self.permits -= 1

    def allow(self, n: int = 1) -> None:
        with self.cond:
            self.permits += n
            self.cond.notify_all()

    def open(self) -> None:
        with self.cond:
            self.is_open = True
            self.cond.notify_all()

    def wait_entered(self, n: int, timeout: float = 30.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.entered >= n, timeout=timeout):
                raise AssertionError(f"{self.entered} prefill chunk(s) reached the gate, waiting for {n}")


@contextlib.contextmanager
def held_prefill(engine):
    """A `PrefillGate` on `engine`'s prefill chunks (an in-process engine's runner) for the block;
    opened at its end."""
    runner, gate = engine.runner, PrefillGate()
    prefill = runner.prefill

    def gated(*args, **kwargs):
        gate.wait_turn()
        return prefill(*args, **kwargs)

    runner.prefill = gated
    try:
        yield gate
    finally:
        gate.open()
        del runner.prefill  # the class's method again


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


def server(model=None, tok=None, *, kv_store=None, kv_disk: dict | None = None, peers=None, engine=None,
           **settings):
    """The app on a background thread, not yet started (`with server(...) as srv:` starts it, with
    `.url` and `.app`): `create_app(model, tok, ServerConfig(**settings))`, the embedded model and
    tokenizer by default. `kv_disk` (dir, space_mb and `KVStore`'s keywords) attaches a disk KV
    store counting into the app's metrics."""
    from ds4_torch.default_model import build_default_model, default_tokenizer
    from serve.background import BackgroundServer
    from serve.http.app import ServerConfig, create_app

    model = build_default_model() if model is None else model
    app = create_app(model, default_tokenizer() if tok is None else tok, ServerConfig(**settings),
                     kv_store=kv_store, peers=peers, engine=engine)
    if kv_disk is not None:
        from serve.kvstore.store import KVStore

        disk = dict(kv_disk)
        app.state.engine.kv_store = KVStore(disk.pop("dir"), disk.pop("space_mb"), model, ctx=settings["ctx"],
                                            registry=app.state.metrics.registry, **disk)
    return BackgroundServer(app)


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
    """Process `pid` has exited (a zombie waiting for its parent counts as gone once every thread
    of it has ended: its main thread is a zombie while the others may still be closing its
    sockets, a listening one still taking connections it then resets)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                if f.read().split(")")[-1].split()[0] not in ("Z", "X"):
                    return False
        except FileNotFoundError:  # (that thread has just ended)
            continue
    return True


def interrupt(proc) -> str:
    """Ctrl-C (SIGINT) to a `serve_process`: it must exit 0; its whole output."""
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0, "".join(proc.lines)
    proc.drain.join(10)
    return "".join(proc.lines)


def expected(model, tok, ids, n, eos=None, forbidden=(), chunk=32):
    """Greedy tokens and text as `ds4_torch.generate` gives them for the same prompt (no EOS stop
    unless `eos`: requests that compare with it send `ignore_eos`; `forbidden` tokens never drawn)."""
    from ds4_torch.generation import generate
    from ds4_torch.tokenizer import StreamDecoder

    tokens = list(generate(model, ids, n, prefill_chunk=chunk, eos_token_id=eos, forbidden_token_ids=forbidden))
    sd = StreamDecoder(tok)
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    text = "".join(sd.push(t) for t in tokens if t not in eos) + sd.flush()  # EOS adds no text
    return tokens, text


def greedy_completion(srv, prompt, n=8, key=None, timeout=120):
    """A greedy completion of token ids through /v1/completions (EOS ignored): (its token ids, the
    prompt tokens it reused)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=timeout,
                   headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["token_ids"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def random_prompt(seed, n=80):
    """`n` token ids of the embedded model's vocabulary, from `seed`."""
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def wait_idle(srv, timeout=10.0):
    """No request in the engine and every snapshot it handed to its background writer written."""
    engine = srv.app.state.engine
    wait_for(engine.idle, timeout, "the engine to be idle")
    engine.flush_snapshots()


def prompt_ids(n, salt):
    """`n` distinct-looking token ids, the same for the same salt."""
    return [(i * 13 + salt * 31) % 997 + 2 for i in range(n)]


def stop_spanning_tokens(tok, tokens):
    """A stop string that starts inside one token's text and ends inside a later one's, occurring
    first there; and the count of tokens up to the one that completes it."""
    texts = [tok.decode(tokens[:m]) for m in range(len(tokens) + 1)]
    full = texts[-1]
    for m in range(4, len(tokens)):
        c = len(texts[m])  # the boundary between token m-1 and token m
        if len(texts[m - 1]) < c - 2 and len(texts[m + 1]) > c + 2:
            stop = full[c - 2:c + 2]
            if full.find(stop) == c - 2 and stop.strip() == stop and stop.isprintable():
                upto = next(k for k in range(len(tokens) + 1) if stop in texts[k])
                return stop, full[:c - 2], upto
    raise AssertionError("no stop string spans tokens in this continuation")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict:
    """The environment torchrun gives rank `rank` of `world` on this machine (gloo on loopback)."""
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}


BPE_TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"


def write_bpe(directory, config=None):
    """A tiny byte-level BPE with DeepSeek's chat markers as special tokens, as `directory`'s
    tokenizer.json (and `config` as its tokenizer_config.json)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ds4_torch.tokenizer import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=[BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([BPE_TEXT] * 3 + ["Hello there. How are you?"], trainer)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@contextlib.contextmanager
def api_processes(*flags: str, count: int = 2, timeout: float = 120.0, env: dict | None = None):
    """An engine core process and `count` API processes over it, started as `serve --api-servers
    N` starts them but each on a port of its own, so a test chooses which one serves a request.
    `env`: variables they get (none of DS4_TORCH_FAULT's otherwise). Yields the core (a
    serve.core.process.CoreProcess) and [(Popen, url)] (the first the owner); at exit SIGTERM to
    the others, then to the owner (which drains the core; the core itself when the owner is
    gone), then the core is waited for. Their output goes to this process's (capfd reads it)."""
    import socket

    import pytest

    from serve.cli import build_parser
    from serve.core.api_process import spawn_api_worker, stop_api_workers
    from serve.core.process import spawn_core

    args = build_parser().parse_args(["--port", "0", *flags])
    holds = []  # the ports, bound (not listening) until the API processes listen on them too
    for _ in range(count):
        holds.append(socket.socket())
        holds[-1].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holds[-1].bind(("127.0.0.1", 0))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        patch.delenv("DS4_TORCH_FAULT", raising=False)
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        core = spawn_core(args)
        api = [(spawn_api_worker(args, core, hold.getsockname()[1], number, owner=number == 1),
                f"http://127.0.0.1:{hold.getsockname()[1]}") for number, hold in enumerate(holds, 1)]
    try:
        deadline = time.monotonic() + timeout
        for proc, url in api:
            wait_healthy(url, deadline)
        for hold in holds:
            hold.close()
        yield core, api
    finally:
        for hold in holds:
            hold.close()
        for proc, _ in api[1:] + api[:1]:
            stop_api_workers([proc])
        if core.proc.poll() is None and api[0][0].returncode not in (0, -signal.SIGTERM):
            core.proc.send_signal(signal.SIGTERM)  # (its owner died: nobody asked it to drain)
        core.wait(60)
