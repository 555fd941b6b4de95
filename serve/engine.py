"""The engine: one worker thread owns the model and a batch-1 live KV cache.

Requests wait in a bounded FIFO (`max_queue` waiting; one more is the one running). The worker
takes them one at a time:

1. **Prefix reuse.** The live cache holds `cached_tokens` (prompt and generated tokens fed so
   far) and the logits of the last one. The cache cannot rewind, so it is reused only when
   `cached_tokens` is a prefix of the new prompt: then only the suffix is prefilled (and when
   the prompt *equals* the cached tokens, the stored logits give the first token at once).
   Anything else resets the cache. On that miss a disk KV store (`serve.kvstore.KVStore`,
   when given) is consulted: the longest stored prefix of the prompt is restored and only the
   rest is prefilled. The store writes a snapshot after a prefill (once the first token is
   out), every `every` tokens of decode, when the live cache is replaced by another
   conversation, and at shutdown. If the first step after a restore fails (a fault injected
   with `DS4_TORCH_FAULT=restore:N` is raised right before it), the snapshot is quarantined
   and the request is prefilled from scratch in the same attempt: the client sees no error.
2. **Prefill** runs in chunks of `prefill_chunk` tokens; the request's cancel flag is checked
   before each chunk, and `cached_tokens` grows after each, so an aborted prefill leaves a
   reusable prefix.
3. **Decode**: sample, emit, feed back; the cancel flag is checked at every token.

A failure in prefill or decode (device error, OOM, anything raised by the model or injected
with `DS4_TORCH_FAULT`) resets the engine (cache reset, decoder graphs dropped, CUDA cache
emptied) and retries the request once from the clean state, resuming after the tokens already
emitted (they are re-prefilled, so the client sees one seamless output). A second failure
answers the request with 503 and marks the engine degraded until a request succeeds. Nothing
raised in the worker ever escapes it.

Results go back to the asyncio side through `GenRequest.emit` (thread-safe, set by the app):
``("token", TokenOut)``, ``("done", finish_reason)``, ``("error", APIError)``,
``("cancelled", stage)``.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ds4_torch.decode import make_decoder, prefill
from ds4_torch.faults import fault_point
from ds4_torch.sampling import SamplingParams, sample, stop_token_ids
from ds4_torch.tokenizer import StreamDecoder

from .metrics import Metrics
from .protocol import APIError

log = logging.getLogger("ds4.serve")


class QueueFull(Exception):
    pass


class EngineStopped(Exception):
    pass


class KVStore(Protocol):
    """What the engine calls on a disk KV cache (`serve.kvstore.KVStore` implements it).
    Only `restore` and `save` are required; the engine calls `checkpoint`, `restore_ok`,
    `restore_failed` and `close` when the store has them. A store's exception never fails a
    request (it is logged), except in `restore`'s first step, which counts as the restore's."""

    def restore(self, cache, prompt_ids: list[int]) -> tuple[int, torch.Tensor] | None:
        """On a live-cache miss: load the longest stored prefix of `prompt_ids` into the (reset)
        cache; return (tokens restored, logits of the last one), or None."""

    def save(self, cache, token_ids: list[int], last_logits: torch.Tensor, why: str = "prefill") -> bool:
        """The cache holds `token_ids` and `last_logits` are the next token's: store it if worthwhile.
        `why`: prefill, replaced (another conversation takes the live cache), shutdown."""

    # optional:
    # checkpoint(cache, token_ids, last_logits) after every decode step (periodic snapshots);
    # restore_ok() / restore_failed(error) once the first step after a restore passed / failed;
    # close() when the engine stops.


class _RestoreFailed(Exception):
    """The first model step after a disk restore failed: the snapshot is blamed, not the engine."""


@dataclass
class TokenOut:
    token_id: int
    text: str                          # text this token releases (may be "" while held back)
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    ignore_eos: bool = False
    emit: Callable[[tuple], None] = lambda event: None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancel: threading.Event = field(default_factory=threading.Event)
    # filled in by the engine
    generated: list[int] = field(default_factory=list)
    text: str = ""
    cached_tokens: int = 0
    prefill_chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    attempts: int = 0
    state: str = "new"                 # new, queued, running, done, cancelled, failed
    t_arrival: float = field(default_factory=time.perf_counter)
    t_start: float | None = None
    t_first: float | None = None
    t_end: float | None = None

    def finished(self) -> bool:
        return self.state in ("done", "cancelled", "failed")


class _Cancelled(Exception):
    def __init__(self, stage: str):
        self.stage = stage


class _TextState:
    """Detokenizes the stream and cuts it at stop strings, holding back any tail that could
    still become a stop string."""

    def __init__(self, tokenizer, stops: list[str]):
        self.decoder = StreamDecoder(tokenizer)
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def push(self, token_id: int, final: bool = False) -> str:
        piece = self.decoder.push(token_id) if token_id is not None else ""
        if final:
            piece += self.decoder.flush()
        buf = self.pending + piece
        if self.stops:
            hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
            if hits:
                self.pending, self.stopped = "", True
                return buf[:min(hits)]
        if final or not self.stops:
            self.pending = ""
            return buf
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]


class Engine:
    def __init__(self, model, tokenizer, *, ctx: int = 4096, prefill_chunk: int = 256, decode_mode: str = "auto",
                 max_queue: int = 64, metrics: Metrics | None = None, kv_store: KVStore | None = None,
                 eos_ids=None):
        self.model = model
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.prefill_chunk = prefill_chunk
        self.decode_mode = decode_mode
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.kv_store = kv_store
        self.device = model.device
        self.eos_ids = stop_token_ids(model.config, tokenizer, eos_ids)

        self.cache = model.new_cache(batch_size=1, max_context=ctx)
        self.decoder = make_decoder(model, self.cache, decode_mode)
        self.cached_tokens: list[int] = []     # what the live cache holds
        self.last_logits: torch.Tensor | None = None
        self._verify_restore = False            # the next model step is the first after a disk restore
        self._no_restore = False                # this request falls back to a clean prefill

        self.degraded: str | None = None        # reason, while the last request failed for good
        self.chunk_delay = 0.0                  # test hook: seconds slept after each prefill chunk
        self.token_delay = 0.0                  # test hook: seconds slept after each decode step
        self.retry_after_s = 1

        self._queue: collections.deque[GenRequest] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.current: GenRequest | None = None
        self.served = 0
        self._stage = "prefill"
        # torch's intra-op thread count is per thread: the worker inherits the creator's setting.
        self.num_threads = torch.get_num_threads()
        self.warm = False

    # ------------------------------------------------------------------ control (any thread)
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ds4-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            self.metrics.queue_depth.set(0)
            if self.current is not None:
                self.current.cancel.set()
            self._cv.notify_all()
        for req in pending:
            self._fail(req, APIError(503, "the server is shutting down", code="server_shutting_down",
                                     headers={"Retry-After": str(self.retry_after_s)}))
        if self._thread is not None:
            self._thread.join(timeout)

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

    def submit(self, req: GenRequest) -> None:
        with self._cv:
            if self._stopping or not self.alive:
                raise EngineStopped("the engine is not running")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            req.state = "queued"
            self._queue.append(req)
            self.metrics.queue_depth.set(len(self._queue))
            self._cv.notify()

    def cancel(self, req: GenRequest) -> None:
        """The client went away: stop the request at its next chunk/token boundary (or drop it
        from the queue now)."""
        req.cancel.set()
        with self._cv:
            try:
                self._queue.remove(req)
            except ValueError:
                return
            self.metrics.queue_depth.set(len(self._queue))
        self._abort(req, "queued")

    # ------------------------------------------------------------------ worker
    def warmup(self) -> None:
        """Run the model once (first calls pay one-off initialisation), then clear the cache.
        Calls the model directly, not through `prefill`/`step`, so no fault point is counted."""
        try:
            with torch.no_grad():
                ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
                self.model(ids, cache=self.cache)
                self.model(ids[:, :1], cache=self.cache)
        except BaseException as e:  # noqa: BLE001
            log.warning("engine: warm-up failed: %s: %s", type(e).__name__, e)
        finally:
            self.cache.reset()
        self.warm = True

    def _loop(self) -> None:
        torch.set_num_threads(self.num_threads)
        if not self.warm:
            self.warmup()
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    break
                req = self._queue.popleft()
                self.metrics.queue_depth.set(len(self._queue))
                self.current = req
            self.metrics.running.set(1)
            try:
                self._serve(req)
            except BaseException as e:  # noqa: BLE001 - never let anything kill the worker
                log.exception("engine: unexpected error serving %s", req.id)
                self._fail(req, APIError(500, f"internal error: {e}", code="internal_error"))
            finally:
                with self._cv:
                    self.current = None
                self.metrics.running.set(0)
                self.metrics.cache_tokens.set(len(self.cached_tokens))
        if self.kv_store is not None:  # clean shutdown: keep the live conversation on disk
            with torch.no_grad():
                self._save_live("shutdown")
            self._kv("close")

    def _kv(self, method: str, *args, **kwargs):
        """Call an (optional) store method; its failures are logged, never raised."""
        fn = getattr(self.kv_store, method, None)
        if fn is None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the disk cache must never fail a request
            log.warning("engine: kv store %s failed: %s: %s", method, type(e).__name__, e)
            return None

    def _save_live(self, why: str) -> None:
        """Snapshot what the live cache holds (before it is replaced, or at shutdown)."""
        if self.kv_store is None or not self.cached_tokens or self.last_logits is None or \
                self.cache is None or self.cache.invalid:
            return
        self._kv("save", self.cache, list(self.cached_tokens), self.last_logits, why=why)

    def _serve(self, req: GenRequest) -> None:
        if req.cancel.is_set():
            self._abort(req, "queued")
            return
        req.state = "running"
        req.t_start = time.perf_counter()
        generator = req.sampling.generator(self.device)
        text = _TextState(self.tokenizer, req.stop)
        self._no_restore = False
        for attempt in (1, 2):
            req.attempts = attempt
            self._stage = "prefill"
            try:
                with torch.no_grad():
                    try:
                        self._attempt(req, generator, text)
                    except _RestoreFailed as rf:
                        # Blame the snapshot: quarantined, and this attempt starts over from a clean
                        # prefill (resuming after any token already sent), without touching the retry.
                        cause = rf.__cause__
                        log.warning("engine: %s: the first step after a disk restore failed (%s: %s); "
                                    "snapshot quarantined, prefilling from scratch", req.id,
                                    type(cause).__name__, cause)
                        self._kv("restore_failed", cause)
                        self.reset(f"restore failed: {type(cause).__name__}: {cause}")
                        self._no_restore = True
                        if req.cancel.is_set():
                            raise _Cancelled(self._stage) from None
                        self._attempt(req, generator, text)
                self._finish(req)
                if self.degraded is not None:
                    log.info("engine: healthy again after a successful request")
                self.degraded = None
                self.metrics.healthy.set(1)
                return
            except _Cancelled as c:
                self._abort(req, c.stage)
                return
            except BaseException as e:  # noqa: BLE001 - device errors, OOM, injected faults, bugs
                self.metrics.device_errors.inc()
                stage = self._stage
                log.warning("engine: %s failed in %s (attempt %d/2): %s: %s", req.id, stage, attempt,
                            type(e).__name__, e)
                self.reset(f"{type(e).__name__}: {e}")
                if req.cancel.is_set():
                    self._abort(req, stage)
                    return
                if attempt == 2:
                    self.degraded = f"a request failed twice in a row: {type(e).__name__}: {e}"
                    self.metrics.healthy.set(0)
                    self._fail(req, APIError(
                        503, f"the engine failed on this request twice ({type(e).__name__}: {e}); it has been "
                             f"reset, retry later", code="engine_error",
                        headers={"Retry-After": str(self.retry_after_s)}))
                    return

    def reset(self, reason: str = "") -> None:
        """Drop all device state: cache contents, captured graphs, cached allocations."""
        self.cached_tokens = []
        self.last_logits = None
        self._verify_restore = False
        try:
            self.decoder.reset()
            self.cache.reset()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        except BaseException as e:  # noqa: BLE001 - the reset itself failed: rebuild from scratch
            log.error("engine: reset failed (%s); reallocating the cache", e)
            try:
                self.cache = None
                self.decoder = None
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                self.cache = self.model.new_cache(batch_size=1, max_context=self.ctx)
                self.decoder = make_decoder(self.model, self.cache, self.decode_mode)
            except BaseException as e2:  # noqa: BLE001
                log.error("engine: cannot reallocate the cache: %s", e2)
                self.degraded = f"cannot reallocate the KV cache: {e2}"
                self.metrics.healthy.set(0)
        self.metrics.engine_resets.inc()
        self.metrics.cache_tokens.set(0)
        log.info("engine: reset (%s)", reason or "requested")

    # ------------------------------------------------------------------ one attempt
    def _match(self, seq: list[int]) -> int:
        """Tokens of `seq` the live cache can keep; resets the cache when it cannot be reused."""
        n = len(self.cached_tokens)
        usable = self.cache is not None and not self.cache.invalid
        if usable and n and n <= len(seq) and seq[:n] == self.cached_tokens and \
                (n < len(seq) or self.last_logits is not None):
            return n
        if n or not usable:
            if usable:
                self._save_live("replaced")  # another conversation takes the live cache
            self.cached_tokens, self.last_logits = [], None
            self._verify_restore = False
            self.cache.reset()
        # Live-cache miss: the disk KV store may hold a prefix.
        if self.kv_store is not None and not self._no_restore:
            try:
                restored = self.kv_store.restore(self.cache, seq)
            except Exception as e:  # noqa: BLE001 - a store bug: serve without it
                log.warning("engine: kv store restore failed: %s: %s", type(e).__name__, e)
                self.cache.reset()
                restored = None
            if restored is not None:
                count, logits = restored
                self.cached_tokens, self.last_logits = list(seq[:count]), logits
                self._verify_restore = True
                return count
        return 0

    def _first_step_after_restore(self, run):
        """Run one model step; if it is the first after a disk restore, a failure in it (or the
        `restore` fault point just before it) is the snapshot's."""
        if not self._verify_restore:
            return run()
        try:
            fault_point("restore")
            out = run()
        except BaseException as e:  # noqa: BLE001
            if not self._verify_restore:  # a later prefill chunk failed: not the snapshot's fault
                raise
            self._verify_restore = False
            raise _RestoreFailed() from e
        if self._verify_restore:
            self._verify_restore = False
            self._kv("restore_ok")
        return out

    def _attempt(self, req: GenRequest, generator, text: _TextState) -> None:
        # A retry resumes: the tokens already emitted are fed again after the prompt.
        seq = req.prompt_ids + req.generated
        reused = self._match(seq)
        if req.attempts == 1:
            req.cached_tokens = reused
        logits = self.last_logits
        suffix = seq[reused:]
        if suffix:
            if req.cancel.is_set():
                raise _Cancelled("prefill")
            fed = len(self.cached_tokens)

            def on_chunk(done: int, chunk_logits: torch.Tensor) -> bool:
                # The cache now holds seq[:fed + done]: record it, so an abort leaves a reusable prefix.
                nonlocal logits
                logits = chunk_logits[0].clone()  # drop the [1, T, V] buffer the view keeps alive
                self.cached_tokens.extend(seq[len(self.cached_tokens):fed + done])
                self.last_logits = logits
                req.prefill_chunks += 1
                self.metrics.prefill_chunks.inc()
                if self._verify_restore:  # the first step after a disk restore passed
                    self._verify_restore = False
                    self._kv("restore_ok")
                if self.chunk_delay:
                    time.sleep(self.chunk_delay)
                return not req.cancel.is_set()

            self._stage = "prefill"
            ids = torch.tensor([suffix], dtype=torch.long, device=self.device)
            if self._first_step_after_restore(
                    lambda: prefill(self.model, self.cache, ids, self.prefill_chunk, on_chunk)) is None:
                raise _Cancelled("prefill")
        # Snapshot after a prefill; written once the first token is out (the cache still holds
        # exactly the prompt then), so the disk write does not delay the first token.
        save_pending = bool(suffix) and self.kv_store is not None

        while True:
            if req.cancel.is_set():
                raise _Cancelled("decode" if req.generated else "prefill")
            token = sample(logits, req.sampling, generator)
            out = TokenOut(token, "")
            if req.logprobs is not None:
                lp = torch.log_softmax(logits.float(), dim=-1)
                out.logprob = float(lp[token])
                if req.logprobs > 0:
                    vals, idx = torch.topk(lp, min(req.logprobs, lp.numel()))
                    out.top = list(zip(idx.tolist(), vals.tolist()))
            req.generated.append(token)
            self.metrics.generated_tokens.inc()
            if req.t_first is None:
                req.t_first = time.perf_counter()
                self.metrics.ttft.observe(req.t_first - req.t_arrival)
            finish = None
            if token in self.eos_ids and not req.ignore_eos:
                finish = "stop"
                out.text = text.push(None, final=True)
            else:
                final = len(req.generated) >= req.max_tokens or len(self.cached_tokens) >= self.ctx
                out.text = text.push(token, final=final)
                if text.stopped:
                    finish = "stop"
                elif final:
                    finish = "length"
            req.text += out.text
            self._emit(req, ("token", out))
            if save_pending:
                save_pending = False
                self._kv("save", self.cache, list(self.cached_tokens), self.last_logits, why="prefill")
            if finish is not None:
                req.finish_reason = finish
                return
            self._stage = "decode"
            step_ids = torch.tensor([token], dtype=torch.long, device=self.device)
            logits = self._first_step_after_restore(lambda: self.decoder.step(step_ids)[0])
            self.cached_tokens.append(token)
            self.last_logits = logits
            if self.kv_store is not None:
                self._kv("checkpoint", self.cache, self.cached_tokens, logits)
            if self.token_delay:
                time.sleep(self.token_delay)

    # ------------------------------------------------------------------ outcomes
    def _emit(self, req: GenRequest, event: tuple) -> None:
        try:
            req.emit(event)
        except BaseException as e:  # noqa: BLE001 - e.g. the event loop is gone: the client is
            log.debug("engine: cannot deliver %s to %s: %s", event[0], req.id, e)

    def _finish(self, req: GenRequest) -> None:
        req.state = "done"
        req.t_end = time.perf_counter()
        self.served += 1
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        self.metrics.cached_prompt_tokens.inc(req.cached_tokens)
        self._emit(req, ("done", req.finish_reason))

    def _abort(self, req: GenRequest, stage: str) -> None:
        if req.finished():
            return
        req.state = "cancelled"
        req.finish_reason = "cancelled"
        req.t_end = time.perf_counter()
        self.metrics.prefill_aborted.inc()
        self.metrics.aborted.labels(stage=stage).inc()
        log.info("engine: %s abandoned by its client while %s (cache keeps %d tokens)", req.id,
                 "queued" if stage == "queued" else f"in {stage}", len(self.cached_tokens))
        self._emit(req, ("cancelled", stage))

    def _fail(self, req: GenRequest, error: APIError) -> None:
        if req.finished():
            return
        req.state = "failed"
        req.error = error.message
        req.finish_reason = "error"
        req.t_end = time.perf_counter()
        self._emit(req, ("error", error))
