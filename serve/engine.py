"""The engine: one worker thread, continuous batching over resident sessions.

Two caches, each allocated once at start:

- **resident** (`max_sessions` slots): one conversation per slot, kept between requests. Which
  session a request takes, what it reuses (a session's end, or a checkpoint at or below where it
  diverges: a branch into another slot or a rewind in place), checkpoints, eviction and the disk
  store are `serve.sessions`'; the engine schedules. Prompts are prefilled in place, in the
  session's slot, in chunks that end where a checkpoint is due.
- **batch** (`max_batch` slots, rounded up to a power of two): the sequences decoding together.
  Once a prompt is prefilled, its session's state is copied into the next batch slot; when the
  request ends, it is copied back to its resident slot (the conversation stays resident) and the
  last batch slot moves into the hole. Decoding slots are always the first `n`; the rest are
  scratch rows a graph-mode step may pad with. Copies cost what a sequence holds (its written
  rows), and happen when a request starts or ends, never inside a step.

Each iteration of the worker runs one batched decode step for every decoding request, then at
most one prefill chunk (`prefill_chunk` tokens) of the request being prefilled, so a long prompt
delays the running streams by at most one chunk per token. A decode step reads and writes only
the batch cache: a resident idle session is never touched by a step it is not part of.

Sampling is one `BatchSampler` call per step for the whole batch (grammar masks, penalties,
bias, bans, filters, logprobs): each request's settings are written into its sampler slot once,
when it takes its batch slot, and move with it. Seeded draws are Gumbel-max over noise hashed from
(seed, token index, token id): a request's tokens do not depend on what else is in the batch. The
step's token ids are the one thing read back to the host. Text is not made here: the tokens (and
the ends of requests) are handed, once per iteration, to the output part (serve.output, its own
thread), which detokenizes, matches stop strings and emits the events; a stop string it finds
ends the request at the engine's next iteration (the session keeps what was fed). A request's
client that leaves is noticed at the next step or chunk: its slot is freed and its prefix stays
resident.

A failure in a step (a device error, an OOM, anything raised by the model or injected with
`DS4_TORCH_FAULT`) resets the batch (captured graphs dropped, the batch cache cleared, CUDA
cache emptied) and retries every request of that step once, resuming after the tokens already
sent (they are prefilled again). A second failure answers 503 to that request and marks the
engine degraded until a request succeeds. What raises while serving one request outside a step
(sampling, penalties, grammar, detokenizing, stop matching) fails that request alone (a 500 naming
the error) and frees its session; the batch goes on. Nothing raised in the worker ever escapes
it. If the first step after a disk restore fails (a fault injected with
`DS4_TORCH_FAULT=restore:N` is raised right before it), the snapshot is quarantined and that
request starts over from a clean prefill without spending its retry.

Disk snapshots (with a store): after a prompt's prefill (once its first token is out), every
`store.every` generated tokens, when an idle session is evicted, and at shutdown (every grown
conversation: the shutdown waits up to `SHUTDOWN_SAVE_S` for the writer, and logs any it could
not save). The state is read out of the cache between steps (a host copy of what the sequence
holds); encoding and writing run on a background writer thread, never between two decode steps.
A request that will take its state from disk has the snapshot read and checked on a reader thread
(`store.load`) while it waits aside and the others go on; this thread only copies it in
(`store.apply`).

Checkpoints (`serve.sessions`): a prefill chunk ends where one is due (a message start, a client
hint, every `checkpoint_interval` tokens, the prompt's end) and it is taken right after the chunk;
in decode, one is taken between steps on the request's batch slot (a device copy, no host sync)
and joins its session when the request leaves the batch (dropped if its step fails).

Every model or cache operation goes through the engine's `Replica` (serve.replica), by name and
with plain arguments. Under tensor parallelism (`peers`, a serve.tp.Lead: this is rank 0) each one
is first sent to the other ranks, which run the same operations on their replicas in the same
order; sampling, sessions and the disk store stay here. While idle the worker sends a heartbeat
every `peers.heartbeat_s`. A rank that dies or stops answering breaks the group: every request
is answered 503 and the engine stops (`peers.failed` then ends the server).

Results go back to the asyncio side through `GenRequest.emit` (thread-safe, set by the app),
called by the output part in order (serve.sequence lists the events).

What clients ask beyond plain sampling:

- **Prompt logprobs** (`GenRequest.prompt_logprobs` = k): computed from the full logits of the
  request's own prefill chunks (so chunked and cancellable like any prefill). Cached tokens have
  no logits, so such a request reuses no prefix (no resident session, no disk snapshot): it
  prefills its whole prompt into a fresh session. Once they were sent, a retry reuses as usual.
- **Several choices for one prompt** (`n`, `best_of`: the app submits one request per choice,
  back to back, seeds from `SamplingParams.for_choice`): when a request's prompt is in its
  session, the requests queued right behind it with the same sequence are admitted in the same
  iteration, each forking that session: the prompt is prefilled once, whatever the choices'
  lengths.
- **Structured outputs** (`GenRequest.grammar`, from `ds4_torch.structured`): the request's
  constraint masks each sample and closes the value before the budget ends; the request ends
  ("stop") when nothing can follow.
- `max_tokens` 0: the prompt is prefilled (for its logprobs) and nothing is sampled ("length").
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import Protocol

import torch

from ds4_torch.faults import fault_point
from ds4_torch.sampling import BatchSampler, stop_token_ids

from .metrics import Metrics
from .output import End, Output, PromptLogprobs, TextState as _TextState, Token  # noqa: F401 - _TextState: old name
from .protocol import APIError
from .replica import MODEL_OPERATIONS, Replica
from .sequence import GenRequest, TokenOut  # noqa: F401 - the engine's request types, imported from here by the API
from .sessions import (DEFAULT_CHECKPOINT_INTERVAL, DEFAULT_CHECKPOINT_MEMORY_MB, Session, Sessions,
                       SnapshotWriter as _SnapshotWriter)

log = logging.getLogger("ds4.serve")

DEFAULT_MAX_BATCH = 8
DEFAULT_MIN_SESSIONS = 16
SHUTDOWN_SAVE_S = 30.0  # a clean shutdown waits this long for the writer to save every conversation


class QueueFull(Exception):
    pass


class EngineStopped(Exception):
    pass


class KVStore(Protocol):
    """What the engine calls on a disk KV cache (`serve.kvstore.KVStore` implements it). A store's
    exception never fails a request (it is logged), except in the first step after a restore,
    which counts as the restore's."""

    every: int

    def restore(self, cache, prompt_ids: list[int]) -> tuple[int, torch.Tensor | None] | None:
        """Load the longest stored state of `prompt_ids` into sequence 0 of `cache` (a batch-1
        view of a clean slot); return (tokens restored, logits of the next token: None when fewer
        than the prompt's), or None. Optional: `stored_prefix(prompt_ids)`, that count, asked first;
        `restored_checkpoints`, {position: checkpoint} that came with it; `load(prompt_ids)` and
        `apply(cache, loaded)`, the same split in two (read and checked on a reader thread, then
        copied in here), used when the store has them."""

    def prepare(self, cache, token_ids: list[int], last_logits: torch.Tensor, why: str):
        """Read sequence 0 of `cache` (holding `token_ids`) out for a snapshot; None if not worth one."""

    def write(self, pending) -> bool:
        """Write what `prepare` returned (called on the writer thread)."""

    # Also: last_restored (name), restore_ok(name), restore_failed(error, name),
    # checkpoint_due(n_tokens, saved_at), close().


