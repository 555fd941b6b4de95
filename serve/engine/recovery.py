"""Recovery: what the engine does when a step fails, or when it has a bug.

- `failed(reqs, error, stage)`: a step (a decode step, a prefill chunk, a copy on admission) with
  `reqs` in it raised (a device error, an OOM, anything the model raised or `DS4_TORCH_FAULT`
  injected). A decode step resets the batch (captured graphs dropped, the batch cache cleared,
  the allocator's cache emptied; the sessions' resident state was not touched); a prefill chunk
  or a copy only empties the allocator's cache and clears that request's session. Each request
  is then retried once, first in the queue, resuming after the tokens already sent (prefilled
  again). A second failure answers 503 and marks the engine `degraded` until a request succeeds
  (`succeeded`). If the first step after a disk restore fails, the snapshot is quarantined and
  the request starts over from a clean prefill without spending its retry.
- `recover_from_bug()`: something raised in the loop outside a step: every request in the batch
  is answered 500 and the batch is reset; the loop goes on.
- `group_failed()`: a rank of the tensor-parallel group died or stopped answering: every request
  is answered 503 and the engine stops (`peers.failed` then ends the server).

The runner, sessions, scheduler and requests in flight (serve.engine.inflight) are the engine's, handed in, with its
`answer(req, outcome, stage=, error=)`, which hands a request's end to the output part.
"""
from __future__ import annotations

import logging
from typing import Callable

from serve.errors import APIError
from .sequence import GenRequest

log = logging.getLogger("ds4.serve")


class Recovery:
    def __init__(self, runner, sessions, scheduler, in_flight, metrics, *, peers=None, answer: Callable):
        self.runner, self.sessions, self.scheduler, self.in_flight = runner, sessions, scheduler, in_flight
        self.metrics = metrics
        self.peers = peers
        self.answer = answer
        self.degraded: str | None = None        # reason, while the last request failed for good
        self.retry_after_s = 1

    def succeeded(self) -> None:
        """A request was served: the engine is healthy (again)."""
        if self.degraded is not None:
            log.info("engine: healthy again after a successful request")
        self.degraded = None
        self.metrics.healthy.set(1)

    def unavailable(self, message: str, code: str) -> APIError:
        """A 503 asking the client to retry after `retry_after_s`."""
        return APIError(503, message, code=code, headers={"Retry-After": str(self.retry_after_s)})

    def failed(self, reqs: list[GenRequest], error: BaseException, stage: str) -> None:
        """A step with `reqs` in it failed: reset, then retry each request once (or fail it)."""
        self.metrics.device_errors.inc()
        log.warning("engine: %s step with %d request(s) failed: %s: %s", stage, len(reqs), type(error).__name__,
                    error)
        if stage == "decode":
            self.reset_batch(f"{type(error).__name__}: {error}")
        else:  # a prefill chunk or a copy of one session: the batch, decoding beside it, is intact
            self.runner.replica.release_allocator()
            self.metrics.engine_resets.inc()
        # The tensor-parallel group is gone, not the request: `group_failed` answers it next.
        group_gone = self.peers is not None and self.peers.broken is not None
        requeue = []
        for req in reqs:
            session = req.session
            # The snapshot its session was restored from: named now, as clearing the session forgets it.
            suspect = session.restored if session is not None else None
            blame_snapshot = suspect is not None
            if session is not None:
                if stage != "decode" or blame_snapshot:
                    self.sessions.clear(session)  # half-written, or restored from a snapshot now suspect
                self.sessions.drop_pending(session)  # taken on the batch slot, reset
                session.request = None
                req.session = None
            if self.in_flight.prefilling is req:
                self.in_flight.prefilling = None
            if req.decode_slot is not None:
                self.runner.release(req.decode_slot)
            req.decode_slot, req.pending, req.held = None, None, []
            if blame_snapshot:
                log.warning("engine: %s: the first step after a disk restore failed; snapshot quarantined, "
                            "prefilling from scratch", req.id)
                self.sessions.kv("restore_failed", error, suspect)
                req.no_restore = True
            if req.cancel.is_set():
                self.answer(req, "cancelled", stage=stage)
            elif req.stop_found.is_set():  # its reply already ended at a stop string
                if req.failure is not None:
                    self.answer(req, "failed")
                else:
                    self.answer(req, "done")
            elif not blame_snapshot and not group_gone and req.attempts >= 2:
                self.degraded = f"a request failed twice in a row: {type(error).__name__}: {error}"
                self.metrics.healthy.set(0)
                self.answer(req, "failed", error=self.unavailable(
                    f"the engine failed on this request twice ({type(error).__name__}: {error}); it has been reset, "
                    f"retry later", "engine_error"))
            else:
                if not blame_snapshot and not group_gone:
                    req.attempts += 1
                requeue.append(req)
        self.in_flight.running = [r for r in self.in_flight.running if r not in reqs]
        self.scheduler.requeue(requeue)  # retried first, in their order

    def reset_batch(self, reason: str) -> None:
        """Drop the batch's device state: captured graphs, batch cache contents, cached allocations.
        Requests still decoding go back to their sessions' resident state (it was not touched)."""
        failure = self.runner.run("reset_batch")
        if failure is not None:
            self.degraded = failure
            self.metrics.healthy.set(0)
        self.metrics.engine_resets.inc()
        log.info("engine: reset (%s)", reason)

    def recover_from_bug(self) -> None:
        """Something raised in the loop outside a step: answer every request in the batch 500, reset."""
        # A request between the two (taking its first token) is only known by its session.
        reqs = [*self.in_flight.requests(), *(s.request for s in self.sessions if s.request is not None)]
        for req in dict.fromkeys(reqs):
            self.in_flight.forget(req)
            self.answer(req, "failed", error=APIError(500, "internal error in the engine", code="internal_error"))
        self.in_flight.running, self.in_flight.prefilling = [], None
        self.reset_batch("unexpected error")

    def group_failed(self) -> None:
        """A rank of the tensor-parallel group died or stopped answering: nothing can run the model
        any more. Every request is answered 503, the engine stops, and `peers` ends the server."""
        reason = f"the tensor-parallel group failed ({self.peers.broken})"
        log.error("engine: %s; stopping", reason)
        self.degraded = reason
        self.metrics.healthy.set(0)
        queued = self.scheduler.stop() + self.scheduler.take_all()
        error = self.unavailable(f"{reason}; the server is exiting", "engine_unavailable")
        for req in [*self.in_flight.requests(), *queued]:
            self.in_flight.forget(req)  # local cache resets only: the group is gone
            self.answer(req, "failed", error=error)
        self.in_flight.running, self.in_flight.prefilling = [], None
        self.peers.failed(reason)

