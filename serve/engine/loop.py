"""The engine: one worker thread, continuous batching over resident sessions. `Engine` is the loop
over its parts (api -> client -> core -> engine -> parts), handing data between them; each part
owns its job:

- `serve.engine.scheduler.Scheduler`: who runs next (the queue; disk reads aside; the choices of one
  request admitted together);
- `serve.engine.sessions.Sessions`: resident slots, the prefix index, checkpoints, LRU, the KV pool's
  room (idle sessions leave) and the disk store;
- `serve.engine.runner.Runner`: the only part touching tensors: prefill chunks, decode steps, cache
  copies (through `serve.engine.replica`, on every rank under tensor parallelism) and the batched sampler;
- `serve.engine.output.Output`: token ids to text, stop strings and events, on a thread of its own;
- the loop's own parts, handed the ones above: `serve.engine.inflight.InFlight` (the requests decoding
  in the batch and the one prefilling, their slots, preemption when the pool is short),
  `serve.engine.admission.Admission` (admission and prefill), `serve.engine.decoding.Decoding` (the decode
  steps, plain and speculative, and what each token does) and `serve.engine.recovery.Recovery` (failed
  steps, bugs, a broken tensor-parallel group: retries, 503s, `degraded`).

They share only `serve.engine.sequence` (a `GenRequest` and the records handed to the output part) and
never import each other. Each iteration of the loop (`step`):

1. reap: end the requests whose client left or whose reply reached a stop string;
2. one batched decode step for every decoding request (`Decoding.step`);
3. at most one prefill chunk (`Admission.step`: admitting the next request when a batch slot is
   free), so a long prompt delays the running streams by at most one chunk per token;
4. hand the iteration's tokens and ends to the output part, at once.

A decode step reads and writes only the batch cache: a resident idle session is never touched by
a step it is not part of. Nothing raised in the worker escapes it (serve.engine.recovery). While idle
under tensor parallelism (`peers`, a serve.core.tp.Lead: this is rank 0) the worker sends a heartbeat
every `peers.heartbeat_s`. Results go back to the asyncio side through `GenRequest.emit`
(thread-safe, set by the app), called by the output part in order (serve.engine.sequence lists the
events). At shutdown every request is answered and, with a store, every grown conversation is
saved (waiting up to `SHUTDOWN_SAVE_S` for the writer; any not saved are logged).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from typing import Protocol

import torch

from ds4_torch.paged import DEFAULT_BLOCK_TOKENS, pool_blocks
from ds4_torch.sampling import stop_token_ids
from ds4_torch.speculative import check_draft_tokens

from .admission import Admission
from .decoding import Decoding
from .inflight import InFlight
from serve.metrics import Metrics
from .output import Output
from serve.errors import APIError
from .recovery import Recovery
from .runner import Runner
from .scheduler import EngineStopped, QueueFull, Scheduler  # noqa: F401 - imported from here by the API
from .sequence import End, GenRequest, TokenOut  # noqa: F401 - the engine's request types, imported from here by the API
from .speculation import SpeculationPolicy
from .sessions import DEFAULT_CHECKPOINT_INTERVAL, DEFAULT_CHECKPOINT_MEMORY_MB, Sessions, SnapshotWriter

log = logging.getLogger("ds4.serve")

DEFAULT_MAX_BATCH = 8
DEFAULT_MIN_SESSIONS = 16
STOP_WAIT_S = 0.05  # speculating, the longest the engine waits for the output part to match stop strings
SHUTDOWN_SAVE_S = 30.0  # a clean shutdown waits this long for the writer to save every conversation
# The engine thread lets go of the GIL around every torch op; a thread that took it meanwhile (the
# event loop writing tokens, the output thread) keeps it for up to Python's switch interval (5 ms
# by default) before the step goes on. A shorter one bounds that stall (measured: ITL at 16
# streams through HTTP ~7% lower with 1 ms, `bench serve`).
GIL_SWITCH_INTERVAL_S = 0.001


def cache_slots(max_batch: int, max_sessions: int | None) -> tuple[int, int]:
    """(resident sessions, batch slots) an engine allocates a cache slot at `ctx` for: the
    sessions default to max(max_batch, DEFAULT_MIN_SESSIONS); graph mode pads a step to a
    power-of-two bucket with scratch rows, so the batch gets room for the largest."""
    sessions = max(max_batch, DEFAULT_MIN_SESSIONS) if max_sessions is None else max_sessions
    return sessions, 1 << (max_batch - 1).bit_length()


def kv_pool_blocks(model, ctx: int, slots: int, kv_cache_mb: float | None, block_tokens: int,
                   kv_rows: str = "full") -> int:
    """Blocks of the engine's KV pool: `kv_cache_mb` of them, or (None) as many as static caches
    of every slot at `ctx` would hold (what a notebook's or a test's engine expects)."""
    if kv_cache_mb is None:
        return slots * -(-ctx // block_tokens)
    blocks = pool_blocks(model.config, model.dtype, kv_cache_mb * 2**20, block_tokens, kv_rows)
    if blocks < 2:
        raise ValueError(f"kv_cache_mb {kv_cache_mb} holds {blocks} KV block(s) of {block_tokens} tokens; at least "
                         f"2 are needed")
    return blocks


class KVStore(Protocol):
    """What the engine calls on a disk KV cache (`serve.kvstore.store.KVStore` implements it). A store's
    exception never fails a request (it is logged), except in the first step after a restore,
    which counts as the restore's."""

    every: int

    def restore(self, cache, prompt_ids: list[int], tenant=None) -> tuple[int, torch.Tensor | None] | None:
        """Load the longest state of `prompt_ids` stored for `tenant` (a request's: never another's)
        into sequence 0 of `cache` (a batch-1 view of a clean slot); return (tokens restored,
        logits of the next token: None when fewer than the prompt's), or None. Optional:
        `stored_prefix(prompt_ids, tenant=)`, that count, asked first; `restored_checkpoints`,
        {position: checkpoint} that came with it; `load(prompt_ids, tenant=)` and `apply(cache,
        loaded)`, the same split in two (read and checked on a reader thread, then copied in
        here), used when the store has them, with `first_choice(prompt_ids, tenant=)` and
        `share(loaded, prompt_ids, tenant=)` to read a snapshot once for every request waiting for it."""

    def prepare(self, cache, token_ids: list[int], last_logits: torch.Tensor, why: str, tenant=None):
        """Read sequence 0 of `cache` (holding `token_ids`, `tenant`'s) out for a snapshot; None if not worth one."""

    def write(self, pending) -> bool:
        """Write what `prepare` returned (called on the writer thread)."""

    # Also: last_restored (name), restore_ok(name), restore_failed(error, name),
    # checkpoint_due(n_tokens, saved_at), close().


