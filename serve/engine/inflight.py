"""The requests in flight: those decoding in the batch, and the one prefilling; their slots.

- `running`: the decoding requests, `running[i]` on batch slot i (and sampler slot i). Decoding
  slots are always the first `n`: a request that leaves is copied back to its resident slot (its
  conversation stays resident) and the last one moves into the hole. The rest are scratch rows a
  graph-mode step may pad with. Copies cost what a sequence holds (its written rows), and happen
  when a request starts or ends, never inside a step.
- `prefilling`: the one request whose prompt is being fed into its session, a chunk at a time.

Before a decode step the KV pool must hold every running row's next tokens (`room_for_step`):
idle sessions leave first (serve.engine.sessions), then the request prefilling, then the requests that
joined last are preempted: set aside and queued again, to resume from what they had sent.

The runner, sessions and scheduler are the engine's, handed in: this module imports none of them.
"""
from __future__ import annotations

import logging
import time

from .sequence import GenRequest

log = logging.getLogger("ds4.serve")


class InFlight:
    def __init__(self, runner, sessions, scheduler, metrics, *, max_batch: int):
        self.runner, self.sessions, self.scheduler, self.metrics = runner, sessions, scheduler, metrics
        self.max_batch = max_batch
        self.running: list[GenRequest] = []      # decoding; running[i].decode_slot == i
        self.prefilling: GenRequest | None = None
        self.pool_short = False  # this iteration's decode step had to preempt: admit no one

    def busy(self) -> bool:
        return self.prefilling is not None or bool(self.running)

    def full(self) -> bool:
        return len(self.running) >= self.max_batch

    def requests(self) -> list[GenRequest]:
        """Every request in the batch: decoding, then the one prefilling."""
        return [*self.running, *([self.prefilling] if self.prefilling is not None else [])]

    def join(self, req: GenRequest, slot: int) -> None:
        """`req` decodes from now on in batch slot `slot` (the next free one), which holds its session."""
        req.decode_slot, req.held = slot, list(req.session.tokens)
        self.running.append(req)

    # ------------------------------------------------------------------ leaving
    def release(self, req: GenRequest) -> None:
        """`req` stops using its session (and batch slot): what it computed stays resident."""
        session = req.session
        if session is None:
            return
        if req.decode_slot is not None:
            run = self.runner.run
            slot, last = req.decode_slot, len(self.running) - 1
            try:
                run("copy", "resident", session.slot, slot, "batch")
                self.sessions.extend(session, req.held[len(session.tokens):], req.logits)
                self.sessions.settle_pending(session)
            except BaseException as e:  # noqa: BLE001 - lose this session, not the engine
                log.warning("engine: cannot keep %s's session: %s: %s", req.id, type(e).__name__, e)
                self.sessions.clear(session)
            if slot != last:  # keep decoding slots first: the last one fills the hole
                moved = self.running[last]
                run("copy", "batch", slot, last, "batch")
                self.runner.move(slot, last)
                moved.decode_slot = slot
                self.running[slot] = moved
            self.running.pop()
            self.runner.release(last)
            run("reset", "batch", last)
            req.decode_slot = None
        if self.prefilling is req:
            self.prefilling = None
        session.request = None
        session.last_used = time.monotonic()
        req.session = None

    def forget(self, req: GenRequest) -> None:
        """`req` leaves without its state: its session is cleared (its slots' state is unknown, or
        the device is gone); the caller takes it off `running`."""
        if req.session is not None:
            self.sessions.clear(req.session)
            req.session.request = None
            req.session = None
        req.decode_slot = None

    # ------------------------------------------------------------------ the KV pool
    def room_for_step(self) -> None:
        """Before a decode step: room for every running row's next tokens (1, or 1 + the drafts
        speculating). What idle sessions cannot free is taken from the request prefilling, then
        from the requests that joined the batch last (preempted: set aside and resumed from what
        they had sent, as a retry is); the longest-running keep going."""
        self.pool_short = False
        while self.running:
            need = self.runner.blocks_for_step(len(self.running))
            keep = [r.session for r in self.running]
            if self.sessions.make_room(need, keep):
                return
            victim = self.prefilling if self.prefilling is not None and self.prefilling.session is not None \
                else self.running[-1]
            self.preempt(victim)
            self.pool_short = True  # no request is admitted in this iteration: it would be preempted next

    def preempt(self, req: GenRequest) -> None:
        """Set `req` aside to free the KV blocks it holds: its session leaves (to disk when a store
        is attached), and it goes back to the front of the queue, to resume after the tokens it
        has sent (prefilled again, or restored), as a retry does, but counted as no attempt."""
        log.info("engine: %s preempted: the KV pool cannot hold the running requests' next tokens", req.id)
        self.metrics.preemptions.inc()
        session = req.session
        self.release(req)  # (its batch slot goes back to its session first)
        if session is not None:
            self.sessions.evict(session, "pool")
        req.decode_slot, req.pending, req.held = None, None, []
        self.scheduler.requeue([req])
