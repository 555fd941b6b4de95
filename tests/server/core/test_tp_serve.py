"""`ds4-torch serve --tp 2`: the server with the default model split over two processes (gloo on
CPU), against the single-process server answering the same requests; a follower killed
mid-request; a graceful shutdown. The ranks are real processes: started by torchrun, or by the
test with the launcher's environment where it must watch each process's exit."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from ds4_torch import faults

from helpers import gone, wait_for, wait_healthy
from helpers import MODEL, free_port, greedy_completion, random_prompt, rank_env, server, wait_idle

TESTS = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
CTX, CHUNK = 512, 16
SERVE = ["-m", "ds4_torch", "serve", "--tp", "2", "--port", "0", "--ctx", str(CTX), "--prefill-chunk", str(CHUNK),
         "--log-level", "info"]
STARTUP_S = 120
PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed", "KING HENRY:\nOnce more", "JULIET:\nO"]


class Ranks:
    """Processes of one server (torchrun, or one per rank); all output in one log file."""

    def __init__(self, procs: list[subprocess.Popen], log: Path):
        self.procs, self.log = procs, log
        self.url = None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> "Ranks":
        deadline = time.monotonic() + STARTUP_S
        while self.url is None:
            m = re.search(r"(?:Uvicorn running|API processes answering) on (http://127\.0\.0\.1:\d+)", self.text())
            if m:
                self.url = m.group(1)
            elif any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                raise AssertionError("the server did not start:\n" + self.text())
            else:
                time.sleep(0.1)
        wait_healthy(self.url, deadline, self.text)  # (API processes under --api-servers listen later)
        return self

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def torchrun(tmp: Path, *args: str, env: dict | None = None) -> Ranks:
    log = tmp / "torchrun.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS.parent), **(env or {})}
    proc = subprocess.Popen([PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), *SERVE, *args],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return Ranks([proc], log)


def launch_ranks(tmp: Path, *args: str, rank_extra_env: dict | None = None) -> Ranks:
    """Rank 0 and rank 1 as the test's own children, so each one's exit can be watched;
    `rank_extra_env`: rank -> more environment for that rank only."""
    log = tmp / "ranks.log"
    out, port = log.open("w"), free_port()
    procs = [subprocess.Popen([PYTHON, *SERVE, *args], env={**rank_env(rank, 2, port),
                                                            **(rank_extra_env or {}).get(rank, {})},
                              stdout=out, stderr=subprocess.STDOUT) for rank in range(2)]
    return Ranks(procs, log)


def ask(client: openai.OpenAI, prompt: str, n: int = 24, stream: bool = False) -> str:
    """A greedy completion's text (streamed pieces joined)."""
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=stream,
                                  extra_body={"ignore_eos": True})
    if stream:
        return "".join(c.choices[0].text for c in r if c.choices)
    return r.choices[0].text


def ask_all(client: openai.OpenAI) -> dict[str, str]:
    """Every prompt of PROMPTS at once (they decode together): prompt -> its greedy text."""
    got = {}
    threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, ask(client, p))) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


def chat(client: openai.OpenAI, content: str, n: int = 24) -> str:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                       max_tokens=n, temperature=0)
    return r.choices[0].message.content


@pytest.fixture(scope="module")
def single():
    """The same requests answered by one process: the expected outputs."""
    with server(ctx=CTX, prefill_chunk=CHUNK) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield {"chat": chat(client, "Who are you?"), **{p: ask(client, p) for p in PROMPTS}}


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    # The third decode step fails on both ranks (torchrun gives every rank the environment): the
    # engine's recovery (a batch reset, a retry) must keep the ranks in step.
    ranks = torchrun(tmp_path_factory.mktemp("tp_serve"), env={faults.ENV: "decode:3"})
    try:
        yield ranks.wait_ready()
    finally:
        ranks.procs[0].send_signal(signal.SIGINT)  # Ctrl-C: torchrun passes it to every rank
        try:
            ranks.procs[0].wait(30)
        finally:
            ranks.kill()