class EngineClient(Protocol):
    """Everything the API layer (serve.http.app, serve.http.chat) does with an engine. `Engine` is one, in
    this process (tests and the library use it); `serve.core.client.CoreClient` is another, talking to
    an engine core in a process of its own (serve.core.process: what `ds4-torch serve` runs)."""

    metrics: Metrics          # the registry the app's own metrics go to
    retry_after_s: int
    warm: bool                # the first model call was paid (BackgroundServer waits for it)
    alive: bool

    def start(self) -> None: ...
    def stop(self) -> None: ...     # drain: every request answered, conversations saved
    def submit_all(self, reqs: list[GenRequest], continuation: bool = False) -> None:
        """Queue together or not at all: QueueFull, EngineStopped, or ValueError naming a field."""
    def cancel(self, req: GenRequest) -> None: ...
    def health(self) -> str | None: ...          # None when usable, else why not
    def queue_depth(self) -> int: ...
    def structured_outputs(self): ...            # compiles the `GenRequest.grammar`s it takes
    def describe(self) -> str: ...               # for the start-up log line
    def kv_event_info(self) -> dict: ...         # this run's id, the KV block size, where KV events go
    def metrics_text(self) -> bytes: ...         # the Prometheus exposition, the engine's metrics included
    def cache_report(self, request_id: str) -> dict | None: ...  # what a recent request reused (serve.engine.reuse)


