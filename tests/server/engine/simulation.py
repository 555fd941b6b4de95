"""A seeded simulation of the serving engine (issue #43): random workloads over a deliberately
small KV pool, with injected faults, checked after every engine step and at the end.

Not a test module: `test_simulation.py` runs it over fixed seeds (and for `DS4_SIM_SECONDS`
seconds when set); `python tests/server/engine/simulation.py SEED...` replays seeds, printing
what happened. Everything about a run follows from its seed: the engine runs without threads
(`Engine.start(thread=False)`, one `iterate()` at a time, output on this thread, disk reads and
writes waited for between iterations), so a failing seed fails the same way every time.

A run (`simulate(seed)`):

- **Engine**: the embedded model with one token's embedding made inf (`POISON`: a request holding
  it overflows, alone or not), a pool of a few blocks of 16 tokens (so prompts of tens of tokens
  reclaim, evict and preempt; a quarter of the replies are 16 to 40 tokens long), 1 to 4 batch slots, 2 to 5 sessions, prefill chunks of 16 or 32,
  checkpoints every 16 to 64 tokens or none; per seed, speculation (2 drafts) or not, the eager
  or the graph decode path (the capture emulator off CUDA), a disk KV store (evicted
  conversations written, restored from) or not, 1 to 3 tenants.
- **Workload**, an event or none per iteration: new prompts (a tenant's family prefix and a
  tail of their own), the next turn of a finished conversation, a regenerate (the same prompt,
  sometimes another tenant's), an edit (a prompt cut and given another tail), `n` > 1 choices,
  seeded sampling, stop strings, prompt logprobs, a request holding `POISON`; cancels while
  queued, prefilling or decoding; submits the engine must refuse (a bad setting, a prompt past
  the context).
- **Faults** (`DS4_TORCH_FAULT`, the engine's own injection points): a prefill chunk, a decode
  step or the first step after a disk restore raising a device error or an OOM.
- **After every iteration** (`check_pool`): reference counts equal the block tables holding each
  block; free, cached and held blocks are disjoint and cover the pool; the digest maps agree;
  each table's digests chain its own tokens under its own tenant, and a registered block it
  holds is registered under that digest; blocks held by several tables are one tenant's; the
  slot maps are the tables' (rows past a table on the zero row, which holds zeros); the tables
  hold the tokens the engine thinks (resident sessions, decoding requests).
- **At the end**: every request ended; each one done equals the same request served alone (a
  roomy engine, one request at a time, plain decoding: tokens and finish reason); each failure
  is its own (it holds `POISON` and fails alone too) or follows two injected faults in its steps
  (the engine answers 503 after a retry); a cancelled one sent a prefix of its answer alone;
  nothing is left open or held (no request in flight, batch slots and the sampler empty, the
  checkpoints those of resident sessions, every block free or cached once the sessions go).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

POISON = 3            # the simulated model's embedding of this token is inf: an overflow, its holder's own
BT = 16               # tokens per KV block (a multiple of the embedded model's rates, 4 and 16)
STOPS = ["e", "\n", "th", "the", " a", "s,"]
REPLAY = "DS4_SIM_SEED={seed} PYTHONPATH=. python -m pytest -q -p no:cacheprovider tests/server/engine/test_simulation.py -k test_seed"


# --------------------------------------------------------------------------- the plan of a run
@dataclass
class Plan:
    """What a seed decides before the run."""
    seed: int
    blocks: int
    max_batch: int
    max_sessions: int
    prefill_chunk: int
    checkpoint_interval: int
    speculative: int
    speculative_max_batch: int | None
    decode_mode: str
    disk: bool
    tenants: list
    iterations: int
    faults: str
    max_queue: int

    @classmethod
    def of(cls, seed: int) -> "Plan":
        rng = random.Random(seed * 7919 + 1)
        max_batch = rng.choice([1, 2, 2, 3, 4])
        faults = []
        for _ in range(rng.choice([0, 1, 2, 2, 3])):
            site = rng.choice(["prefill", "decode", "decode", "restore"])
            faults.append(f"{site}:{rng.randint(2, 40)}:{rng.choice(['device', 'oom'])}")
        return cls(seed=seed, blocks=rng.randint(5, 10), max_batch=max_batch,
                   max_sessions=max_batch + rng.randint(1, 3), prefill_chunk=rng.choice([16, 32]),
                   checkpoint_interval=rng.choice([0, 16, 32, 64]), speculative=rng.choice([0, 0, 2]),
                   speculative_max_batch=rng.choice([None, 1]),
                   decode_mode=rng.choice(["eager"] * 7 + ["graph"]), disk=rng.random() < 0.35,
                   tenants=[None, "alice", "bob"][:rng.randint(1, 3)], iterations=rng.randint(30, 60),
                   faults=",".join(faults), max_queue=rng.choice([4, 8, 64]))


# --------------------------------------------------------------------------- one request
@dataclass
class Sent:
    """A request as the workload submitted it, and what became of it."""
    req: object                   # serve.engine.sequence.GenRequest
    key: tuple                    # what defines it (the reference's cache key)
    at: int                       # the iteration it was submitted in
    cancel_at: int | None = None  # the iteration the workload cancels it in
    cancelled_while: str | None = None
    faults: int = 0               # injected faults in the steps it was part of
    preempted: list = field(default_factory=list)  # tokens it had generated at each preemption

    @property
    def poisoned(self) -> bool:
        return POISON in self.req.prompt_ids


@dataclass
class Report:
    seed: int
    plan: Plan
    problems: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)

    def line(self) -> str:
        c = self.counts
        return (f"seed {self.seed}: {c['requests']} requests ({c['done']} done, {c['failed']} failed, "
                f"{c['cancelled']} cancelled, {c['refused']} refused), {c['faults']} faults, {c['preemptions']} "
                f"preemptions, {c['evictions']} evictions, {c['reclaimed']} blocks reclaimed, {c['disk_saves']} "
                f"disk saves, {c['disk_restores']} restores, {c['iterations']} iterations")


# --------------------------------------------------------------------------- models
_MODELS: dict = {}


def simulated_model(model):
    """A copy of `model` whose embedding of POISON is inf (built once per model)."""
    if id(model) not in _MODELS:
        bad = copy.deepcopy(model)
        with torch.no_grad():
            bad.model.embed_tokens.weight[POISON] = float("inf")
        _MODELS[id(model)] = (model, bad)
    return _MODELS[id(model)][1]


def build_engine(model, tok, plan: Plan, workdir: str):
    from ds4_torch.paged import block_nbytes
    from serve.engine.loop import Engine

    mb = plan.blocks * block_nbytes(model.config, model.dtype, BT) / 2**20
    engine = Engine(model, tok, ctx=512, prefill_chunk=plan.prefill_chunk, decode_mode=plan.decode_mode,
                    max_queue=plan.max_queue, max_batch=plan.max_batch, max_sessions=plan.max_sessions,
                    checkpoint_interval=plan.checkpoint_interval, speculative_tokens=plan.speculative,
                    speculative_max_batch=plan.speculative_max_batch,
                    kv_cache_mb=mb, kv_block_tokens=BT)
    if plan.disk:
        from serve.kvstore.store import KVStore

        engine.kv_store = KVStore(os.path.join(workdir, "kv"), 64, model, ctx=engine.ctx, every=24, min_tokens=8,
                                  registry=engine.metrics.registry)
    return engine


class Alone:
    """The requests of a run served alone: a roomy engine (a pool for every slot, one batch
    slot, plain eager decoding, no checkpoints, no disk), one request at a time, its sessions
    cleared after each (nothing reused from one to the next), and a new engine after a request
    that failed (nothing it left behind can reach the next). Answers are cached by request."""

    def __init__(self, model, tok, ctx: int):
        self.model, self.tok, self.ctx = model, tok, ctx
        self.engine = None
        self.answers: dict = {}

    def _fresh(self):
        from serve.engine.loop import Engine

        if self.engine is not None:
            self.engine.stop()
        self.engine = Engine(self.model, self.tok, ctx=self.ctx, prefill_chunk=32, decode_mode="eager", max_batch=1,
                             max_sessions=1, checkpoint_interval=0)
        self.engine.start(thread=False)

    def answer(self, sent: Sent):
        """(state, generated, finish_reason, error) of `sent`'s request served alone."""
        if sent.key not in self.answers:
            if self.engine is None:
                self._fresh()
            req = fresh_copy(sent.req)
            self.engine.submit_all([req])
            for _ in range(10_000):
                if req.finished():
                    break
                self.engine.iterate()
            for session in self.engine.sessions:
                self.engine.sessions.clear(session)
            self.answers[sent.key] = (req.state, list(req.generated), req.finish_reason, req.error)
            if req.state == "failed":
                self._fresh()
        return self.answers[sent.key]

    def close(self):
        if self.engine is not None:
            self.engine.stop()