def test_answers_equal_the_single_process_server(tp_server, single):
    client = tp_server.client()
    assert chat(client, "Who are you?") == single["chat"]
    # that request met the injected fault (both ranks), was reset and retried, and still matches
    metrics = httpx.get(tp_server.url + "/metrics").text
    assert "ds4_device_errors_total 1.0" in metrics and "ds4_engine_resets_total 1.0" in metrics
    assert "rank 1: decode failed" in tp_server.text()
    streamed = ask(client, PROMPTS[0], stream=True)
    assert len(streamed) > 20 and streamed == single[PROMPTS[0]]


def test_concurrent_requests_batch_and_equal_the_single_process_server(tp_server, single):
    assert ask_all(tp_server.client()) == {p: single[p] for p in PROMPTS}
    # they really decoded together: the batch histogram saw steps of more than one sequence
    metrics = httpx.get(tp_server.url + "/metrics").text
    sizes = {float(m) for m in re.findall(r'ds4_batch_size_bucket\{le="1\.0"\} (\S+)', metrics)}
    steps = {float(m) for m in re.findall(r"ds4_batch_size_count (\S+)", metrics)}
    assert sizes and steps and max(steps) > max(sizes), metrics


def test_cancelled_stream_then_correct_answers(tp_server, single):
    client = tp_server.client()
    stream = client.completions.create(model=MODEL, prompt="MENENIUS:", max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away mid-decode
    wait_for(lambda: 'ds4_requests_aborted_total{stage="decode"} 1.0' in httpx.get(tp_server.url + "/metrics").text,
             30, "the cancelled stream to be noticed")
    assert ask(client, PROMPTS[1], stream=True) == single[PROMPTS[1]]
    assert chat(client, "Who are you?") == single["chat"]


def test_branch_and_regenerate_across_ranks(tp_server):
    """Real ranks: the same prompt again resumes from its end's checkpoint (a branch, no
    prefill), a longer one from there with a prefill on the branched slot; both greedy outputs
    are `generate`'s."""
    from ds4_torch.default_model import build_default_model
    from ds4_torch.generation import generate

    model = build_default_model()
    prompt = [(i * 17 + 5) % 900 + 3 for i in range(70)]
    longer = prompt + [11, 12, 13, 14, 15]

    def complete(ids):
        r = httpx.post(tp_server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    branches = lambda: float(re.search(r"^ds4_branches_total (\S+)$",  # noqa: E731
                                       httpx.get(tp_server.url + "/metrics").text, re.M).group(1))
    first, _ = complete(prompt)
    before = branches()
    assert complete(prompt) == (first, len(prompt)) and first == list(generate(model, prompt, 6))
    out, cached = complete(longer)
    assert out == list(generate(model, longer, 6)) and cached == len(prompt)
    assert branches() == before + 2


def test_killed_follower_ends_the_server_with_503(tmp_path):
    timeout = 10
    ranks = launch_ranks(tmp_path, "--tp-timeout", str(timeout))
    try:
        ranks.wait_ready()
        client = ranks.client()
        stream = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=400, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        ranks.procs[1].send_signal(signal.SIGKILL)
        # the stream ends with the API's error event (a 503 inside an already started 200 stream)
        with pytest.raises(openai.APIError, match="tensor-parallel group failed"):
            for _ in chunks:
                pass
        # rank 0 exits on its own, within the collective timeout (else wait() raises), with status 1
        assert ranks.procs[0].wait(timeout) == 1, ranks.text()
        with pytest.raises(openai.APIConnectionError):
            ask(client, "ROMEO:")
        assert "Traceback" not in ranks.text()
    finally:
        ranks.kill()


def test_a_fault_on_one_rank_only_is_a_group_failure(tmp_path):
    """The follower alone fails its third decode step: its cache no longer matches rank 0's, so
    retrying would go on with ranks that disagree. The acknowledgement of that step shows it (the
    ranks disagree, or, the follower having failed before the step's collectives, rank 0's side
    never completes): the stream ends with the API's error event, rank 0 exits 1, the follower too."""
    ranks = launch_ranks(tmp_path, "--tp-timeout", "8", rank_extra_env={1: {faults.ENV: "decode:3"}})
    try:
        client = ranks.wait_ready().client()
        with pytest.raises(openai.APIError, match="tensor-parallel group failed"):
            ask(client, "ROMEO:", n=16, stream=True)
        assert ranks.procs[0].wait(30) == 1, ranks.text()
        assert ranks.procs[1].wait(30) != 0
        assert "disagree on step" in ranks.text() or "acknowledging step" in ranks.text()
    finally:
        ranks.kill()


def test_api_servers_over_speculating_tensor_parallel_ranks(tmp_path, single):
    """`--api-servers 2 --tp 2 --speculative-tokens 2`: rank 0's core serves two API processes on
    one port; concurrent greedy requests (spread over both by the kernel) give the single plain
    process's answers while the ranks speculate, and drafts were accepted; the second API process
    killed, the first answers alone; SIGTERM to rank 0 (a service manager stopping the server)
    then drains it gracefully, the core tells the follower to stop, each exits as uvicorn does
    after a graceful shutdown, and no process is left. (One launch for both: the API processes
    only carry the tokens the core's steps give, however many a step gives; torchrun's launch:
    `tp_server`.)"""
    ranks = launch_ranks(tmp_path, "--api-servers", "2", "--speculative-tokens", "2").wait_ready()
    try:
        wait_for(lambda: ranks.text().count("Application startup complete") == 2, 60, "both API processes")
        api = [int(pid) for pid in re.findall(r"API process \d: process (\d+)", ranks.text())]
        assert len(api) == 2
        for _ in range(2):  # eight requests, spread over both API processes by the kernel
            assert ask_all(ranks.client()) == {p: single[p] for p in PROMPTS}
        metrics = httpx.get(ranks.url + "/metrics").text
        accepted = float(re.search(r"^ds4_spec_accepted_tokens_total (\S+)$", metrics, re.M).group(1))
        assert accepted > 0, metrics
        os.kill(api[1], signal.SIGKILL)
        wait_for(lambda: gone(api[1]), 10, "API process 2 to die")
        assert ask_all(ranks.client()) == {p: single[p] for p in PROMPTS}
        ranks.procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(30) for p in ranks.procs] == [-signal.SIGTERM, 0], ranks.text()
        assert ranks.text().count("Application shutdown complete") == 1, ranks.text()  # the survivor's
        assert "rank 1: stopped by rank 0" in ranks.text(), ranks.text()
        wait_for(lambda: all(gone(pid) for pid in api), 10, "the API processes to exit")
    finally:
        ranks.kill()


# --------------------------------------------------------------------------- lockstep, in one process
class MirrorPeers:
    """Stands in for serve.core.tp.Lead without a process group: every operation the engine sends runs
    at once on a second replica of the same model, as a follower would run it. After any workload
    the two replicas' caches must be equal, which only holds if the engine sent every operation
    that touched its own caches, in order, with the data (a disk restore) they need."""

    heartbeat_s = 0.05
    broken = None

    def __init__(self, model):
        self.model, self.sent, self.follower, self.outcomes = model, [], None, []

    def open(self, shape):
        from serve.engine.replica import Replica

        self.follower = Replica(self.model, **shape)

    def send(self, operation, args, model):
        self.sent.append(operation)
        try:
            with torch.no_grad():
                getattr(self.follower, operation)(*args)
            self.outcomes.append(True)
        except Exception:  # noqa: BLE001 - compared with the lead's in acknowledge
            self.outcomes.append(False)
        return len(self.outcomes)

    def acknowledge(self, step, ok):
        assert self.outcomes[step - 1] == ok, f"the follower and the lead disagree on step {step}"

    def heartbeat(self):
        self.sent.append("heartbeat")

    def stop(self):
        self.sent.append("stop")

    def failed(self, reason):
        raise AssertionError(f"the group never breaks here: {reason}")


def assert_same_caches(lead, follower):
    from helpers import held_state

    # every sequence's state (a free block's stale rows are nobody's: the pool's raw tensors may differ there)
    for name in ("resident", "batch"):
        for i in range(getattr(lead, name).batch_size):
            mine, theirs = held_state(getattr(lead, name), i), held_state(getattr(follower, name), i)
            assert len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs)), (name, i)
    # the ranks' KV pools: the same block tables, holding the same blocks as often
    assert [(t.blocks, t.tokens) for t in lead.kv.all_tables] == [(t.blocks, t.tokens) for t in follower.kv.all_tables]
    counts = [[p.refcount(b) for b in range(p.num_blocks)] for p in (lead.pool, follower.pool)]
    assert counts[0] == counts[1] and sum(counts[0]) > 0