def _part_attribute(part: str, name: str, doc: str) -> property:
    """An engine attribute that is one of its part's (read and written there)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


class Engine:
    def __init__(self, model, tokenizer, *, ctx: int = 4096, prefill_chunk: int = 256, decode_mode: str = "auto",
                 max_queue: int = 64, max_batch: int = DEFAULT_MAX_BATCH, max_sessions: int | None = None,
                 metrics: Metrics | None = None, kv_store: KVStore | None = None, eos_ids=None, peers=None,
                 checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
                 checkpoint_memory_mb: float = DEFAULT_CHECKPOINT_MEMORY_MB, speculative_tokens: int = 0,
                 speculative_max_batch: int | None = None, speculative_policy: str = "always",
                 kv_cache_mb: float | None = None, kv_block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 kv_rows: str = "full", kv_events: str | None = None, kv_events_replay: str | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        check_draft_tokens(model, speculative_tokens)
        max_sessions, batch_slots = cache_slots(max_batch, max_sessions)
        if max_sessions < max_batch:
            raise ValueError(f"max_sessions ({max_sessions}) must be >= max_batch ({max_batch}): every decoding "
                             "request holds a session")
        self.model = model
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.prefill_chunk = prefill_chunk
        self.decode_mode = decode_mode
        self.max_batch = max_batch
        self.max_sessions = max_sessions
        self.metrics = metrics or Metrics()
        self.device = model.device
        eos = stop_token_ids(model.config, tokenizer, eos_ids)
        # Tensor parallel (serve.core.tp.Lead): the other ranks, sent every replica call before it runs here.
        self.peers = peers
        self.speculative_tokens = speculative_tokens
        speculation = SpeculationPolicy(speculative_policy, speculative_max_batch)
        kv_blocks = kv_pool_blocks(model, ctx, max_sessions + batch_slots, kv_cache_mb, kv_block_tokens, kv_rows)
        # --ctx is a cap per request: a sequence holds at most every block but one (the copy a
        # session's partly filled last block takes when it joins the batch).
        self.ctx = min(ctx, (kv_blocks - 1) * kv_block_tokens)
        if self.ctx < ctx:
            log.warning("engine: the KV pool (%d blocks of %d tokens) holds at most %d tokens of one request: "
                        "--ctx %d lowered to %d", kv_blocks, kv_block_tokens, self.ctx, ctx, self.ctx)
        self.runner = Runner(model, ctx=self.ctx, sessions=max_sessions, batch_slots=batch_slots,
                             decode_mode=decode_mode, peers=peers, speculative_tokens=speculative_tokens,
                             kv_blocks=kv_blocks, kv_block_tokens=kv_block_tokens, kv_rows=kv_rows)
        pool = self.runner.pool
        self.metrics.kv_blocks_total.set(pool.num_blocks)
        self.metrics.kv_block_tokens.set(pool.block_tokens)
        self.metrics.kv_block_bytes.set(self.replica.kv.block_nbytes)
        # This run's name for routers (GET /get_server_info); they key this replica's KV events by it.
        self.instance_id = uuid.uuid4().hex
        # `kv_events`: publish the pool's stored and removed blocks there, in vLLM's format (UserError:
        # the address cannot be bound).
        self.kv_events = None
        if kv_events is not None:
            from .kv_events import KVEventPublisher

            self.kv_events = KVEventPublisher(kv_events, kv_events_replay, block_tokens=pool.block_tokens)
            pool.listener = self.kv_events
        self.sessions = Sessions(self.replica, self.runner.run, self.metrics, max_sessions,
                                 interval=checkpoint_interval, memory_bytes=int(checkpoint_memory_mb * 2**20),
                                 kv_store=kv_store, peers=peers)
        self.scheduler = Scheduler(max_queue=max_queue, max_batch=max_batch, metrics=self.metrics,
                                   wants_disk=self.sessions.wants_disk, load=self.sessions.load,
                                   read_key=self.sessions.read_key, share=self.sessions.share,
                                   abandoned=lambda req: self._abort(req, "queued"))
        self.output = Output(tokenizer, self.metrics, wake=self.scheduler.wake)
        self._handed: list = []     # this iteration's records for the output part, handed over at its end
        # The loop's own parts (they are handed the parts above, and the engine's ends of a request).
        self.in_flight = InFlight(self.runner, self.sessions, self.scheduler, self.metrics, max_batch=max_batch)
        self.recovery = Recovery(self.runner, self.sessions, self.scheduler, self.in_flight, self.metrics,
                                 peers=peers, answer=self._answer)
        self.decoding = Decoding(self.runner, self.sessions, self.in_flight, self.metrics, ctx=self.ctx, eos_ids=eos,
                                 draft_tokens=speculative_tokens, speculation=speculation, end=self._end,
                                 failed=self.recovery.failed, hand=self._hand)
        self.admission = Admission(self.scheduler, self.sessions, self.runner, self.in_flight, self.metrics,
                                   prefill_chunk=prefill_chunk, start_decoding=self.decoding.start,
                                   failed=self.recovery.failed, hand=self._hand)

        self._thread: threading.Thread | None = None
        self.served = 0
        self.host_cpu_s = 0.0       # engine-thread CPU time outside the model and the sampler (bench serve)
        self._iterating = False     # the engine thread is inside an iteration (see idle)
        # Iterations that only decoded (no prefill chunk beside the step): their count and seconds,
        # the engine's own step to set against the model's (bench serve).
        self.decode_only_steps = 0
        self.decode_only_s = 0.0
        # torch's intra-op thread count is per thread: the worker inherits the creator's setting.
        self.num_threads = torch.get_num_threads()
        self.warm = False
        self._structured = None
        self._structured_lock = threading.Lock()
        self._stop_tokens: dict[str, int | None] = {}

    @classmethod
    def from_config(cls, model, tokenizer, config, metrics: Metrics | None = None, kv_store: KVStore | None = None,
                    peers=None) -> "Engine":
        """The engine a `serve.http.app.ServerConfig` describes."""
        return cls(model, tokenizer, ctx=config.ctx, prefill_chunk=config.prefill_chunk,
                   decode_mode=config.decode_mode, max_queue=config.max_queue, max_batch=config.max_batch,
                   max_sessions=config.max_sessions, metrics=metrics, kv_store=kv_store, peers=peers,
                   checkpoint_interval=config.checkpoint_interval, checkpoint_memory_mb=config.checkpoint_memory_mb,
                   speculative_tokens=config.speculative_tokens, speculative_max_batch=config.speculative_max_batch,
                   speculative_policy=config.speculative_policy, kv_cache_mb=config.kv_cache_mb,
                   kv_block_tokens=config.kv_block_tokens, kv_rows=config.kv_rows, kv_events=config.kv_events,
                   kv_events_replay=config.kv_events_replay)

    def describe(self) -> str:
        """What the start-up log line says about the engine: decode mode, batch, sessions, cache."""
        spec = f", speculating {self.speculative_tokens} MTP draft token(s) per step" if self.speculative_tokens else ""
        pool, kv = self.runner.pool, self.replica.kv
        per_token = kv.block_nbytes / pool.block_tokens
        return (f"ctx {self.ctx} per request, prefill chunk {self.prefill_chunk}, decode mode {self.decoder.mode}{spec}, "
                f"max batch {self.max_batch}, {self.max_sessions} resident sessions, max queue {self.max_queue}; KV "
                f"pool {pool.num_blocks * kv.block_nbytes / 2**20:.1f} MiB: {pool.num_blocks} blocks of "
                f"{pool.block_tokens} tokens ({kv.block_nbytes:,} bytes each, {per_token:,.1f} bytes per token), "
                f"{pool.num_blocks * pool.block_tokens:,} tokens in all, rows {kv.kv_rows.name}; per slot (window ring, open windows, block "
                f"table) {(self.cache_bytes - pool.num_blocks * kv.block_nbytes) / kv.batch_size / 2**20:.2f} MiB "
                f"x {self.resident.batch_size} resident + {self.batch.batch_size} batch slots")

    def metrics_text(self) -> bytes:
        """The Prometheus exposition of the engine's metrics (the app's registry: one process)."""
        return self.metrics.render()

    def cache_report(self, request_id: str) -> dict | None:
        """What a recent request (of the last `serve.engine.reuse.REPORTS`) reused and why not more;
        None for an id it does not know (any thread)."""
        return self.sessions.reports.report(request_id)

    def timing(self) -> dict:
        """Counters `bench serve` takes differences of: CPU seconds of the engine thread outside the
        model and sampler (`host_cpu_s`) and of the output part, sequences x decode steps, decode
        iterations and the seconds of their parts, speculative verify steps and their tokens, and
        the iterations that only decoded with their seconds."""
        m = self.metrics
        return dict(host_cpu_s=self.host_cpu_s, output_cpu_s=self.output.cpu_s, decode_rows=self.decode_rows,
                    steps=m.value("ds4_step_seconds_count", part="model"),
                    **{f"{p}_s": m.value("ds4_step_seconds_sum", part=p) for p in ("model", "sampling", "host")},
                    verify_steps=m.value("ds4_spec_verify_steps_total"),
                    emitted_tokens=m.value("ds4_spec_emitted_tokens_total"),
                    decode_only_steps=self.decode_only_steps, decode_only_s=self.decode_only_s)

    # The runner's replica, caches and decoder, read by the app's log line and by tests.
    replica = property(lambda self: self.runner.replica)
    resident = property(lambda self: self.runner.resident)
    batch = property(lambda self: self.runner.batch)
    decoder = property(lambda self: self.runner.decoder)

    # What the loop's parts own, by the engine's names (the app, the bench, tests and their hooks).
    running = _part_attribute("in_flight", "running", "the decoding requests: running[i] is on batch slot i")
    prefilling = _part_attribute("in_flight", "prefilling", "the request whose prompt is being prefilled")
    degraded = _part_attribute("recovery", "degraded", "why the engine is unhealthy (a request failed twice), or None")
    retry_after_s = _part_attribute("recovery", "retry_after_s", "the Retry-After of a 503")
    eos_ids = _part_attribute("decoding", "eos_ids", "the token ids that end a reply")
    speculation = _part_attribute("decoding", "speculation", "which decode steps speculate (serve.engine.speculation)")
    spec_totals = _part_attribute("decoding", "spec_totals", "verify steps (per sequence), tokens they emitted")
    decode_rows = _part_attribute("decoding", "decode_rows", "sequences x decode steps")
    token_delay = _part_attribute("decoding", "token_delay", "test hook: seconds slept after each decode step")
    prefill_chunks_run = _part_attribute("admission", "chunks_run", "prefill chunks run")
    chunk_delay = _part_attribute("admission", "chunk_delay", "test hook: seconds slept after each prefill chunk")

    @property
    def max_queue(self) -> int:
        return self.scheduler.max_queue

    @max_queue.setter
    def max_queue(self, n: int) -> None:
        self.scheduler.max_queue = n

    # The disk store and its writer live with the sessions (serve.engine.sessions); attached after start by serve.cli.
    @property
    def kv_store(self) -> KVStore | None:
        return self.sessions.kv_store

    @kv_store.setter
    def kv_store(self, store: KVStore | None) -> None:
        self.sessions.kv_store = store

    @property
    def _writer(self) -> SnapshotWriter | None:
        return self.sessions.writer

    @property
    def cache_bytes(self) -> int:
        """Bytes of the KV cache: the pool's blocks and every slot's own state (resident and batch)."""
        return self.replica.kv.nbytes

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
        if len(req.prompt_ids) >= self.ctx:  # (the API checks its --ctx first; the pool may hold fewer)
            raise APIError(400, f"This model's maximum context length is {self.ctx} tokens (what the KV pool holds "
                                f"for one request). However, your prompt is {len(req.prompt_ids)} tokens, which "
                                f"leaves no room for a completion", param="messages", code="context_length_exceeded")
        k = req.prompt_logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"prompt_logprobs must be an integer >= 0, got {k!r}")
        if req.stop and not req.stop_tokens:
            req.stop_tokens = frozenset(t for t in map(self._stop_token, req.stop) if t is not None)
        if req.grammar is not None and req.constraint is None:
            if req.grammar.outputs.vocab_size != self.model.config.vocab_size:
                raise ValueError("grammar: compiled for another vocabulary")
            req.constraint = req.grammar.constraint()  # here, so a failure is the caller's ValueError
        if req.after_trigger is not None and req.after_trigger.outputs.vocab_size != self.model.config.vocab_size:
            raise ValueError("grammar: compiled for another vocabulary")

    def _stop_token(self, stop: str) -> int | None:
        """The token whose text is exactly `stop`, if one is (e.g. `</think>`): the engine ends a
        request at it right away, not a step or two later when the output part finds the string,
        so the session holds exactly what the reply fed (the next turn extends it)."""
        with self._structured_lock:
            if stop not in self._stop_tokens:
                ids = self.tokenizer.encode(stop, add_special_tokens=False) if stop else []
                self._stop_tokens[stop] = ids[0] if len(ids) == 1 and self.tokenizer.decode(ids) == stop else None
                if len(self._stop_tokens) > 4096:  # a cache, not a leak: clients send arbitrary stops
                    self._stop_tokens.pop(next(iter(self._stop_tokens)))
            return self._stop_tokens[stop]

    # ------------------------------------------------------------------ control (any thread)
    def start(self) -> None:
        if self._thread is None:
            sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
            self.output.start()
            self._thread = threading.Thread(target=self._loop, name="ds4-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = SHUTDOWN_SAVE_S + 10) -> None:
        pending = self.scheduler.stop()
        with self.scheduler.cv:
            for req in [*self.running, self.prefilling]:
                if req is not None:
                    req.cancel.set()
            self.scheduler.cv.notify_all()
        for req in pending:
            self._fail(req, self._shutting_down())
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("engine: the worker did not stop within %.0f s", timeout)
        self.output.close()
        if self.kv_events is not None:
            self.kv_events.close()  # (AllBlocksCleared: what this replica held goes with it)

    def kv_event_info(self) -> dict:
        """What a router learns of this engine's KV events (GET /get_server_info, /kv_event_sources):
        this run's id, the pool's block size, and where the events are published (None: not published)."""
        return {"instance_id": self.instance_id, "kv_block_size": self.runner.pool.block_tokens,
                "sources": None if self.kv_events is None else self.kv_events.sources()}

    def _shutting_down(self) -> APIError:
        return self.recovery.unavailable("the server is shutting down", "server_shutting_down")

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
        return len(self.scheduler)

    def idle(self) -> bool:
        """Nothing waiting, prefilling, decoding or still to be output, and no iteration under way
        (one that ends a request takes it off `running` before counting and handing over its end)."""
        return (not self._iterating and not len(self.scheduler) and self.prefilling is None and not self.running
                and not self.output.busy())

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
        self.scheduler.submit(reqs, continuation, self.alive)

    def cancel(self, req: GenRequest) -> None:
        """The client went away: stop the request at its next chunk/step boundary (or drop it
        from the queue now)."""
        req.cancel.set()
        if self.scheduler.remove(req):
            self._abort(req, "queued")

    # ------------------------------------------------------------------ the loop
    def warmup(self) -> None:
        """Run the model once (first calls pay one-off initialisation), then clear the cache."""
        try:
            self.runner.run("warmup")
        except Exception as e:  # noqa: BLE001 - the tensor-parallel group is broken: the loop ends the server
            log.warning("engine: warm-up failed: %s: %s", type(e).__name__, e)
        self.warm = True

    def _loop(self) -> None:
        torch.set_num_threads(self.num_threads)
        if not self.warm:
            self.warmup()
        heartbeat_s = None if self.peers is None else self.peers.heartbeat_s
        while True:
            with self.scheduler.cv:
                idle = self.scheduler.wait_for_work(self.in_flight.busy, heartbeat_s)
                if self.scheduler.stopping:
                    break
            if idle:
                self.peers.heartbeat()
            else:
                c0 = time.thread_time()
                self.runner.clear_timers()
                self._iterating = True
                try:
                    with torch.no_grad():
                        self.step()
                except BaseException:  # noqa: BLE001 - a bug of ours: never let it kill the worker
                    log.exception("engine: unexpected error; resetting the batch")
                    self.recovery.recover_from_bug()
                finally:
                    self._hand_over()
                    self._iterating = False
                self.host_cpu_s += time.thread_time() - c0 - self.runner.cpu_s
            if self.peers is not None and self.peers.broken is not None:
                self.recovery.group_failed()
                break
        with torch.no_grad():
            self._shutdown()
        self._hand_over()
        if self.peers is not None:
            self.peers.stop()

    def step(self) -> None:
        """One iteration: end the requests that are leaving, one decode step of the running ones,
        at most one prefill chunk (admitting a request when a batch slot is free); the records
        for the output part are handed over by the loop, once, after it."""
        t0, chunks = time.perf_counter(), self.admission.chunks_run
        self._reap()
        decoded = bool(self.running)
        if decoded:
            self.decoding.step()
        if self.peers is None or self.peers.broken is None:
            self.admission.step()
        self._update_gauges()
        if decoded:
            self._time_step(time.perf_counter() - t0, prefilled=self.admission.chunks_run != chunks)

    def _time_step(self, took: float, prefilled: bool) -> None:
        """One decode iteration's time: the model (with any prefill chunk beside it), the sampler, the rest."""
        model, sampling = self.runner.model_s, self.runner.sampling_s
        self.metrics.step_time.labels(part="model").observe(model)
        self.metrics.step_time.labels(part="sampling").observe(sampling)
        self.metrics.step_time.labels(part="host").observe(max(0.0, took - model - sampling))
        if not prefilled:
            self.decode_only_steps += 1
            self.decode_only_s += took

    def _update_gauges(self) -> None:
        pool, m = self.runner.pool, self.metrics
        m.kv_blocks_used.set(pool.num_used)
        m.kv_blocks_shared.set(pool.num_shared)
        m.kv_blocks_cached.set(pool.num_cached)
        m.running.set(len(self.running) + (self.prefilling is not None))
        m.resident_sessions.set(sum(1 for s in self.sessions if s.tokens))
        m.cache_tokens.set(sum(len(s.tokens) for s in self.sessions))

    def _reap(self) -> None:
        """End the requests whose client left, and those the output part found a stop string in
        (or failed to detokenize): done (or failed), their session keeping what was fed (when
        speculating, up to the stop: `Decoding.trim_at_stops`)."""
        last_step = self.decoding.last_step
        if last_step and any(r.stop for r in last_step):
            # Speculating, a stop string among the last step's tokens can still be given back
            # (not after the next step): let the output part see them first (stop strings only).
            self.output.flush(STOP_WAIT_S)
        # One look at the flags (the output part sets them meanwhile): trimmed and ended alike.
        leaving = [r for r in self.running if r.cancel.is_set() or r.stop_found.is_set()]
        if last_step:
            self.decoding.trim_at_stops([r for r in leaving if not r.cancel.is_set()])
        for req in sorted(leaving, key=lambda r: -r.decode_slot):
            if req.cancel.is_set():
                self._end(req, "cancelled", stage="decode")
            else:
                self._end(req, "failed" if req.failure is not None else "done")
        req = self.prefilling
        if req is not None and req.cancel.is_set():
            self._end(req, "cancelled", stage="prefill")

    # ------------------------------------------------------------------ a request's end
    # The end of a request is handed to the output part, after its tokens: the client's fields are
    # final and its end event is emitted there (serve.engine.output). `req.ended` says it was handed.
    def _end(self, req: GenRequest, outcome: str, stage: str = "decode", reason: str | None = None) -> None:
        """`req` leaves the batch, its session keeping what it computed, and is answered (`_answer`)."""
        self.in_flight.release(req)
        self._answer(req, outcome, stage=stage, reason=reason)

    def _answer(self, req: GenRequest, outcome: str, stage: str = "decode", reason: str | None = None,
                error: APIError | None = None) -> None:
        """`outcome`: "done" (its finish reason from its tokens, else `reason`), "failed" (with
        `error`, else `req.failure`) or "cancelled" (while in `stage`)."""
        if outcome == "done":
            self._finish(req, reason)
        elif outcome == "failed":
            self._fail(req, error if error is not None else req.failure)
        else:
            self._abort(req, stage)

    def _finish(self, req: GenRequest, reason: str | None = None) -> None:
        if req.ended:
            return
        req.ended = True
        self.served += 1
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        self.metrics.cached_prompt_tokens.inc(req.cached_tokens)
        self.recovery.succeeded()
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

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self) -> None:
        for req in sorted(self.running, key=lambda r: -r.decode_slot):
            self._end(req, "cancelled")
        if self.prefilling is not None:
            self._end(self.prefilling, "cancelled", stage="prefill")
        # Put back by a failure (serve.engine.recovery) after stop() took the queue, or waiting for a disk read:
        # answer them too.
        for req in self.scheduler.take_all():
            self._fail(req, self._shutting_down())
        self.scheduler.close()
        if self.kv_store is None:
            return
        # Clean shutdown: keep the conversations on disk, waiting for the writer (a bounded time),
        # and name in the log any that could not be saved.
        deadline = time.monotonic() + SHUTDOWN_SAVE_S
        unsaved = []
        for session in self.sessions:
            if session.tokens and session.saved_at < len(session.tokens):
                left = deadline - time.monotonic()  # checked first: `prepare` waits for the store's write
                if left <= 0 or not self.sessions.snapshot(session, self.resident.slot(session.slot),
                                                           session.tokens, session.last_logits, "shutdown", wait=left):
                    unsaved.append(len(session.tokens))
        if self._writer is not None:
            unsaved += self._writer.close(deadline - time.monotonic())
        if unsaved:
            log.warning("engine: shutdown: %d conversation(s) not saved to disk in %.0f s (tokens: %s)", len(unsaved),
                        SHUTDOWN_SAVE_S, ", ".join(map(str, unsaved)))
        self.sessions.kv("close")
