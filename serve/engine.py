"""The engine: one worker thread, continuous batching over resident sessions; the small loop on
top of the server's parts, handing data between them and handling faults.

The parts, each with one job (they share only `serve.sequence.GenRequest`, and import that and
lower modules, never each other):

- `serve.scheduler.Scheduler`: who runs next (the queue, disk reads aside, the choices of one
  request admitted together);
- `serve.sessions.Sessions`: resident slots, the prefix index, checkpoints, LRU and the disk store;
- `serve.runner.Runner`: the only part touching tensors: prefill chunks, decode steps, cache copies
  (through `serve.replica`, on every rank under tensor parallelism) and the batched sampler;
- `serve.output.Output`: token ids to text, stop strings and events, on a thread of its own.

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

Every model or cache operation goes through the runner to its `Replica` (serve.replica), by name
and with plain arguments. Under tensor parallelism (`peers`, a serve.tp.Lead: this is rank 0) each one
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
  ("stop") when nothing can follow. `GenRequest.after_trigger` starts such a constraint once the
  request takes its trigger token (a tool-call block's opener); speculating, the step's tokens
  after the trigger go back.
- `max_tokens` 0: the prompt is prefilled (for its logprobs) and nothing is sampled ("length").
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Protocol

import torch

from ds4_torch.faults import fault_point
from ds4_torch.sampling import stop_token_ids
from ds4_torch.speculative import check_draft_tokens

from .metrics import Metrics
from .output import End, Output, PromptLogprobs, Started, TextState as _TextState, Token  # noqa: F401 - _TextState: old name
from .protocol import APIError
from .runner import Drawn, Runner
from .scheduler import EngineStopped, QueueFull, Scheduler  # noqa: F401 - imported from here by the API
from .sequence import GenRequest, TokenOut  # noqa: F401 - the engine's request types, imported from here by the API
from .speculation import SpeculationPolicy
from .sessions import (DEFAULT_CHECKPOINT_INTERVAL, DEFAULT_CHECKPOINT_MEMORY_MB, Session, Sessions,
                       SnapshotWriter as _SnapshotWriter)
from ds4_torch.paged import DEFAULT_BLOCK_TOKENS, pool_blocks

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
    """What the engine calls on a disk KV cache (`serve.kvstore.KVStore` implements it). A store's
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
    """Everything the API layer (serve.app, serve.chat) does with an engine. `Engine` is one, in
    this process (tests and the library use it); `serve.client.CoreClient` is another, talking to
    an engine core in a process of its own (serve.core: what `ds4-torch serve` runs)."""

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
    def metrics_text(self) -> bytes: ...         # the Prometheus exposition, the engine's metrics included