def test_every_cache_operation_reaches_the_followers(tmp_path):
    """Prefills, batched decodes, forks (n=2), a cancelled stream, evictions and a disk restore."""
    from ds4_torch.default_model import build_default_model

    model = build_default_model()

    def mirrored_server(peers):
        return server(model, ctx=512, prefill_chunk=32, max_batch=2, max_sessions=2, peers=peers,
                      kv_disk=dict(dir=tmp_path / "kv", space_mb=8.0, min_tokens=8))

    a, b, c = random_prompt(1), random_prompt(2), random_prompt(3)
    peers = MirrorPeers(model)
    with mirrored_server(peers) as srv:
        engine = srv.app.state.engine
        # two at once: batched decode steps; then the same prompt twice at once: the second forks
        # the first one's session
        for pair in ((a, b), (c, c)):
            threads = [threading.Thread(target=greedy_completion, args=(srv, p)) for p in pair]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        engine.token_delay = 0.05
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": a + [9], "max_tokens": 200, "stream": True, "ignore_eos": True}) as s:
            next(s.iter_lines())  # then the client leaves
        wait_for(lambda: srv.app.state.metrics.value("ds4_requests_aborted_total", stage="decode") >= 1,
                 what="the stream's disconnect")
        engine.token_delay = 0.0
        wait_idle(srv)
        assert srv.app.state.metrics.value("ds4_session_evictions_total") > 0
        assert_same_caches(engine.replica, peers.follower)
        sent = len(peers.sent)
        wait_for(lambda: "heartbeat" in peers.sent[sent:], what="a heartbeat while idle")
    assert {"prefill", "decode", "copy", "reset", "heartbeat"} <= set(peers.sent) and peers.sent[-1] == "stop"

    peers = MirrorPeers(model)
    with mirrored_server(peers) as srv:  # a restart: `a` comes back from disk
        tokens, cached = greedy_completion(srv, a + [7])
        assert cached == len(a)
        wait_idle(srv)
        assert "import_sequence" in peers.sent
        assert_same_caches(srv.app.state.engine.replica, peers.follower)


