"""The output part: token ids to text, stop strings and events, on a thread of its own.

The engine thread hands over, once per step, what the step produced (`Output.put`): a batch of
records, each a token of one request or the end of one (done, failed, cancelled), in the order
they happened. This thread detokenizes incrementally, cuts the text at stop strings, builds the
`TokenOut` events and emits them, so none of that is on the engine thread.

A stop string is found here, a step or two after its token was sampled: the request is marked
(`GenRequest.stop_at`, the count of tokens up to and including the one that completed the stop,
and `stop_found`, which the engine polls between steps, then ends the request as done). Tokens
the engine sampled meanwhile are dropped: no event carries them, `generated` is cut back to
`stop_at` before the end event, so usage counts the tokens up to the stop and the text ends
exactly where the stop begins. The session keeps what was fed (the next request's prefix match
decides what is reused).

Every field of a request that the client reads is written here before its end event is emitted.
`Output` without `start()` processes each batch at once on the caller's thread (engines that
tests drive by hand).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from ds4_torch.tokenizer import StreamDecoder

from serve.metrics import Metrics
from serve.errors import APIError
# The records the engine hands over (defined with the request), imported from here too.
from .sequence import End, GenRequest, PromptLogprobs, Started, Token, TokenOut  # noqa: F401
from .stops import StopMatcher

log = logging.getLogger("ds4.serve")


class TextState:
    """Detokenizes the stream and cuts it at stop strings (`serve.engine.stops.StopMatcher`), holding
    back any tail that could still become a stop string."""

    def __init__(self, tokenizer, stops: list[str]):
        self.decoder = StreamDecoder(tokenizer)
        self.stops = stops
        self.matcher = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def push(self, token_id: int | None, final: bool = False) -> str:
        piece = self.decoder.push(token_id) if token_id is not None else ""
        if final:
            piece += self.decoder.flush()
        return self.matcher.push(piece, final)


class Output:
    def __init__(self, tokenizer, metrics: Metrics | None = None, wake: Callable[[], None] = lambda: None):
        self.tokenizer = tokenizer
        self.metrics = metrics or Metrics()
        self.wake = wake                   # tells the engine a request found its stop string
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending = 0                  # batches put and not yet processed
        self._idle = threading.Condition()
        self.cpu_s = 0.0                   # this thread's CPU time (bench serve's host time)

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ds4-output", daemon=True)
            self._thread.start()

    def put(self, batch: list) -> None:
        """Hand over one step's records (in order); processed in the order handed over."""
        if not batch:
            return
        if self._thread is None:
            self._process(batch)
            return
        with self._idle:
            self._pending += 1
        self._queue.put(batch)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything handed over was processed (True), or `timeout` seconds."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Process what is left, then stop the thread."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("output: the thread did not stop within %.0f s", timeout)
        self._thread = None

    def busy(self) -> bool:
        return self._pending > 0

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            c0 = time.thread_time()
            try:
                self._process(batch)
            except BaseException:  # noqa: BLE001 - a bug of ours: never let it kill the thread
                log.exception("output: unexpected error")
            self.cpu_s += time.thread_time() - c0
            with self._idle:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.notify_all()

    def _process(self, batch: list) -> None:
        for rec in batch:
            try:
                if isinstance(rec, Token):
                    self._token(rec)
                elif isinstance(rec, End):
                    self._end(rec)
                elif isinstance(rec, Started):
                    pass
                else:
                    self._prompt_logprobs(rec)
            except Exception as e:  # noqa: BLE001 - detokenizing one request failed: that request's
                log.exception("output: %s failed", rec.req.id)
                self._own_failure(rec.req, e)

    def _own_failure(self, req: GenRequest, error: Exception) -> None:
        if req.stop_at is None:  # the engine ends it at its next step; the failure is its outcome
            req.stop_at = req.emitted
            req.failure = APIError(500, f"this request failed while detokenizing ({type(error).__name__}: {error}); "
                                        "other requests were not affected", code="internal_error")
            req.stop_found.set()
            self.wake()

    def _emit(self, req: GenRequest, event: tuple) -> None:
        try:
            req.emit(event)
        except BaseException as e:  # noqa: BLE001 - e.g. the event loop is gone: the client is
            log.debug("output: cannot deliver %s to %s: %s", event[0], req.id, e)

    def _token(self, rec: Token) -> None:
        req = rec.req
        if req.stop_at is not None or req.finished():
            return  # past its stop string (or already ended): dropped
        text = req.text_state
        if text is None:
            text = req.text_state = TextState(self.tokenizer, req.stop)
        out = TokenOut(rec.token, "", rec.logprob, rec.top)
        if rec.logprob is not None:
            req.cumulative_logprob += rec.logprob
        if rec.end == "eos":
            out.text = text.push(None, final=True)
        else:
            out.text = text.push(rec.token, final=rec.end is not None)
        req.emitted += 1
        if rec.end is not None:
            req.finish_reason = "length" if rec.end == "length" and not text.stopped else "stop"
        elif text.stopped:  # a stop string: the engine ends it at its next step
            req.finish_reason = "stop"
            req.stop_at = req.emitted
            req.stop_found.set()
            self.wake()
        req.text += out.text
        self.metrics.generated_tokens.inc()
        now = time.perf_counter()
        if req.t_first is None:
            req.t_first = now
            self.metrics.ttft.observe(now - req.t_arrival)
        elif req.t_last is not None:
            self.metrics.inter_token.observe(now - req.t_last)
        req.t_last = now
        self._emit(req, ("token", out))

    def _end(self, rec: End) -> None:
        req = rec.req
        if req.finished():
            return
        req.t_end = time.perf_counter()
        if rec.outcome == "done" and req.failure is not None:  # detokenizing it failed here (_own_failure)
            rec = End(req, "failed", error=req.failure)
        if rec.outcome == "done":
            if req.stop_at is not None:  # tokens sampled past the stop string are not the reply's
                del req.generated[req.stop_at:]
            req.finish_reason = req.finish_reason or rec.reason
            req.state = "done"
            self._emit(req, ("done", req.finish_reason))
        elif rec.outcome == "failed":
            req.state = "failed"
            req.error = rec.error.message
            req.finish_reason = "error"
            self._emit(req, ("error", rec.error))
        else:
            req.state = "cancelled"
            req.finish_reason = "cancelled"
            self._emit(req, ("cancelled", rec.stage))

    def _prompt_logprobs(self, rec: PromptLogprobs) -> None:
        text = StreamDecoder(self.tokenizer)  # each token's text, as generated tokens carry theirs
        n = len(rec.outs)
        for i, out in enumerate(rec.outs):
            out.text = text.push(out.token_id) + (text.flush() if i == n - 1 else "")
        self._emit(rec.req, ("prompt_logprobs", rec.outs))