def fresh_copy(req):
    """A new request asking what `req` asked."""
    from serve.engine.sequence import GenRequest

    return GenRequest(list(req.prompt_ids), req.max_tokens, req.sampling, stop=list(req.stop), ignore_eos=req.ignore_eos,
                      prompt_logprobs=req.prompt_logprobs, tenant=req.tenant, boundaries=req.boundaries)


# --------------------------------------------------------------------------- invariants
def check_pool(engine, tenants) -> list[str]:
    """The pool's invariants after an iteration (see the module docstring); the problems found."""
    from ds4_torch.paged import chain_digest

    kv, pool = engine.replica.kv, engine.runner.pool
    out = []
    holders = Counter(b for t in kv.all_tables for b in t.blocks)
    for b in range(pool.num_blocks):
        if pool.refcount(b) != holders[b]:
            out.append(f"block {b}: reference count {pool.refcount(b)}, held by {holders[b]} tables")
    free, cached = set(pool.free_blocks()), set(pool.cached_blocks())
    held = {b for b in range(pool.num_blocks) if pool.refcount(b) > 0}
    if free & cached or free & held or cached & held or free | cached | held != set(range(pool.num_blocks)):
        out.append(f"free {sorted(free)}, cached {sorted(cached)}, held {sorted(held)} are not a partition")
    for b, d in pool._digest_of.items():
        if pool._block_of.get(d) != b:
            out.append(f"block {b}: its digest maps to block {pool._block_of.get(d)}")
    if len(pool._block_of) != len(pool._digest_of) or any(pool.digest(b) is None for b in cached) or \
            any(pool.digest(b) is not None for b in free):
        out.append("registered blocks and the free and cached lists disagree")
    # who owns each table: batch slot i -> its decoding request; resident slot s -> its session
    owners = {}
    for req in engine.running:
        owners[req.decode_slot] = (req.tenant, list(req.held))
    for s in engine.sessions:
        owners[engine.replica.batch_slots + s.slot] = (s.tenant, None if s.request is not None else list(s.tokens))
    bt = pool.block_tokens
    tenant_of: dict[int, set] = {}
    for i, t in enumerate(kv.all_tables):
        if not t.blocks:
            continue
        owner = owners.get(i)
        if owner is None:
            out.append(f"table {i} holds blocks {t.blocks} but no request or session owns it")
            continue
        tenant, tokens = owner
        if t.digests and t.tenant != (None if tenant is None else str(tenant)):  # (a restored table registers nothing)
            out.append(f"table {i} registers blocks as tenant {t.tenant!r}'s, its owner is {tenant!r}")
        if tokens is not None and t.tokens != tokens and not (None in t.tokens and len(t.tokens) == len(tokens)):
            out.append(f"table {i} holds {len(t.tokens)} tokens, its owner {len(tokens)} (or others)")
        if int(kv.positions[i]) != t.num_tokens and not kv.is_invalid(i):
            out.append(f"sequence {i} is at {int(kv.positions[i])}, its table holds {t.num_tokens} tokens")
        parent = None
        for k, d in enumerate(t.digests):
            want = chain_digest(parent, t.tenant, t.tokens[k * bt:(k + 1) * bt])
            if d != want:
                out.append(f"table {i}: digest {k} is not its tokens' under its tenant")
            if pool.digest(t.blocks[k]) not in (None, d):
                out.append(f"table {i}: block {t.blocks[k]} is registered under another chain's digest")
            parent = d
        for b in t.blocks:
            tenant_of.setdefault(b, set()).add(t.tenant)
    for b, ts in tenant_of.items():
        if len(ts) > 1:
            out.append(f"block {b} is held by tables of tenants {sorted(map(str, ts))}")
    for rate, slots in kv._slots.items():
        per_block, scratch = bt // rate, kv._scratch_row(rate)
        for i, t in enumerate(kv.all_tables):
            want = torch.tensor([t.blocks[w // per_block] * per_block + w % per_block if w // per_block < len(t.blocks)
                                 else scratch + 1 for w in range(slots.shape[1] - 1)] + [scratch])
            if not torch.equal(slots[i].cpu(), want):
                out.append(f"sequence {i}: its slot map (rate {rate}) is not its table's")
    for layer in kv.layers:
        for state in layer.states:
            for rows in state.row_parts().values():
                if rows[-1].float().abs().sum() != 0:
                    out.append("the zero row was written")
    return out


def check_released(engine) -> list[str]:
    """Nothing open or held once every request ended (then the sessions are cleared)."""
    out = []
    if engine.running or engine.prefilling is not None or len(engine.scheduler) or engine.scheduler.loading:
        out.append("requests are still in flight or queued")
    kv = engine.replica.kv
    for i in range(engine.replica.batch_slots):
        if kv.table(i).blocks:
            out.append(f"batch slot {i} still holds blocks {kv.table(i).blocks}")
    if any(p is not None for p in engine.replica.sampler.params):
        out.append("a sampler slot is still taken")
    if any(s.request is not None for s in engine.sessions):
        out.append("a session is still taken by a request")
    if set(engine.replica.checkpoints) != set(engine.sessions._held):
        out.append("the replica holds checkpoints no session has")
    for s in engine.sessions:
        engine.sessions.clear(s)
    pool = engine.runner.pool
    if pool.num_used or engine.replica.checkpoints:
        out.append(f"{pool.num_used} blocks and {len(engine.replica.checkpoints)} checkpoints still held with no session")
    return out


def idle_room(engine) -> int:
    """The blocks a step could have: the pool's free and cached ones and those only idle sessions
    hold (what evicting them frees)."""
    kv, pool = engine.replica.kv, engine.runner.pool
    busy = set(range(engine.replica.batch_slots)) | {engine.replica.batch_slots + s.slot for s in engine.sessions
                                                    if s.request is not None}
    kept = {b for i in busy for b in kv.table(i).blocks}
    idle = {b for s in engine.sessions if s.request is None for b in kv.table(engine.replica.batch_slots + s.slot).blocks}
    return pool.num_available + len(idle - kept)


# --------------------------------------------------------------------------- the run
class Run:
    def __init__(self, seed: int, model, tok, workdir: str):
        from ds4_torch.faults import reset_fault_counts

        self.plan = Plan.of(seed)
        self.rng = random.Random(seed)
        self.model = simulated_model(model)
        self.tok = tok
        self.report = Report(seed, self.plan)
        self.engine = build_engine(self.model, tok, self.plan, workdir)
        self.sent: list[Sent] = []
        self.families = {t: [self.rng.randint(5, 1000) for _ in range(self.rng.randint(8, 40))] for t in self.plan.tenants}
        reset_fault_counts()
        real = self.engine.recovery.failed

        def failed(reqs, error, stage):  # which requests an injected fault hit (a real one is a problem)
            from ds4_torch.faults import InjectedDeviceError

            injected = isinstance(error, (InjectedDeviceError, torch.OutOfMemoryError)) and "injected" in str(error)
            if not injected:
                self.problem(f"a {stage} step raised {type(error).__name__}: {error}")
            self.check_failed_forward(reqs)
            self.report.counts["faults"] += 1
            for s in self.sent:
                if s.req in reqs:
                    s.faults += 1
            real(reqs, error, stage)

        # (the engine's parts hold the method they were given)
        self.engine.recovery.failed = self.engine.decoding.failed = self.engine.admission.failed = failed
        bug = self.engine.recovery.recover_from_bug

        def recover_from_bug():
            self.problem("the engine's loop raised outside a step (see the log)")
            bug()

        self.engine.recovery.recover_from_bug = recover_from_bug
        preempt = self.engine.in_flight.preempt

        def preempted(req):  # only when even a plain step does not fit; and never twice for nothing
            engine = self.engine
            rows = len(engine.running)
            if idle_room(engine) >= engine.runner.batch.blocks_needed(1, rows):
                self.problem(f"a request was preempted though the pool held a plain step of {rows} rows")
            s = next(s for s in self.sent if s.req is req)
            s.preempted.append(len(req.generated))
            if len(s.preempted) >= 2 and s.preempted[-1] - s.preempted[-2] < 2:
                self.problem(f"request {req.id} was preempted again having sent {s.preempted[-1] - s.preempted[-2]} "
                             f"token(s) since it resumed (preempted at {s.preempted} tokens)")
            preempt(req)

        self.engine.in_flight.preempt = preempted
        self.written: set[bytes] = set()  # digests of full blocks of tokens the engine computed
        extend = self.engine.sessions.extend

        def extended(session, tokens, logits):  # (a session may leave before the iteration ends)
            extend(session, tokens, logits)
            self.note_written(session.tenant, session.tokens)

        self.engine.sessions.extend = extended
        self.max_prompt = min(self.engine.ctx - 2, 64)

    def problem(self, text: str) -> None:
        self.report.problems.append(f"iteration {self.report.counts['iterations']}: {text}")

    # ---------------------------------------------------------------- the workload
    def new_request(self):
        from ds4_torch.sampling import SamplingParams
        from serve.engine.sequence import GenRequest

        rng, tenant = self.rng, self.rng.choice(self.plan.tenants)
        done = [s for s in self.sent if s.req.state == "done" and s.req.tenant == tenant]
        kind = rng.choices(["fresh", "next", "regenerate", "edit", "poison"], [5, 3, 2, 2, 1])[0]
        if kind in ("next", "regenerate", "edit") and not done:
            kind = "fresh"
        if kind == "next":
            prev = rng.choice(done).req
            prompt = prev.prompt_ids + prev.generated + [rng.randint(5, 1000) for _ in range(rng.randint(1, 8))]
        elif kind == "regenerate":
            pool = [s for s in self.sent if s.req.state == "done"]  # (another tenant's too)
            prompt = list(rng.choice(pool).req.prompt_ids)
        elif kind == "edit":
            prev = rng.choice(done).req.prompt_ids
            prompt = prev[:rng.randint(1, len(prev))] + [rng.randint(5, 1000) for _ in range(rng.randint(1, 10))]
        else:
            family = self.families[tenant]
            prompt = family[:rng.randint(0, len(family))] + [rng.randint(5, 1000) for _ in range(rng.randint(1, 24))]
            if kind == "poison":
                prompt.insert(rng.randint(0, len(prompt)), POISON)
        prompt = prompt[:rng.randint(self.max_prompt // 2, self.max_prompt)]  # (past the context: refused)
        n = rng.choices([1, 2, 3], [8, 2, 1])[0]
        seeded = rng.random() < 0.25
        base = dict(max_tokens=rng.randint(16, 40) if rng.random() < 0.25 else rng.randint(1, 10),
                    ignore_eos=rng.random() < 0.8,
                    stop=[rng.choice(STOPS)] if rng.random() < 0.2 else [],
                    prompt_logprobs=2 if rng.random() < 0.05 else None)
        reqs = []
        for c in range(n):
            seed = rng.randint(0, 2**31) if seeded else None
            sampling = SamplingParams(temperature=0.8, top_k=20, seed=seed) if seeded else SamplingParams(temperature=0)
            reqs.append(GenRequest(list(prompt), base["max_tokens"], sampling, stop=list(base["stop"]),
                                   ignore_eos=base["ignore_eos"], prompt_logprobs=base["prompt_logprobs"],
                                   tenant=tenant))
        return reqs

    def key(self, req) -> tuple:
        s = req.sampling
        return (tuple(req.prompt_ids), req.max_tokens, s.temperature, s.seed, tuple(req.stop), req.ignore_eos,
                req.prompt_logprobs, req.tenant)

    def submit(self, reqs, expect_refusal: bool = False) -> None:
        from serve.engine.scheduler import EngineStopped, QueueFull
        from serve.errors import APIError

        c = self.report.counts
        try:
            self.engine.submit_all(reqs)
        except (QueueFull, ValueError, APIError) as e:
            c["refused"] += len(reqs)
            full = isinstance(e, QueueFull) and len(self.engine.scheduler) + len(reqs) > self.plan.max_queue
            if not expect_refusal and not full:
                self.problem(f"a request was refused: {type(e).__name__}: {e}")
            return
        except EngineStopped as e:
            self.problem(f"the engine refused a submit: {e}")
            return
        if expect_refusal:
            self.problem("a request the engine must refuse was queued")
        c["requests"] += len(reqs)
        for req in reqs:
            sent = Sent(req, self.key(req), self.report.counts["iterations"])
            if self.rng.random() < 0.12:
                sent.cancel_at = sent.at + self.rng.randint(0, 12)
            self.sent.append(sent)

    def bad_request(self):
        from ds4_torch.sampling import SamplingParams
        from serve.engine.sequence import GenRequest

        if self.rng.random() < 0.5:
            return [GenRequest([5, 6, 7], -1, SamplingParams(temperature=0))]
        return [GenRequest([7] * (self.engine.ctx + 1), 4, SamplingParams(temperature=0))]

    def events(self, i: int) -> None:
        rng = self.rng
        if i < self.plan.iterations:
            r = rng.random()
            if r < 0.35:
                self.submit(self.new_request())
            elif r < 0.37:
                self.submit(self.bad_request(), expect_refusal=True)
        for s in self.sent:
            if s.cancel_at == i and not s.req.finished():
                s.cancelled_while = ("decoding" if s.req in self.engine.running else
                                     "prefilling" if s.req is self.engine.prefilling else "queued")
                self.engine.cancel(s.req)

    # ---------------------------------------------------------------- one run
    def check_failed_forward(self, reqs) -> None:
        """Right after a step with `reqs` failed: no block its forward filled stays registered (the
        blocks of a table past the tokens its owner holds as computed)."""
        engine = self.engine
        kv, pool, bt = engine.replica.kv, engine.runner.pool, engine.runner.pool.block_tokens
        for req in reqs:
            if req.decode_slot is not None:
                table, confirmed = kv.table(req.decode_slot), len(req.held)
            elif req.session is not None:
                table, confirmed = kv.table(engine.replica.batch_slots + req.session.slot), len(req.session.tokens)
            else:
                continue
            for k in range(confirmed // bt, len(table.digests)):
                if pool.digest(table.blocks[k]) == table.digests[k]:
                    self.problem(f"a failed forward of {req.id} left block {table.blocks[k]} registered (its tokens "
                                 f"{k * bt} to {(k + 1) * bt}, past the {confirmed} computed)")

    def note_written(self, tenant, tokens) -> None:
        from ds4_torch.paged import chain_digest

        bt, parent = self.engine.runner.pool.block_tokens, None
        for k in range(len(tokens) // bt):
            parent = chain_digest(parent, None if tenant is None else str(tenant), tokens[k * bt:(k + 1) * bt])
            self.written.add(parent)

    def check_registered(self) -> list[str]:
        """Every block registered in the pool holds tokens a forward that succeeded computed: the
        full blocks of what the sessions were extended by (prefill chunks, what a request fed) and
        what the decoding requests fed, so far."""
        engine = self.engine
        for r in engine.running:
            self.note_written(r.tenant, r.held)
        pool = engine.runner.pool
        return [f"block {b} is registered but no forward that succeeded wrote its tokens"
                for b, d in pool._digest_of.items() if d not in self.written]

    def wait_for_disk(self) -> None:
        """Disk reads and writes run on threads of their own: waited for, so the run is the seed's."""
        import concurrent.futures

        concurrent.futures.wait(list(self.engine.scheduler.loading.values()))
        self.engine.flush_snapshots()

    def run(self) -> Report:
        from ds4_torch.faults import ENV

        c, engine = self.report.counts, self.engine
        old = os.environ.get(ENV)
        os.environ[ENV] = self.plan.faults
        try:
            engine.start(thread=False)
            i = 0
            while i < self.plan.iterations or any(not s.req.finished() for s in self.sent):
                if i > self.plan.iterations + 3000:
                    self.problem("requests never ended: " + ", ".join(
                        f"{s.req.id} ({s.req.state})" for s in self.sent if not s.req.finished()))
                    break
                self.events(i)
                engine.iterate()
                self.wait_for_disk()
                i += 1
                c["iterations"] = i
                found = check_pool(engine, self.plan.tenants) + self.check_registered()
                if found:
                    self.report.problems += [f"iteration {i}: {p}" for p in found]
                    break
            if not self.report.problems:
                self.report.problems += [f"at the end: {p}" for p in check_released(engine)]
        finally:
            if old is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = old
        m = engine.metrics
        c["preemptions"] = int(m.value("ds4_preemptions_total"))
        c["evictions"] = int(m.value("ds4_session_evictions_total"))
        c["reclaimed"] = engine.runner.pool.evictions
        if engine.kv_store is not None:
            c["disk_saves"] = int(m.value("ds4_kv_disk_saves_total"))
            c["disk_restores"] = int(m.value("ds4_kv_disk_hits_total"))
        engine.stop()
        if not self.report.problems:
            self.check_answers()
        return self.report

    def check_answers(self) -> None:
        c = self.report.counts
        alone = Alone(self.model, self.tok, self.engine.ctx)
        try:
            for s in self.sent:
                req = s.req
                c[req.state] += 1
                state, generated, finish, _ = alone.answer(s)
                what = f"request {req.id} (sent at iteration {s.at}, {len(req.prompt_ids)} prompt tokens)"
                if req.state == "done":
                    if state != "done":
                        self.report.problems.append(f"{what} was answered; alone it {state}")
                    elif (req.generated, req.finish_reason) != (generated, finish):
                        self.report.problems.append(f"{what}: {req.generated} ({req.finish_reason}), alone "
                                                    f"{generated} ({finish})")
                elif req.state == "failed":
                    own = s.poisoned and state == "failed"
                    if not own and s.faults < 2:
                        self.report.problems.append(f"{what} failed ({req.error}) after {s.faults} injected "
                                                    f"fault(s) in its steps; alone it {state}")
                elif req.state == "cancelled":
                    if s.cancel_at is None:
                        self.report.problems.append(f"{what} was cancelled; the workload did not cancel it")
                    elif state == "done" and req.generated != generated[:len(req.generated)]:
                        self.report.problems.append(f"{what} sent {req.generated} before its cancel, alone "
                                                    f"{generated}")
                else:
                    self.report.problems.append(f"{what} never ended ({req.state})")
        finally:
            alone.close()


def simulate(seed: int, model=None, tok=None) -> Report:
    """One seeded run (see the module docstring): its report (problems empty when all held)."""
    from ds4_torch.default_model import build_default_model, default_tokenizer

    model = build_default_model() if model is None else model
    tok = default_tokenizer() if tok is None else tok
    workdir = tempfile.mkdtemp(prefix="ds4-sim-")
    try:
        return Run(seed, model, tok, workdir).run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str]) -> int:
    import logging

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("ds4").setLevel(logging.CRITICAL)  # (a poisoned request logs its failure: expected)
    bad = 0
    for seed in map(int, argv):
        t0 = time.perf_counter()
        report = simulate(seed)
        print(report.line(), f"({time.perf_counter() - t0:.1f} s)", dataclasses.asdict(report.plan))
        for p in report.problems:
            print("  ", p)
        bad += bool(report.problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