@torch.no_grad()
def test_checkpoint_operations_reach_the_followers():
    """Checkpoints taken, branched from, restored, imported (a disk read) and dropped through the
    lead's replica, each operation sent first as the engine sends it (its arguments through
    pickle, as the control group carries them): the follower's caches and checkpoints stay equal
    to the lead's, and the branched and rewound sequences continue like cold runs."""
    import pickle

    from ds4_torch.default_model import build_default_model
    from serve.engine.replica import MODEL_OPERATIONS, Replica

    model = build_default_model()
    lead, peers = Replica(model, ctx=128, sessions=3, batch_slots=2, decode_mode="eager"), MirrorPeers(model)
    peers.open(lead.shape())

    def run(operation, *args):
        step = peers.send(operation, pickle.loads(pickle.dumps(args)), model=operation in MODEL_OPERATIONS)
        result = getattr(lead, operation)(*args)
        peers.acknowledge(step, ok=True)
        return result

    def cold(tokens):  # fed in the same pieces (32, then the rest): chunking alone moves logits by ~1e-5
        cache = model.new_cache(1, 128)
        model(torch.tensor([tokens[:32]]), cache=cache)
        return model(torch.tensor([tokens[32:]]), cache=cache)[0, -1]

    g = torch.Generator().manual_seed(21)
    a = torch.randint(2, model.config.vocab_size, (70,), generator=g).tolist()
    b = a[:37] + torch.randint(2, model.config.vocab_size, (9,), generator=g).tolist()
    run("prefill", 0, a[:32], False)
    run("take_checkpoint", "at32", "resident", 0)
    run("prefill", 0, a[32:], False)
    run("branch_from_checkpoint", "resident", 1, "resident", 0, "at32")
    logits_b = run("prefill", 1, b[32:], False)[0]
    run("restore_checkpoint", "resident", 0, "at32")
    logits_rewound = run("prefill", 0, b[32:], False)[0]
    run("import_checkpoint", "from disk", {k: v.cpu() for k, v in lead.checkpoints["at32"].items()})
    run("drop_checkpoint", "at32")
    run("branch_from_checkpoint", "resident", 2, "resident", 1, "from disk")
    logits_disk = run("prefill", 2, b[32:], False)[0]
    run("copy", "batch", 0, 2, "resident")
    step = run("decode", [int(logits_disk.argmax())])[0]

    for logits in (logits_b, logits_rewound, logits_disk):
        assert (logits - cold(b)).abs().max() <= 1e-5
    assert (step - cold(b + [int(logits_disk.argmax())])).abs().max() <= 1e-5
    assert_same_caches(lead, peers.follower)
    assert list(peers.follower.checkpoints) == list(lead.checkpoints) == ["from disk"]
    assert all(torch.equal(peers.follower.checkpoints["from disk"][k], t)
               for k, t in lead.checkpoints["from disk"].items())
    assert lead.checkpoint_bytes() == lead.resident.checkpoint_nbytes()
    with pytest.raises(KeyError, match="no checkpoint 'at32'"):
        lead.restore_checkpoint("resident", 0, "at32")