class _StepFailed(Exception):
    """A prefill chunk or decode step failed; `requests` were in it."""


class Engine:
    def __init__(self, model, tokenizer, *, ctx: int = 4096, prefill_chunk: int = 256, decode_mode: str = "auto",
                 max_queue: int = 64, max_batch: int = DEFAULT_MAX_BATCH, max_sessions: int | None = None,
                 metrics: Metrics | None = None, kv_store: KVStore | None = None, eos_ids=None, peers=None,
                 checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
                 checkpoint_memory_mb: float = DEFAULT_CHECKPOINT_MEMORY_MB):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        max_sessions = max(max_batch, DEFAULT_MIN_SESSIONS) if max_sessions is None else max_sessions
        if max_sessions < max_batch:
            raise ValueError(f"max_sessions ({max_sessions}) must be >= max_batch ({max_batch}): every decoding "
                             "request holds a session")
        self.model = model
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.prefill_chunk = prefill_chunk
        self.decode_mode = decode_mode
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.max_sessions = max_sessions
        self.metrics = metrics or Metrics()
        self.device = model.device
        self.eos_ids = stop_token_ids(model.config, tokenizer, eos_ids)

        # Graph mode pads a step to a power-of-two bucket with scratch rows: room for the largest.
        batch_slots = 1 << (max_batch - 1).bit_length()
        self.replica = Replica(model, ctx=ctx, sessions=max_sessions, batch_slots=batch_slots,
                               decode_mode=decode_mode)
        # One sampler call per step for the whole batch: sampler slot i is batch slot i (a request's
        # settings are written once, when it takes its slot, and move with it).
        self.vocab_size = model.config.vocab_size
        self.sampler = BatchSampler(batch_slots, self.vocab_size, self.device)
        # Token ids to text, stop strings and events, on a thread of its own (serve.output).
        self.output = Output(tokenizer, self.metrics, wake=self._wake)
        self._handed: list = []     # this iteration's records for the output part, handed over at its end
        self.host_cpu_s = 0.0       # engine-thread CPU time outside the model and the sampler (bench serve)
        self.decode_rows = 0        # sequences x decode steps
        # Tensor parallel (serve.tp.Lead): the other ranks, sent every replica call before it runs here.
        self.peers = peers
        if peers is not None:
            peers.open(self.replica.shape())
        self.sessions = Sessions(self.replica, self._run, self.metrics, max_sessions, interval=checkpoint_interval,
                                 memory_bytes=int(checkpoint_memory_mb * 2**20), kv_store=kv_store, peers=peers)
        self.running: list[GenRequest] = []      # decoding; running[i].decode_slot == i
        self.prefilling: GenRequest | None = None

        self.degraded: str | None = None        # reason, while the last request failed for good
        self.chunk_delay = 0.0                  # test hook: seconds slept after each prefill chunk
        self.token_delay = 0.0                  # test hook: seconds slept after each decode step
        self.retry_after_s = 1

        self._queue: collections.deque[GenRequest] = collections.deque()
        # Requests whose disk state is being read and checked on the reader thread (never on this
        # one: a slow disk must not stall a step); they wait aside, then are admitted first.
        self._loading: dict[GenRequest, concurrent.futures.Future] = {}
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._model_cpu = 0.0       # this iteration's CPU time in the model and the sampler
        self._step_model_s = 0.0    # this iteration's wall time in the model (decode and prefill)
        self._step_sampling_s = 0.0  # ... in the sampler
        self.served = 0
        # torch's intra-op thread count is per thread: the worker inherits the creator's setting.
        self.num_threads = torch.get_num_threads()
        self.warm = False
        self._structured = None
        self._structured_lock = threading.Lock()

    # The replica's caches and decoder, read by the app's log line and by tests.
    resident = property(lambda self: self.replica.resident)
    batch = property(lambda self: self.replica.batch)
    decoder = property(lambda self: self.replica.decoder)

    # The disk store and its writer live with the sessions (serve.sessions); attached after start by serve.cli.
    @property
    def kv_store(self) -> KVStore | None:
        return self.sessions.kv_store

    @kv_store.setter
    def kv_store(self, store: KVStore | None) -> None:
        self.sessions.kv_store = store

    @property
    def _writer(self) -> _SnapshotWriter | None:
        return self.sessions.writer

    def _run(self, operation: str, *args):
        """Run one replica operation: on every rank under tensor parallelism (sent first, and
        acknowledged by every rank after: see serve.tp), else here."""
        if self.peers is None:
            return getattr(self.replica, operation)(*args)
        step = self.peers.send(operation, args, model=operation in MODEL_OPERATIONS)
        try:
            result = getattr(self.replica, operation)(*args)
        except BaseException:
            self.peers.acknowledge(step, ok=False)  # a fault on every rank alike: recovered as usual
            raise
        self.peers.acknowledge(step, ok=True)
        return result

    @property
    def cache_bytes(self) -> int:
        """Bytes of both caches: `max_sessions` resident slots and the batch slots, at `ctx`."""
        return self.resident.nbytes + self.batch.nbytes

    def structured_outputs(self):
        """The `ds4_torch.structured.StructuredOutputs` for this model's tokenizer (built on first use):
        `engine.structured_outputs().json_schema(schema)` is a `GenRequest.grammar`."""
        with self._structured_lock:
            if self._structured is None:
                from ds4_torch.structured import StructuredOutputs

                self._structured = StructuredOutputs(self.tokenizer, self.model.config.vocab_size)
            return self._structured

    def check(self, req: GenRequest) -> None:
        """What the request asks that no setting checks alone; ValueError naming the field."""
        if isinstance(req.max_tokens, bool) or not isinstance(req.max_tokens, int) or req.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {req.max_tokens!r}")
        req.sampling.check(vocab_size=self.model.config.vocab_size, max_tokens=req.max_tokens)
        k = req.prompt_logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"prompt_logprobs must be an integer >= 0, got {k!r}")
        if req.grammar is not None and req.constraint is None:
            if req.grammar.outputs.vocab_size != self.model.config.vocab_size:
                raise ValueError("grammar: compiled for another vocabulary")
            req.constraint = req.grammar.constraint()  # here, so a failure is the caller's ValueError

    # ------------------------------------------------------------------ control (any thread)
    def start(self) -> None:
        if self._thread is None:
            self.output.start()
            self._thread = threading.Thread(target=self._loop, name="ds4-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = SHUTDOWN_SAVE_S + 10) -> None:
        with self._cv:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            self.metrics.queue_depth.set(0)
            for req in [*self.running, self.prefilling]:
                if req is not None:
                    req.cancel.set()
            self._cv.notify_all()
        for req in pending:
            self._fail(req, self._shutting_down())
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("engine: the worker did not stop within %.0f s", timeout)
        self.output.close()

    def _shutting_down(self) -> APIError:
        return APIError(503, "the server is shutting down", code="server_shutting_down",
                        headers={"Retry-After": str(self.retry_after_s)})

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> str | None:
        """None when usable, else the reason."""
        if not self.alive:
            return "the engine thread is not running"
        if not self.warm:
            return "warming up"
        return self.degraded

    def queue_depth(self) -> int:
        return len(self._queue)

    def idle(self) -> bool:
        """Nothing waiting, prefilling, decoding or still to be output."""
        return not self._queue and self.prefilling is None and not self.running and not self.output.busy()

    def flush_snapshots(self) -> None:
        """Wait until every disk snapshot handed to the background writer is written."""
        if self._writer is not None:
            self._writer.flush()

    def resident_tokens(self) -> list[list[int]]:
        """The token ids each non-empty resident session holds (for tests and tools)."""
        return [list(s.tokens) for s in self.sessions if s.tokens]

    def submit(self, req: GenRequest) -> None:
        """Queue `req`; ValueError (naming the field) for settings the model cannot serve."""
        self.submit_all([req])

    def submit_all(self, reqs: list[GenRequest], continuation: bool = False) -> None:
        """Queue `reqs` together, back to back, or none of them (the choices of one HTTP request:
        adjacent in the queue, those with the same prompt share its prefill). A `continuation` of
        work already admitted (thinking's second phase) goes to the front and is never refused
        for a full queue: its request was counted when it arrived."""
        for req in reqs:
            self.check(req)
        with self._cv:
            if self._stopping or not self.alive:
                raise EngineStopped("the engine is not running")
            if not continuation and len(self._queue) + len(reqs) > self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            for req in reqs:
                req.state = "queued"
            if continuation:
                self._queue.extendleft(reversed(reqs))
            else:
                self._queue.extend(reqs)
            self.metrics.queue_depth.set(len(self._queue))
            self._cv.notify()

    def cancel(self, req: GenRequest) -> None:
        """The client went away: stop the request at its next chunk/step boundary (or drop it
        from the queue now)."""
        req.cancel.set()
        with self._cv:
            try:
                self._queue.remove(req)
            except ValueError:
                self._cv.notify()  # a running request: the worker notices at its next boundary
                return
            self.metrics.queue_depth.set(len(self._queue))
        self._abort(req, "queued")

    # ------------------------------------------------------------------ worker
    def warmup(self) -> None:
        """Run the model once (first calls pay one-off initialisation), then clear the cache."""
        try:
            self._run("warmup")
        except Exception as e:  # noqa: BLE001 - the tensor-parallel group is broken: the loop ends the server
            log.warning("engine: warm-up failed: %s: %s", type(e).__name__, e)
        self.warm = True

    def _has_work(self) -> bool:
        return bool(self._queue) or self.prefilling is not None or bool(self.running) or \
            any(f.done() for f in self._loading.values())

    def _loop(self) -> None:
        torch.set_num_threads(self.num_threads)
        if not self.warm:
            self.warmup()
        while True:
            with self._cv:
                idle = self._wait_for_work()
                if self._stopping:
                    break
            if idle:
                self.peers.heartbeat()
            else:
                c0 = time.thread_time()
                self._model_cpu = 0.0
                try:
                    with torch.no_grad():
                        self._iteration()
                except BaseException:  # noqa: BLE001 - a bug of ours: never let it kill the worker
                    log.exception("engine: unexpected error; resetting the batch")
                    self._recover_from_bug()
                self._hand_over()
                self.host_cpu_s += time.thread_time() - c0 - self._model_cpu
            if self.peers is not None and self.peers.broken is not None:
                self._group_failed()
                break
        with torch.no_grad():
            self._shutdown()
        self._hand_over()
        if self.peers is not None:
            self.peers.stop()

    def _hand(self, record) -> None:
        """Give `record` to the output part: with the iteration's others when on the engine thread,
        else (a cancel or a shutdown answered from another thread) at once."""
        if threading.current_thread() is self._thread:
            self._handed.append(record)
        else:
            self.output.put([record])

    def _hand_over(self) -> None:
        batch, self._handed = self._handed, []
        self.output.put(batch)

    def _wait_for_work(self) -> bool:
        """Wait (holding `_cv`) for work or a stop. Under tensor parallelism, return True after
        `peers.heartbeat_s` idle seconds: the other ranks wait on rank 0's next message, and a
        heartbeat keeps that wait short (and shows a dead rank at once)."""
        while not self._has_work() and not self._stopping:
            if not self._cv.wait(None if self.peers is None else self.peers.heartbeat_s):
                return True
        return False

    def _iteration(self) -> None:
        t0 = time.perf_counter()
        self._step_model_s = self._step_sampling_s = 0.0
        self._reap_cancelled()
        decoded = bool(self.running)
        if decoded:
            self._decode_step()
        if self.peers is None or self.peers.broken is None:
            self._prefill_step()
        self._update_gauges()
        if decoded:  # one step's time: the model (with any prefill chunk beside it), the sampler, the rest
            wall = time.perf_counter() - t0
            self.metrics.step_time.labels(part="model").observe(self._step_model_s)
            self.metrics.step_time.labels(part="sampling").observe(self._step_sampling_s)
            self.metrics.step_time.labels(part="host").observe(max(0.0, wall - self._step_model_s -
                                                                   self._step_sampling_s))

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.running) + (self.prefilling is not None))
        self.metrics.resident_sessions.set(sum(1 for s in self.sessions if s.tokens))
        self.metrics.cache_tokens.set(sum(len(s.tokens) for s in self.sessions))

    # ------------------------------------------------------------------ sessions
    # Sessions, their checkpoints and the disk store are serve.sessions'; these names stay for the loop.
    def _claim_session(self, req: GenRequest) -> int:
        """Give `req` a session holding a prefix of its sequence; return the tokens it reuses."""
        return self.sessions.claim(req)

    def _free_session(self) -> Session:
        return self.sessions.free_session()

    def _clear(self, session: Session) -> None:
        self.sessions.clear(session)

    def _snapshot(self, session: Session, view, tokens: list[int], logits, why: str,
                  wait: float | None = None) -> bool:
        return self.sessions.snapshot(session, view, tokens, logits, why, wait)

    def _kv(self, method: str, *args, **kwargs):
        return self.sessions.kv(method, *args, **kwargs)

    def _confirm_restored(self, session: Session) -> None:
        self.sessions.confirm_restored(session)

    # ------------------------------------------------------------------ admission and prefill
    def _next_waiting(self) -> GenRequest | None:
        """The next request to start: one whose disk state was read, else the queue's next, except
        that a request wanting a disk read is sent to the reader thread and waits aside."""
        req = self._loaded()
        if req is not None:
            return req
        while True:
            with self._cv:
                req = None
                while self._queue:
                    req = self._queue.popleft()
                    self.metrics.queue_depth.set(len(self._queue))
                    if not req.cancel.is_set():
                        break
                    self._abort(req, "queued")
                    req = None
            if req is None or req.disk is not None or not self.sessions.wants_disk(req):
                return req
            self._read_aside(req)

    def _read_aside(self, req: GenRequest) -> None:
        if self._reader is None:
            self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ds4-kv-reader")
        future = self._reader.submit(self.kv_store.load, req.sequence())
        self._loading[req] = future
        future.add_done_callback(lambda _: self._wake())

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _loaded(self) -> GenRequest | None:
        """A request whose disk read finished (its state in `req.disk`), if any."""
        for req, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[req]
            try:
                req.disk = future.result() or False
            except Exception as e:  # noqa: BLE001 - a store bug: serve without it
                log.warning("engine: kv store read failed: %s: %s", type(e).__name__, e)
                req.disk = False
            if req.cancel.is_set():
                self._abort(req, "queued")
                continue
            return req
        return None

    def _waiting_aside(self) -> list[GenRequest]:
        """The requests waiting for their disk reads, taken out (shutdown, group failure)."""
        reqs = list(self._loading)
        self._loading.clear()
        return reqs

    def _prefill_step(self) -> None:
        req = self.prefilling
        if req is None:
            if len(self.running) >= self.max_batch:
                return
            req = self._next_waiting()
            if req is None:
                return
            seq = req.sequence()
            if not self._admit(req):  # its session held its whole sequence: it is decoding already
                self._admit_same_sequence(seq)
                return
        session = req.session
        seq = req.sequence()
        start = len(session.tokens)
        # A chunk ends where a checkpoint is due: its end state is the checkpoint's.
        piece = seq[start:self.sessions.next_stop(req, start, min(len(seq), start + self.prefill_chunk))]
        try:
            if session.restored is not None:
                fault_point("restore")
            # every: the chunk's full logits, for prompt logprobs
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                logits, every = self._run("prefill", session.slot, piece, req.wants_prompt_logprobs())
            finally:
                self._model_cpu += time.thread_time() - c0
                self._step_model_s += time.perf_counter() - t0
            if every is not None:
                self._collect_prompt_logprobs(req, start, every)
        except BaseException as e:  # noqa: BLE001 - device errors, OOM, injected faults, bugs
            self._failed([req], e, "prefill")
            return
        self._confirm_restored(session)
        self.sessions.extend(session, piece, logits)
        req.prefill_chunks += 1
        req.prefilled_tokens += len(piece)
        boundary = self.sessions.wanted(req, len(session.tokens))
        if boundary is not None:
            self._take_checkpoint(session, "resident", session.slot, len(session.tokens), logits, boundary)
        self.metrics.prefill_chunks.inc()
        if self.chunk_delay:
            time.sleep(self.chunk_delay)
        if len(session.tokens) == len(seq):
            self.prefilling = None
            self._start_decoding(req, logits, prefilled=True)
            self._admit_same_sequence(seq)

    def _admit_same_sequence(self, seq: list[int]) -> None:
        """Admit the requests queued right behind one whose sequence `seq` is now in a session and
        that ask for the same sequence (the choices of an `n` > 1 request): each forks that
        session now, before a decode step can extend it, so the prompt is prefilled once."""
        while self.prefilling is None and len(self.running) < self.max_batch:
            with self._cv:
                if not self._queue or self._queue[0].sequence() != seq:
                    return
                req = self._queue.popleft()
                self.metrics.queue_depth.set(len(self._queue))
            if req.cancel.is_set():
                self._abort(req, "queued")
            else:
                self._admit(req)

    def _collect_prompt_logprobs(self, req: GenRequest, start: int, logits: torch.Tensor) -> None:
        """Prompt logprobs from a chunk's logits [chunk, V] (row j, at position start + j, predicts
        the token at start + j + 1); sent once the whole prompt is in."""
        prompt, k = req.prompt_ids, req.prompt_logprobs
        if start == 0:
            req.plp = [TokenOut(prompt[0], "")]  # nothing predicts the first token
        end = min(start + logits.shape[0], len(prompt) - 1)  # the last prompt position predicted here
        if end > start:
            lp = torch.log_softmax(logits[:end - start].float(), dim=-1)
            targets = torch.tensor(prompt[start + 1:end + 1], dtype=torch.long, device=lp.device)
            chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
            if k:
                vals, idx = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
            for j, token in enumerate(prompt[start + 1:end + 1]):
                req.plp.append(TokenOut(token, "", chosen[j], tops[j] if k else None))
        if len(req.plp) == len(prompt):  # each token's text is the output part's
            req.prompt_logprob_outs, req.plp = req.plp, None
            self._hand(PromptLogprobs(req, req.prompt_logprob_outs))

    def _admit(self, req: GenRequest) -> bool:
        """Start `req`: a session, then either its prefill (True) or, when the session already
        holds its whole sequence, its first token (False)."""
        req.state = "running"
        if req.t_start is None:
            req.t_start = time.perf_counter()
        if req.attempts == 0:
            req.attempts = 1
        try:
            reused = self._claim_session(req)
        except BaseException as e:  # noqa: BLE001 - a copy between slots failed (device error)
            self._failed([req], e, "admit")
            return False
        if req.attempts == 1 and not req.generated:
            req.cached_tokens = reused
        if reused < len(req.sequence()):
            self.prefilling = req
            return True
        self._start_decoding(req, req.session.last_logits, prefilled=False)
        return False

    def _start_decoding(self, req: GenRequest, logits: torch.Tensor, prefilled: bool) -> None:
        """The prompt is in the session: sample the first token, then join the batch (its batch
        slot, and its sampler slot, the next free one)."""
        session = req.session
        if req.cancel.is_set():
            self._end(req, "cancelled", stage="prefill")
            return
        if req.max_tokens <= 0:  # the prompt only (its logprobs): nothing to sample
            self._end(req, "done", reason="length")
            return
        slot = len(self.running)
        try:  # its settings, written once: the tokens it sent already count (a retried request)
            self.sampler.admit(slot, req.sampling, req.prompt_ids, req.generated,
                               () if req.ignore_eos else self.eos_ids)
        except Exception as e:  # noqa: BLE001 - this request's settings or a bug: not the engine's
            self._own_failure(req, e, "starting")
            self.sampler.release(slot)
            self._end(req, "failed")
            return
        finish = self._sample([req], logits.reshape(1, -1), slots=[slot])[0]
        if finish is not None:
            self.sampler.release(slot)
        if finish == "error":
            self._end(req, "failed")
            return
        if prefilled:  # once the first token is out, the prompt is worth a snapshot
            self._snapshot(session, self.resident.slot(session.slot), session.tokens, logits, "prefill")
        if finish is not None:
            self._end(req, "done")
            return
        try:
            self._run("copy", "batch", slot, session.slot, "resident")
        except BaseException as e:  # noqa: BLE001
            self._run("reset", "batch", slot)
            self.sampler.release(slot)
            self._failed([req], e, "admit")
            return
        req.decode_slot, req.held = slot, list(session.tokens)
        self.running.append(req)

    # ------------------------------------------------------------------ decode
    def _decode_step(self) -> None:
        reqs = list(self.running)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            if any(r.session.restored is not None for r in reqs):
                fault_point("restore")
            logits = self._run("decode", [r.pending for r in reqs])
        except BaseException as e:  # noqa: BLE001 - device errors, OOM, injected faults, bugs
            self._model_cpu += time.thread_time() - c0
            self._failed(reqs, e, "decode")
            return
        self._model_cpu += time.thread_time() - c0
        self._step_model_s += time.perf_counter() - t0
        self.metrics.batch_size.observe(len(reqs))
        self.decode_rows += len(reqs)
        for req in reqs:
            self._confirm_restored(req.session)
            req.held.append(req.pending)
        finishes = self._sample(reqs, logits)
        done = []
        for i, req in enumerate(reqs):
            if finishes[i] is not None:
                done.append(req)
                continue
            boundary = self.sessions.wanted(req, len(req.held))
            if boundary is not None:  # between steps, on its batch slot: joins the session when it leaves
                self._take_checkpoint(req.session, "batch", req.decode_slot, len(req.held), logits[i], boundary,
                                      pending=True)
            if self.kv_store is not None and self.kv_store.every > 0 and \
                    self.kv_store.checkpoint_due(len(req.held), req.session.saved_at):
                self._snapshot(req.session, self.batch.slot(req.decode_slot), req.held, req.logits, "periodic")
        for req in sorted(done, key=lambda r: -r.decode_slot):
            self._end(req, "failed" if req.failure is not None else "done")
        if self.token_delay:
            time.sleep(self.token_delay)

    def _own_failure(self, req: GenRequest, error: Exception, doing: str) -> None:
        log.error("engine: %s failed while %s", req.id, doing, exc_info=error)
        req.failure = APIError(500, f"this request failed in the engine while {doing} ({type(error).__name__}: "
                                    f"{error}); other requests were not affected", code="internal_error")

    def _take_checkpoint(self, session: Session, cache: str, slot: int, position: int, logits, boundary: bool,
                         pending: bool = False) -> None:
        """A checkpoint costs a device copy: one that fails (out of memory) is skipped, not the request's."""
        try:
            self.sessions.take(session, cache, slot, position, logits, boundary, pending)
        except Exception as e:  # noqa: BLE001 - the tensor-parallel group breaking is noticed by the loop
            log.warning("engine: checkpoint at %d skipped: %s: %s", position, type(e).__name__, e)

    def _sample(self, reqs: list[GenRequest], logits: torch.Tensor, slots: list[int] | None = None) -> list[str | None]:
        """The next token of every request of `reqs` (row i of `logits` [B, V], sampler slot
        `slots[i]`, or i), from one batched sampler call: grammar masks, penalties, bias, bans,
        filters and logprobs all in it. Each token is recorded in its request and handed to the
        output part. Returns per request None (it goes on), "end" (it is done) or "error" (its own
        failure, `req.failure` set: what raises for one request, or logits that are NaN or inf,
        fails that request alone; the caller ends it and the batch goes on)."""
        B = len(reqs)
        results: list[str | None] = [None] * B
        # Tokens each may still emit, this one included: max_tokens, and the context.
        remaining = [min(r.max_tokens - len(r.generated), self.ctx + 1 - len(r.prompt_ids) - len(r.generated))
                     for r in reqs]
        allowed = None
        for i, req in enumerate(reqs):
            if req.constraint is not None:
                if allowed is None:
                    allowed = torch.ones(B, self.vocab_size, dtype=torch.bool, device=logits.device)
                try:
                    allowed[i] = req.constraint.begin(remaining[i]).to(logits.device)
                except Exception as e:  # noqa: BLE001
                    self._own_failure(req, e, "taking its next token")
                    results[i] = "error"
        want = [r.logprobs for r in reqs if r.logprobs is not None]
        k = max(want) if want else None
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            rows = self._draw(logits, allowed, k, slots, reqs, results)
        finally:
            self._model_cpu += time.thread_time() - c0
            self._step_sampling_s += time.perf_counter() - t0
        taken = [0] * B
        for i, req in enumerate(reqs):
            if results[i] is not None:
                continue
            try:
                results[i] = self._take(req, logits[i], rows[i], remaining[i])
                taken[i] = req.generated[-1]
            except Exception as e:  # noqa: BLE001 - one request's bug or hostile settings: not the batch's
                self._own_failure(req, e, "taking its next token")
                results[i] = "error"
            if results[i] == "error":
                req.pending = None
        try:  # the history the penalties, min_tokens and the noise position see
            self.sampler.append(torch.tensor(taken, dtype=torch.long), slots)
        except Exception as e:  # noqa: BLE001 - a bug: every row's history is now unknown
            for i, req in enumerate(reqs):
                if results[i] is None:
                    self._own_failure(req, e, "recording its token")
                    results[i], req.pending = "error", None
        return results

    def _draw(self, logits, allowed, k, slots, reqs, results) -> list:
        """The batched sampler call: per row (token, failed, logprob, top ids, top logprobs). If the
        call raises, each row is drawn alone (the same tokens: a row depends on nothing else), so
        only the rows that raise fail."""
        try:
            out = self.sampler.sample(logits, allowed, k, slots=slots)
            return self._rows(out, len(reqs))
        except Exception:  # noqa: BLE001 - one row's settings or a bug: find the row
            log.warning("engine: the batched sampler raised; drawing row by row", exc_info=True)
        rows = [None] * len(reqs)
        for i, req in enumerate(reqs):
            if results[i] is not None:
                continue
            try:
                out = self.sampler.sample(logits[i:i + 1], None if allowed is None else allowed[i:i + 1], k,
                                          slots=[slots[i] if slots is not None else i])
                rows[i] = self._rows(out, 1)[0]
            except Exception as e:  # noqa: BLE001
                self._own_failure(req, e, "sampling")
                results[i] = "error"
        return rows

    @staticmethod
    def _rows(out, n: int) -> list:
        # The one read back to the host per step: the tokens (the next step feeds them).
        tokens, failed = out.tokens.tolist(), out.failed.tolist()
        if out.logprob is None:
            return [(tokens[i], failed[i], None, None, None) for i in range(n)]
        lp, ids, tops = out.logprob.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
        return [(tokens[i], failed[i], lp[i], ids[i], tops[i]) for i in range(n)]

    def _take(self, req: GenRequest, logits: torch.Tensor, row, remaining: int) -> str | None:
        """`req` takes its drawn token (or what its grammar forces instead); hands it to the output
        part; returns "end", "error" or None."""
        token, failed, logprob, top_ids, top_lps = row
        if failed:
            req.failure = APIError(500, "this request failed in the engine while sampling: its logits are not "
                                        "finite (NaN or inf) or its settings allow no token; other requests were "
                                        "not affected", code="internal_error")
            log.error("engine: %s: logits not finite or nothing allowed", req.id)
            return "error"
        c = req.constraint
        if c is not None:
            forced = c.finish(token, remaining)
            if forced != token and req.logprobs is not None:
                logprob = float(torch.log_softmax(logits.float(), dim=-1)[forced])
            token = forced
        req.logits = logits
        top = None
        if req.logprobs is not None and req.logprobs > 0:
            top = list(zip(top_ids[:req.logprobs], top_lps[:req.logprobs]))
        req.generated.append(token)
        # A constrained request's EOS ends it even with ignore_eos: its grammar allows nothing after.
        if token in req.sampling.stop_token_ids or (token in self.eos_ids and (not req.ignore_eos or c is not None)):
            end = "eos"
        elif c is not None and c.done:  # the value is whole: nothing can follow
            end = "stop"
        # Feeding this token back needs room for the whole sequence in the context.
        elif len(req.generated) >= req.max_tokens or len(req.prompt_ids) + len(req.generated) > self.ctx:
            end = "length"
        else:
            end = None
        self._hand(Token(req, token, end, logprob if req.logprobs is not None else None, top))
        req.pending = None if end is not None else token
        return None if end is None else "end"

    # ------------------------------------------------------------------ leaving the batch
    def _release(self, req: GenRequest) -> None:
        """`req` stops using its session (and batch slot): what it computed stays resident."""
        session = req.session
        if session is None:
            return
        if req.decode_slot is not None:
            slot, last = req.decode_slot, len(self.running) - 1
            try:
                self._run("copy", "resident", session.slot, slot, "batch")
                self.sessions.extend(session, req.held[len(session.tokens):], req.logits)
                self.sessions.settle_pending(session)
            except BaseException as e:  # noqa: BLE001 - lose this session, not the engine
                log.warning("engine: cannot keep %s's session: %s: %s", req.id, type(e).__name__, e)
                self._clear(session)
            if slot != last:  # keep decoding slots first: the last one fills the hole
                moved = self.running[last]
                self._run("copy", "batch", slot, last, "batch")
                self.sampler.move(slot, last)
                moved.decode_slot = slot
                self.running[slot] = moved
            self.running.pop()
            self.sampler.release(last)
            self._run("reset", "batch", last)
            req.decode_slot = None
        if self.prefilling is req:
            self.prefilling = None
        session.request = None
        session.last_used = time.monotonic()
        req.session = None

    def _end(self, req: GenRequest, outcome: str, stage: str = "decode", reason: str | None = None) -> None:
        """`outcome`: "done" (its finish reason from its tokens, else `reason`), "failed" (with
        `req.failure`) or "cancelled"."""
        self._release(req)
        if outcome == "done":
            self._finish(req, reason)
        elif outcome == "failed":
            self._fail(req, req.failure)
        else:
            self._abort(req, stage)

    def _reap_cancelled(self) -> None:
        """End the requests whose client left, and those the output part found a stop string in
        (or failed to detokenize): done (or failed), their session keeping what was fed."""
        for req in sorted((r for r in self.running if r.cancel.is_set() or r.stop_found.is_set()),
                          key=lambda r: -r.decode_slot):
            if req.cancel.is_set():
                self._end(req, "cancelled", stage="decode")
            else:
                self._end(req, "failed" if req.failure is not None else "done")
        req = self.prefilling
        if req is not None and req.cancel.is_set():
            self._end(req, "cancelled", stage="prefill")

    # ------------------------------------------------------------------ failures
    def _failed(self, reqs: list[GenRequest], error: BaseException, stage: str) -> None:
        """A step with `reqs` in it failed: reset, then retry each request once (or fail it)."""
        self.metrics.device_errors.inc()
        log.warning("engine: %s step with %d request(s) failed: %s: %s", stage, len(reqs), type(error).__name__,
                    error)
        if stage == "decode":
            self._reset_batch(f"{type(error).__name__}: {error}")
        else:  # a prefill chunk or a copy of one session: the batch, decoding beside it, is intact
            self.replica.release_allocator()
            self.metrics.engine_resets.inc()
        # The tensor-parallel group is gone, not the request: _group_failed answers it next.
        group_gone = self.peers is not None and self.peers.broken is not None
        requeue = []
        for req in reqs:
            session = req.session
            blame_snapshot = session is not None and session.restored is not None
            if session is not None:
                if stage != "decode" or blame_snapshot:
                    self._clear(session)  # half-written, or restored from a snapshot now suspect
                self.sessions.drop_pending(session)  # taken on the batch slot, reset
                session.request = None
                req.session = None
            if self.prefilling is req:
                self.prefilling = None
            if req.decode_slot is not None:
                self.sampler.release(req.decode_slot)
            req.decode_slot, req.pending, req.held = None, None, []
            if blame_snapshot:
                log.warning("engine: %s: the first step after a disk restore failed; snapshot quarantined, "
                            "prefilling from scratch", req.id)
                self._kv("restore_failed", error, session.restored)
                req.no_restore = True
            if req.cancel.is_set():
                self._abort(req, stage)
            elif req.stop_found.is_set():  # its reply already ended at a stop string
                if req.failure is not None:
                    self._fail(req, req.failure)
                else:
                    self._finish(req)
            elif not blame_snapshot and not group_gone and req.attempts >= 2:
                self.degraded = f"a request failed twice in a row: {type(error).__name__}: {error}"
                self.metrics.healthy.set(0)
                self._fail(req, APIError(
                    503, f"the engine failed on this request twice ({type(error).__name__}: {error}); it has been "
                         f"reset, retry later", code="engine_error",
                    headers={"Retry-After": str(self.retry_after_s)}))
            else:
                if not blame_snapshot and not group_gone:
                    req.attempts += 1
                requeue.append(req)
        self.running = [r for r in self.running if r not in reqs]
        with self._cv:  # retried first, in their order
            self._queue.extendleft(reversed(requeue))
            self.metrics.queue_depth.set(len(self._queue))

    def _reset_batch(self, reason: str) -> None:
        """Drop the batch's device state: captured graphs, batch cache contents, cached allocations.
        Requests still decoding go back to their sessions' resident state (it was not touched)."""
        failure = self._run("reset_batch")
        if failure is not None:
            self.degraded = failure
            self.metrics.healthy.set(0)
        self.metrics.engine_resets.inc()
        log.info("engine: reset (%s)", reason)

    def _recover_from_bug(self) -> None:
        # A request between the two (taking its first token) is only known by its session.
        reqs = [*self.running, *([self.prefilling] if self.prefilling is not None else []),
                *(s.request for s in self.sessions if s.request is not None)]
        for req in dict.fromkeys(reqs):
            self._release_quietly(req)
            self._fail(req, APIError(500, "internal error in the engine", code="internal_error"))
        self.running, self.prefilling = [], None
        self._reset_batch("unexpected error")

    def _group_failed(self) -> None:
        """A rank of the tensor-parallel group died or stopped answering: nothing can run the model
        any more. Every request is answered 503, the engine stops, and `peers` ends the server."""
        reason = f"the tensor-parallel group failed ({self.peers.broken})"
        log.error("engine: %s; stopping", reason)
        self.degraded = reason
        self.metrics.healthy.set(0)
        with self._cv:
            self._stopping = True
            queued = list(self._queue) + self._waiting_aside()
            self._queue.clear()
            self.metrics.queue_depth.set(0)
        error = APIError(503, f"{reason}; the server is exiting", code="engine_unavailable",
                         headers={"Retry-After": str(self.retry_after_s)})
        for req in [*self.running, *([self.prefilling] if self.prefilling is not None else []), *queued]:
            self._release_quietly(req)  # local cache resets only: the group is gone
            self._fail(req, error)
        self.running, self.prefilling = [], None
        self.peers.failed(reason)

    def _release_quietly(self, req: GenRequest) -> None:
        if req.session is not None:
            self._clear(req.session)
            req.session.request = None
            req.session = None
        req.decode_slot = None

    def _shutdown(self) -> None:
        for req in sorted(self.running, key=lambda r: -r.decode_slot):
            self._end(req, "cancelled")
        if self.prefilling is not None:
            self._end(self.prefilling, "cancelled", stage="prefill")
        with self._cv:  # put back by a failure (_failed) after stop() took the queue: answer them too
            left = list(self._queue) + self._waiting_aside()
            self._queue.clear()
            self.metrics.queue_depth.set(0)
        for req in left:
            self._fail(req, self._shutting_down())
        if self._reader is not None:
            self._reader.shutdown(wait=False)
        if self.kv_store is None:
            return
        # Clean shutdown: keep the conversations on disk, waiting for the writer (a bounded time),
        # and name in the log any that could not be saved.
        deadline = time.monotonic() + SHUTDOWN_SAVE_S
        unsaved = []
        for session in self.sessions:
            if session.tokens and session.saved_at < len(session.tokens):
                left = deadline - time.monotonic()  # checked first: `prepare` waits for the store's write
                if left <= 0 or not self._snapshot(session, self.resident.slot(session.slot), session.tokens,
                                                   session.last_logits, "shutdown", wait=left):
                    unsaved.append(len(session.tokens))
        if self._writer is not None:
            unsaved += self._writer.close(deadline - time.monotonic())
        if unsaved:
            log.warning("engine: shutdown: %d conversation(s) not saved to disk in %.0f s (tokens: %s)", len(unsaved),
                        SHUTDOWN_SAVE_S, ", ".join(map(str, unsaved)))
        self._kv("close")

    # ------------------------------------------------------------------ outcomes
    # The end of a request is handed to the output part, after its tokens: the client's fields are
    # final and its end event is emitted there (serve.output). `req.ended` says it was handed.
    def _finish(self, req: GenRequest, reason: str | None = None) -> None:
        if req.ended:
            return
        req.ended = True
        self.served += 1
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        self.metrics.cached_prompt_tokens.inc(req.cached_tokens)
        if self.degraded is not None:
            log.info("engine: healthy again after a successful request")
        self.degraded = None
        self.metrics.healthy.set(1)
        self._hand(End(req, "done", reason=reason))

    def _abort(self, req: GenRequest, stage: str) -> None:
        if req.ended:
            return
        req.ended = True
        self.metrics.prefill_aborted.inc()
        self.metrics.aborted.labels(stage=stage).inc()
        log.info("engine: %s abandoned by its client while %s", req.id,
                 "queued" if stage == "queued" else f"in {stage}")
        self._hand(End(req, "cancelled", stage=stage))

    def _fail(self, req: GenRequest, error: APIError) -> None:
        if req.ended:
            return
        req.ended = True
        self._hand(End(req, "failed", error=error))