class Engine:
    def __init__(self, model, tokenizer, *, ctx: int = 4096, prefill_chunk: int = 256, decode_mode: str = "auto",
                 max_queue: int = 64, max_batch: int = DEFAULT_MAX_BATCH, max_sessions: int | None = None,
                 metrics: Metrics | None = None, kv_store: KVStore | None = None, eos_ids=None, peers=None,
                 checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
                 checkpoint_memory_mb: float = DEFAULT_CHECKPOINT_MEMORY_MB, speculative_tokens: int = 0,
                 speculative_max_batch: int | None = None, speculative_policy: str = "always",
                 kv_cache_mb: float | None = None, kv_block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 kv_rows: str = "full"):
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
        self.eos_ids = stop_token_ids(model.config, tokenizer, eos_ids)
        # Tensor parallel (serve.tp.Lead): the other ranks, sent every replica call before it runs here.
        self.peers = peers

        # Sampler slot i is batch slot i (a request's settings move with it).
        self.speculative_tokens = speculative_tokens
        self.spec_totals = [0, 0]  # verify steps (per sequence), tokens they emitted: the acceptance length
        # Which decode steps speculate (serve.speculation): at most `speculative_max_batch`
        # sequences, and with "auto" the kind measured faster. After plain steps each row's
        # speculation state is stale until it joins again.
        self.speculation = SpeculationPolicy(speculative_policy, speculative_max_batch)
        self._rejoin: set[GenRequest] = set()
        # The last speculative step's tokens per request that goes on: (generated before it,
        # tokens it took, their logits [k, V], held before it), so a stop string the output part
        # finds among them can give the rest back (`_trim_at_stops`).
        self._last_step: dict[GenRequest, tuple[int, int, torch.Tensor, int]] = {}
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
        self.sessions = Sessions(self.replica, self.runner.run, self.metrics, max_sessions,
                                 interval=checkpoint_interval, memory_bytes=int(checkpoint_memory_mb * 2**20),
                                 kv_store=kv_store, peers=peers)
        self.scheduler = Scheduler(max_queue=max_queue, max_batch=max_batch, metrics=self.metrics,
                                   wants_disk=self.sessions.wants_disk, load=self.sessions.load,
                                   read_key=self.sessions.read_key, share=self.sessions.share,
                                   abandoned=lambda req: self._abort(req, "queued"))
        self.output = Output(tokenizer, self.metrics, wake=self.scheduler.wake)
        self._handed: list = []     # this iteration's records for the output part, handed over at its end

        self.running: list[GenRequest] = []      # decoding; running[i].decode_slot == i
        self.prefilling: GenRequest | None = None
        self._pool_short = False  # this iteration's decode step had to preempt: admit no one

        self.degraded: str | None = None        # reason, while the last request failed for good
        self.chunk_delay = 0.0                  # test hook: seconds slept after each prefill chunk
        self.token_delay = 0.0                  # test hook: seconds slept after each decode step
        self.retry_after_s = 1

        self._thread: threading.Thread | None = None
        self.served = 0
        self.host_cpu_s = 0.0       # engine-thread CPU time outside the model and the sampler (bench serve)
        self._iterating = False     # the engine thread is inside an iteration (see idle)
        self.decode_rows = 0        # sequences x decode steps
        self.prefill_chunks_run = 0
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
        """The engine a `serve.app.ServerConfig` describes."""
        return cls(model, tokenizer, ctx=config.ctx, prefill_chunk=config.prefill_chunk,
                   decode_mode=config.decode_mode, max_queue=config.max_queue, max_batch=config.max_batch,
                   max_sessions=config.max_sessions, metrics=metrics, kv_store=kv_store, peers=peers,
                   checkpoint_interval=config.checkpoint_interval, checkpoint_memory_mb=config.checkpoint_memory_mb,
                   speculative_tokens=config.speculative_tokens, speculative_max_batch=config.speculative_max_batch,
                   speculative_policy=config.speculative_policy, kv_cache_mb=config.kv_cache_mb,
                   kv_block_tokens=config.kv_block_tokens, kv_rows=config.kv_rows)

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

    @property
    def max_queue(self) -> int:
        return self.scheduler.max_queue

    @max_queue.setter
    def max_queue(self, n: int) -> None:
        self.scheduler.max_queue = n

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
        return self.runner.run(operation, *args)

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
            self._run("warmup")
        except Exception as e:  # noqa: BLE001 - the tensor-parallel group is broken: the loop ends the server
            log.warning("engine: warm-up failed: %s: %s", type(e).__name__, e)
        self.warm = True

    def _busy(self) -> bool:
        return self.prefilling is not None or bool(self.running)

    def _loop(self) -> None:
        torch.set_num_threads(self.num_threads)
        if not self.warm:
            self.warmup()
        heartbeat_s = None if self.peers is None else self.peers.heartbeat_s
        while True:
            with self.scheduler.cv:
                idle = self.scheduler.wait_for_work(self._busy, heartbeat_s)
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
                        self._iteration()
                except BaseException:  # noqa: BLE001 - a bug of ours: never let it kill the worker
                    log.exception("engine: unexpected error; resetting the batch")
                    self._recover_from_bug()
                finally:
                    self._hand_over()
                    self._iterating = False
                self.host_cpu_s += time.thread_time() - c0 - self.runner.cpu_s
            if self.peers is not None and self.peers.broken is not None:
                self._group_failed()
                break
        with torch.no_grad():
            self._shutdown()
        self._hand_over()
        if self.peers is not None:
            self.peers.stop()

    def _iteration(self) -> None:
        t0, chunks = time.perf_counter(), self.prefill_chunks_run
        self._reap()
        decoded = bool(self.running)
        if decoded:
            self._decode_step()
        if self.peers is None or self.peers.broken is None:
            self._prefill_step()
        self._update_gauges()
        if decoded:  # one step's time: the model (with any prefill chunk beside it), the sampler, the rest
            model, sampling = self.runner.model_s, self.runner.sampling_s
            self.metrics.step_time.labels(part="model").observe(model)
            self.metrics.step_time.labels(part="sampling").observe(sampling)
            took = time.perf_counter() - t0
            self.metrics.step_time.labels(part="host").observe(max(0.0, took - model - sampling))
            if self.prefill_chunks_run == chunks:
                self.decode_only_steps += 1
                self.decode_only_s += took

    def _update_gauges(self) -> None:
        pool, m = self.runner.pool, self.metrics
        m.kv_blocks_used.set(pool.num_used)
        m.kv_blocks_shared.set(pool.num_shared)
        m.kv_blocks_cached.set(pool.num_cached)
        self.metrics.running.set(len(self.running) + (self.prefilling is not None))
        self.metrics.resident_sessions.set(sum(1 for s in self.sessions if s.tokens))
        self.metrics.cache_tokens.set(sum(len(s.tokens) for s in self.sessions))

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

    # ------------------------------------------------------------------ sessions
    def _clear(self, session: Session) -> None:
        self.sessions.clear(session)

    def _snapshot(self, session: Session, view, tokens: list[int], logits, why: str,
                  wait: float | None = None) -> bool:
        return self.sessions.snapshot(session, view, tokens, logits, why, wait)

    def _take_checkpoint(self, session: Session, cache: str, slot: int, position: int, logits, boundary: bool,
                         pending: bool = False) -> None:
        """A checkpoint costs a device copy: one that fails (out of memory) is skipped, not the request's."""
        try:
            self.sessions.take(session, cache, slot, position, logits, boundary, pending)
        except Exception as e:  # noqa: BLE001 - the tensor-parallel group breaking is noticed by the loop
            log.warning("engine: checkpoint at %d skipped: %s: %s", position, type(e).__name__, e)

    # ------------------------------------------------------------------ admission and prefill
    def _prefill_step(self) -> None:
        req = self.prefilling
        if req is None:
            if len(self.running) >= self.max_batch or (self._pool_short and self.running):
                return
            req = self.scheduler.next_waiting()
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
        if not self._make_room(self.resident.table(session.slot).blocks_needed(len(piece)), session):
            return  # the pool is held by decoding requests: this prompt waits (they end, or are preempted)
        try:
            if session.restored is not None:
                fault_point("restore")
            # every: the chunk's full logits, for prompt logprobs
            logits, every = self.runner.prefill(session.slot, piece, req.wants_prompt_logprobs())
            if every is not None:
                self._collect_prompt_logprobs(req, start, every)
        except BaseException as e:  # noqa: BLE001 - device errors, OOM, injected faults, bugs
            self._failed([req], e, "prefill")
            return
        self.sessions.confirm_restored(session)
        self.sessions.extend(session, piece, logits)
        req.prefill_chunks += 1
        req.prefilled_tokens += len(piece)
        boundary = self.sessions.wanted(req, len(session.tokens))
        if boundary is not None:
            self._take_checkpoint(session, "resident", session.slot, len(session.tokens), logits, boundary)
        self.metrics.prefill_chunks.inc()
        self.prefill_chunks_run += 1
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
            req = self.scheduler.next_with_sequence(seq)
            if req is None:
                return
            self._admit(req)

    def _collect_prompt_logprobs(self, req: GenRequest, start: int, logits) -> None:
        """Prompt logprobs from a chunk's logits [chunk, V] (row j, at position start + j, predicts
        the token at start + j + 1); handed to the output part once the whole prompt is in."""
        prompt, k = req.prompt_ids, req.prompt_logprobs
        if start == 0:
            req.plp = [TokenOut(prompt[0], "")]  # nothing predicts the first token
        end = min(start + logits.shape[0], len(prompt) - 1)  # the last prompt position predicted here
        if end > start:
            targets = prompt[start + 1:end + 1]
            chosen, tops = self.runner.prompt_logprobs(logits, targets, k)
            for j, token in enumerate(targets):
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
            reused = self.sessions.claim(req)
        except BaseException as e:  # noqa: BLE001 - a copy between slots failed (device error)
            self._failed([req], e, "admit")
            return False
        if req.attempts == 1 and not req.generated:
            req.cached_tokens = reused
        self._hand(Started(req))
        if reused < len(req.sequence()):
            self.prefilling = req
            return True
        self._start_decoding(req, req.session.last_logits, prefilled=False)
        return False

    def _start_decoding(self, req: GenRequest, logits, prefilled: bool) -> None:
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
        try:  # its settings, written once
            self.runner.admit(slot, req, self.eos_ids)
        except Exception as e:  # noqa: BLE001 - this request's settings or a bug: not the engine's
            self.runner.release(slot)
            self._own_failure(req, e, "starting")
            self._end(req, "failed")
            return
        finish = self._sample([req], logits.reshape(1, -1), slots=[slot])[0]
        if finish is not None:
            self.runner.release(slot)
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
            if self.speculative_tokens:  # its first draft, from where its prefill left the MTP layer
                self.runner.join(slot, req.pending, session.slot)
        except BaseException as e:  # noqa: BLE001
            self._run("reset", "batch", slot)
            self.runner.release(slot)
            self._failed([req], e, "admit")
            return
        req.decode_slot, req.held = slot, list(session.tokens)
        self.running.append(req)

    # ------------------------------------------------------------------ decode
    # ------------------------------------------------------------------ the KV pool
    def _make_room(self, need: int, *keep: Session) -> bool:
        """Have `need` blocks available: the pool's unreferenced cached blocks count already; then
        idle sessions leave (least recently used first; to the disk store when there is one).
        False when even that leaves too few."""
        pool = self.runner.pool
        while pool.num_available < need:
            if not self.sessions.evict_idle(keep):
                return False
        return True

    def _decode_room(self) -> None:
        """Before a decode step: room for every running row's next tokens (1, or 1 + the drafts
        speculating). What idle sessions cannot free is taken from the request prefilling, then
        from the requests that joined the batch last (preempted: set aside and resumed from what
        they had sent, as a retry is); the longest-running keep going."""
        tokens = 1 + self.speculative_tokens
        batch = self.batch
        while self.running:
            need = sum(batch.table(r.decode_slot).blocks_needed(tokens) for r in self.running)
            keep = [r.session for r in self.running]
            if self._make_room(need, *keep):
                return
            victim = self.prefilling if self.prefilling is not None and self.prefilling.session is not None \
                else self.running[-1]
            self._preempt(victim)
            self._pool_short = True  # no request is admitted in this iteration: it would be preempted next

    def _preempt(self, req: GenRequest) -> None:
        """Set `req` aside to free the KV blocks it holds: its session leaves (to disk when a store
        is attached), and it goes back to the front of the queue, to resume after the tokens it
        has sent (prefilled again, or restored), as a retry does, but counted as no attempt."""
        log.info("engine: %s preempted: the KV pool cannot hold the running requests' next tokens", req.id)
        self.metrics.preemptions.inc()
        session = req.session
        self._release(req)  # (its batch slot goes back to its session first)
        if session is not None:
            self.sessions.evict(session)
        req.decode_slot, req.pending, req.held = None, None, []
        self.scheduler.requeue([req])

    def _decode_step(self) -> None:
        self._pool_short = False
        self._decode_room()
        if not self.running:
            return
        self._last_step = {}
        if not self.speculative_tokens:
            self._plain_step()
            return
        rows, model_s = len(self.running), self.runner.model_s
        measuring = self.speculation.policy == "auto"  # "always" needs no timings
        generated = sum(len(r.generated) for r in self.running) if measuring else 0
        speculative = self.speculation.speculate(rows)
        fair = not (speculative and self._rejoin & set(self.running))
        if speculative:
            reqs = list(self.running)
            self._speculative_step()
        else:
            self._rejoin = set(self.running)  # a plain step: their drafts start over when speculation resumes
            reqs = list(self.running)
            self._plain_step()
        if measuring:
            tokens = sum(len(r.generated) for r in reqs) - generated
            self.speculation.record(rows, speculative, tokens, self.runner.model_s - model_s, fair)

    def _plain_step(self) -> None:
        reqs = list(self.running)
        try:
            if any(r.session.restored is not None for r in reqs):
                fault_point("restore")
            logits = self.runner.decode([r.pending for r in reqs])
        except BaseException as e:  # noqa: BLE001 - device errors, OOM, injected faults, bugs
            self._failed(reqs, e, "decode")
            return
        self.metrics.batch_size.observe(len(reqs))
        self.decode_rows += len(reqs)
        for req in reqs:
            self.sessions.confirm_restored(req.session)
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

    def _speculative_step(self) -> None:
        """One speculative step (`--speculative-tokens N`) of every decoding request: each feeds
        its pending token and N drafts in one verify forward and takes the tokens plain decoding
        would have given (1 to N + 1; a constrained request one). Each token goes through `_take`
        as in a plain step; a request that ends inside its tokens gives the rest back to the cache
        (`trim`), so its session holds what plain decoding would have fed."""
        reqs = list(self.running)
        try:
            if any(r.session.restored is not None for r in reqs):
                fault_point("restore")
            for req in reqs:
                if req in self._rejoin:  # after plain steps: its MTP layer skips what they fed
                    self.runner.join(req.decode_slot, req.pending, None)
            self._rejoin.clear()
            results = self.runner.speculate(reqs, [self.runner.limit(r) for r in reqs])
        except BaseException as e:  # noqa: BLE001 - device errors, OOM, injected faults, bugs
            self._failed(reqs, e, "decode")
            return
        self.metrics.batch_size.observe(len(reqs))
        self.decode_rows += len(reqs)
        done, used, taken, slots, counted, counts, going_on = [], [], [], [], [], [], []
        for req, result in zip(reqs, results):
            self.sessions.confirm_restored(req.session)
            before = len(req.held)
            req.held.append(req.pending)  # fed by the verify forward
            if isinstance(result, BaseException):
                self._own_failure(req, result, "sampling")
                req.pending = None
                done.append(req)
                used.append(None)
                continue
            drawn, rows, drafted = result
            generated_before = len(req.generated)
            end = None
            free = req.constraint is None
            for j, d in enumerate(drawn):
                if j:
                    req.held.append(drawn[j - 1].token)  # an accepted draft: fed too
                req.logits = rows[j]
                end = self._take(req, d)
                taken.append(d.token)
                slots.append(req.decode_slot)
                if end is not None:
                    break
                if free and req.constraint is not None:
                    # Its grammar starts after this token: the step's later tokens were not masked
                    # by it, so they go back; its drafts start over (`_rejoin`).
                    self._rejoin.add(req)
                    break
            used.append(j + 1 if j + 1 < len(drawn) else None)
            counted.append(req)
            counts.append((drafted, len(drawn) - 1))
            if end is not None:
                done.append(req)
                continue
            self._last_step[req] = (generated_before, j + 1, rows, before)
            going_on.append((req, before))
        self._count_drafts(counted, counts)
        try:
            if any(u is not None for u in used):
                self.runner.trim(used)
            self.runner.append(taken, slots)
        except BaseException as e:  # noqa: BLE001 - the batch's state is unknown: retry the others
            for req in done:  # ended already: answered, their sessions dropped (their slots are unknown)
                self.runner.release(req.decode_slot)
                self._release_quietly(req)
                self._end(req, "failed" if req.failure is not None else "done")
            self.running = [r for r in self.running if r not in done]
            self._failed([r for r in reqs if r not in done], e, "decode")
            return
        # Checkpoints and snapshots read the slot once the step's tokens past what each request
        # took are given back (a grammar starting after its trigger): the slot then holds
        # exactly `held`, the position they are registered at.
        for req, before in going_on:
            boundary = self.sessions.wanted_between(req, before, len(req.held))
            if boundary is not None:
                self._take_checkpoint(req.session, "batch", req.decode_slot, len(req.held), req.logits, boundary,
                                      pending=True)
            if self.kv_store is not None and self.kv_store.every > 0 and \
                    self.kv_store.checkpoint_due(len(req.held), req.session.saved_at):
                self._snapshot(req.session, self.batch.slot(req.decode_slot), req.held, req.logits, "periodic")
        for req in sorted(done, key=lambda r: -r.decode_slot):
            self._end(req, "failed" if req.failure is not None else "done")
        if self.token_delay:
            time.sleep(self.token_delay)

    def _count_drafts(self, reqs: list[GenRequest], counts: list[tuple[int, int]]) -> None:
        """Each request's drafts proposed and accepted in this step: its own counts and /metrics."""
        for req, (drafted, accepted) in zip(reqs, counts):
            req.draft_tokens += drafted
            req.accepted_drafts += accepted
        drafted, accepted = sum(c[0] for c in counts), sum(c[1] for c in counts)
        self.spec_totals[0] += len(counts)
        self.spec_totals[1] += len(counts) + accepted
        m = self.metrics
        m.spec_steps.inc(len(counts))
        m.spec_drafted.inc(drafted)
        m.spec_accepted.inc(accepted)
        m.spec_emitted.inc(len(counts) + accepted)
        m.spec_acceptance.set(self.spec_totals[1] / self.spec_totals[0])

    def _sample(self, reqs: list[GenRequest], logits, slots: list[int] | None = None) -> list[str | None]:
        """The next token of every request of `reqs` (row i of `logits`, sampler slot `slots[i]`
        or i), from one batched sampler call (serve.runner); each token recorded in its request
        and handed to the output part. Per request: None (it goes on), "end" (it is done) or
        "error" (its own failure, `req.failure` set; the caller ends it, the batch goes on)."""
        drawn = self.runner.sample(reqs, logits, slots)
        results: list[str | None] = []
        taken = []
        for i, (req, d) in enumerate(zip(reqs, drawn)):
            if not isinstance(d, Drawn):
                self._own_failure(req, d, "sampling")
                req.pending = None
                results.append("error")
                taken.append(0)
                continue
            req.logits = logits[i]
            results.append(self._take(req, d))
            taken.append(d.token)
        try:  # the history the penalties, min_tokens and the noise position see
            self.runner.append(taken, slots)
        except Exception as e:  # noqa: BLE001 - a bug: these rows' histories are now unknown
            for i, req in enumerate(reqs):
                if results[i] is None:
                    self._own_failure(req, e, "recording its token")
                    results[i], req.pending = "error", None
        return results

    def _take(self, req: GenRequest, d: Drawn) -> str | None:
        """`req` takes its token; it goes to the output part. "end" when it ends the request."""
        token = d.token
        req.generated.append(token)
        c = req.constraint
        if c is not None and req.after_trigger is not None and c.done:
            # Its block closed: the reply goes on free, to the EOS the model writes (so a valid
            # call leaves the model's own tokens as they were), or to another block.
            req.constraint = c = None
        # A constrained request's EOS ends it even with ignore_eos: its grammar allows nothing after.
        if token in req.sampling.stop_token_ids or (token in self.eos_ids and (not req.ignore_eos or c is not None)):
            end = "eos"
        elif c is not None and c.done or token in req.stop_tokens:  # nothing can follow / its text is a stop
            end = "stop"
        # Feeding this token back needs room for the whole sequence in the context.
        elif len(req.generated) >= req.max_tokens or len(req.prompt_ids) + len(req.generated) > self.ctx:
            end = "length"
        else:
            end = None
        self._hand(Token(req, token, end, d.logprob, d.top))
        req.pending = None if end is not None else token
        if end is None and c is None and req.after_trigger is not None and token == req.after_trigger.trigger:
            self._arm(req)
        return None if end is None else "end"

    @staticmethod
    def _arm(req: GenRequest) -> None:
        """`req` took its trigger token: from its next token on, its output follows the grammar
        (until the grammar is done: `_take`)."""
        try:
            req.constraint = req.after_trigger.grammar.constraint()
        except Exception as e:  # noqa: BLE001 - the text goes on unconstrained, as without one
            log.warning("engine: %s: the grammar after its trigger token failed to start: %s", req.id, e)

    def _own_failure(self, req: GenRequest, error: BaseException, doing: str) -> None:
        log.error("engine: %s failed while %s", req.id, doing, exc_info=error)
        req.failure = APIError(500, f"this request failed in the engine while {doing} ({type(error).__name__}: "
                                    f"{error}); other requests were not affected", code="internal_error")

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
                self.runner.move(slot, last)
                moved.decode_slot = slot
                self.running[slot] = moved
            self.running.pop()
            self.runner.release(last)
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

    def _trim_at_stops(self, stopped: list[GenRequest]) -> None:
        """Speculating, a stop string the output part found among the last step's tokens of a
        request: that step's tokens past the one completing it are given back (`trim`), so its
        session holds what plain decoding, which meets the stop a token at a time, would have
        fed: every token up to the stop's last one (which is the reply's last, not fed)."""
        used, cut = [None] * len(self.running), []
        for req in stopped:
            info = self._last_step.get(req)
            if info is None or req.stop_at is None:
                continue
            generated_before, taken, rows, held_before = info
            k = req.stop_at - generated_before  # the step's tokens up to and including the stop's last
            if 1 <= k < taken:
                used[req.decode_slot] = k
                cut.append((req, k, rows, held_before))
        self._last_step = {}
        if not cut:
            return
        try:
            self.runner.trim(used)
        except BaseException as e:  # noqa: BLE001 - keep what was fed, as after a lagging stop
            log.warning("engine: could not give back the tokens past a stop string: %s: %s", type(e).__name__, e)
            return
        for req, k, rows, held_before in cut:
            del req.held[held_before + k:]
            req.logits = rows[k - 1]

    def _reap(self) -> None:
        """End the requests whose client left, and those the output part found a stop string in
        (or failed to detokenize): done (or failed), their session keeping what was fed (when
        speculating, up to the stop: `_trim_at_stops`)."""
        if self._last_step and any(r.stop for r in self._last_step):
            # Speculating, a stop string among the last step's tokens can still be given back
            # (not after the next step): let the output part see them first (stop strings only).
            self.output.flush(STOP_WAIT_S)
        # One look at the flags (the output part sets them meanwhile): trimmed and ended alike.
        leaving = [r for r in self.running if r.cancel.is_set() or r.stop_found.is_set()]
        if self._last_step:
            self._trim_at_stops([r for r in leaving if not r.cancel.is_set()])
        for req in sorted(leaving, key=lambda r: -r.decode_slot):
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
            # The snapshot its session was restored from: named now, as clearing the session forgets it.
            suspect = session.restored if session is not None else None
            blame_snapshot = suspect is not None
            if session is not None:
                if stage != "decode" or blame_snapshot:
                    self._clear(session)  # half-written, or restored from a snapshot now suspect
                self.sessions.drop_pending(session)  # taken on the batch slot, reset
                session.request = None
                req.session = None
            if self.prefilling is req:
                self.prefilling = None
            if req.decode_slot is not None:
                self.runner.release(req.decode_slot)
            req.decode_slot, req.pending, req.held = None, None, []
            if blame_snapshot:
                log.warning("engine: %s: the first step after a disk restore failed; snapshot quarantined, "
                            "prefilling from scratch", req.id)
                self.sessions.kv("restore_failed", error, suspect)
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
        self.scheduler.requeue(requeue)  # retried first, in their order

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
        queued = self.scheduler.stop() + self.scheduler.take_all()
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
        # Put back by a failure (_failed) after stop() took the queue, or waiting for a disk read: answer them too.
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
                if left <= 0 or not self._snapshot(session, self.resident.slot(session.slot), session.tokens,
                                                   session.last_logits, "shutdown", wait=left):
                    unsaved.append(len(session.tokens))
        if self._writer is not None:
            unsaved += self._writer.close(deadline - time.monotonic())
        if unsaved:
            log.warning("engine: shutdown: %d conversation(s) not saved to disk in %.0f s (tokens: %s)", len(unsaved),
                        SHUTDOWN_SAVE_S, ", ".join(map(str, unsaved)))
        self.sessions.kv("close")

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