def test_engine_checkpoints_reach_the_followers(tmp_path):
    """The engine's checkpoints under tensor parallelism (mirrored in one process): taken in
    prefill and decode, branched from, rewound to, dropped (budget and eviction) and imported
    from disk, each sent to the follower first; its caches and checkpoints stay the lead's, and
    the answers are the cold ones."""
    from ds4_torch.default_model import build_default_model
    from ds4_torch.generation import generate

    model = build_default_model()

    def mirrored_server(peers, max_sessions):
        return server(model, ctx=256, prefill_chunk=64, max_batch=2, max_sessions=max_sessions, checkpoint_interval=20,
                      peers=peers, kv_disk=dict(dir=tmp_path / "kv", space_mb=8.0, min_tokens=8))

    def same(engine, follower):
        assert_same_caches(engine.replica, follower)
        assert list(follower.checkpoints) == list(engine.replica.checkpoints)
        assert all(torch.equal(follower.checkpoints[i][k], t) for i, c in engine.replica.checkpoints.items()
                   for k, t in c.items())

    g = torch.Generator().manual_seed(5)
    base = torch.randint(2, model.config.vocab_size, (90,), generator=g).tolist()
    other = lambda d: base[:d] + torch.randint(2, model.config.vocab_size, (11,), generator=g).tolist()  # noqa: E731
    # Four slots: the diverging requests branch; two: they rewind in place (dropping later checkpoints).
    for max_sessions, ops in ((4, {"branch_from_checkpoint"}), (2, {"restore_checkpoint", "drop_checkpoint"})):
        peers = MirrorPeers(model)
        with mirrored_server(peers, max_sessions) as srv:
            engine = srv.app.state.engine
            assert greedy_completion(srv, base, 30)[0] == list(generate(model, base, 30))  # decode-time checkpoints too
            for d in (47, 75, 101):
                prompt = other(d) if d < 90 else base + list(generate(model, base, 30))[:11] + [5]
                out, cached = greedy_completion(srv, prompt, 6)
                assert out == list(generate(model, prompt, 6)) and cached >= d - 20
            wait_idle(srv)
            same(engine, peers.follower)
        assert {"take_checkpoint", *ops} <= set(peers.sent)
    peers = MirrorPeers(model)
    with mirrored_server(peers, 4) as srv:  # a restart: a divergence inside a stored conversation, from disk
        prompt = other(67)
        out, cached = greedy_completion(srv, prompt, 6)
        assert out == list(generate(model, prompt, 6)) and cached == 60
        wait_idle(srv)
        same(srv.app.state.engine, peers.follower)
    assert {"import_sequence", "import_checkpoint"} <= set(peers.sent)


def test_speculative_steps_reach_the_followers(tmp_path):
    """`--speculative-tokens 2` under tensor parallelism: every rank runs the whole speculative
    step (drafts included), so the sampler's writes and the steps must reach the followers, whose
    caches (MTP layer included) and samplers then equal the lead's; the tokens equal a plain
    single-process server's."""
    from ds4_torch.default_model import build_default_model

    model = build_default_model()
    prompts = ["ROMEO:\nWhat light", "First Citizen:\nBefore we proceed any further, hear me speak. " * 2]
    bodies = [dict(prompt=prompts[0], max_tokens=30, temperature=0.9, seed=3, stop_token_ids=[7]),
              dict(prompt=prompts[1], max_tokens=37, temperature=0, presence_penalty=1.0),
              dict(prompt=prompts[0] + " and", max_tokens=20)]  # unseeded: rank 0 picks one seed for all
    outputs = []
    for n, peers in ((0, None), (2, MirrorPeers(model))):
        with server(model, ctx=256, prefill_chunk=16, max_batch=2, speculative_tokens=n, peers=peers) as srv:
            got = [None] * len(bodies)

            def ask_one(i):
                got[i] = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                    "model": MODEL, "ignore_eos": True, "return_token_ids": True, **bodies[i]}).json()
            threads = [threading.Thread(target=ask_one, args=(i,)) for i in range(len(bodies))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            outputs.append([g["choices"][0]["token_ids"] for g in got[:2]])  # the unseeded one: its own draw
            if peers is not None:
                wait_idle(srv)
                assert_same_caches(srv.app.state.engine.replica, peers.follower)
                lead, follower = srv.app.state.engine.replica.sampler, peers.follower.sampler
                assert torch.equal(lead.generated, follower.generated)
                assert {"speculate", "join", "sampler_admit", "sampler_append"} <= set(peers.sent)
                assert srv.app.state.metrics.value("ds4_spec_accepted_tokens_total") > 0
    assert outputs[1] == outputs[0]


def test_a_tool_call_block_under_its_grammar_while_speculating_reaches_the_followers():
    """Speculating under tensor parallelism, a request opens a tool-call block: its masked steps
    (one token each, the mask computed on rank 0 and sent with the step) reach every rank; the
    call and the caches equal the plain single-process server's, and the model, which left alone
    calls its drilled get_weather, calls the offered tool. (Steps giving back the tokens past a
    trigger: test_offered_calls.py.)"""
    from ds4_torch.default_model import build_default_model

    model = build_default_model()
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"],
        "additionalProperties": False}}}]
    outputs = []
    for n, peers in ((0, None), (2, MirrorPeers(model))):
        with server(model, ctx=1024, prefill_chunk=64, max_batch=2, speculative_tokens=n, peers=peers) as srv:
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "tools": tools, "temperature": 0, "max_tokens": 60, "return_token_ids": True})
            assert r.status_code == 200, r.text
            r = r.json()
            choice = r["choices"][0]
            outputs.append((choice["token_ids"], choice["message"].get("tool_calls") and
                            [t["function"] for t in choice["message"]["tool_calls"]]))
            if peers is not None:
                wait_idle(srv)
                assert_same_caches(srv.app.state.engine.replica, peers.follower)
                assert {"speculate", "join"} <= set(peers.sent)
    assert outputs[0][1] and outputs[0][1][0]["name"] == "Bash"
    assert outputs[1] == outputs[0]
