"""Serving one model split over the ranks of a torch.distributed group (`ds4-torch serve --tp N`).

Rank 0 runs the HTTP server and the engine. Every other rank is a follower: it loads its shard of
the model and then does only what rank 0's engine tells it: the engine sends each replica
operation (serve.engine.replica: a prefill chunk, a decode step's token ids, a cache copy or reset, the
import of a sequence restored from disk, a batch reset) before running it itself, and each
follower runs the same operation on its own replica, in the same order. The collectives inside
the model then pair up, and the KV caches (replicated per rank) stay equal. Sampling, sessions,
the disk KV store (read and written by rank 0 only) and HTTP live on rank 0; the logits every rank
computes are full-vocabulary (the vocab-parallel head gathers them), rank 0's are sampled, and
the sampled tokens reach the others inside the next decode step's message.

Messages: ("open", replica shape) once, then (operation, args), ("heartbeat", ()) every
`HEARTBEAT_S` while rank 0 is idle, and ("stop", ()) at a graceful shutdown. They travel on a
gloo group of their own (Python objects on the CPU, whatever backend the model uses), whose
collectives are bounded by the same `--tp-timeout` as the model's.

Failure:
- a follower that dies: gloo reports the closed connection at rank 0's next message or
  collective (at most one heartbeat later when idle); a follower that hangs: rank 0's next
  collective times out. Either way the group is broken: rank 0 answers every in-flight and new
  request 503 and exits with status 1;
- rank 0 that dies or hangs: the followers' wait for the next message fails (a closed
  connection) or times out; they exit with status 1;
- a step that fails on every rank alike (an injected `DS4_TORCH_FAULT`, set for all ranks by the
  launcher) is recovered as in one process: the follower logs it, and rank 0's recovery (a batch
  reset, a cleared slot) arrives as the next operations;
- every operation is acknowledged: after running it, each rank contributes (its step counter,
  whether it succeeded) to one gather on the control group, and rank 0 compares them. A fault
  on some ranks only (their caches now differ), or a step or acknowledgement that does not
  match (the ranks drifted), is a group failure like a dead rank: 503s and exit. A collective
  that timed out on rank 0 is therefore never retried as a device error while a follower is
  still stuck in it: the acknowledgement cannot complete and the group is declared broken.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from serve.engine.replica import Replica

log = logging.getLogger("ds4.serve")

HEARTBEAT_S = 1.0
DEFAULT_TIMEOUT_S = 120.0
EXIT_GRACE_S = 10.0  # after the group broke, rank 0's orderly shutdown gets this long before a hard exit


class GroupFailed(RuntimeError):
    """The tensor-parallel group is broken: the model cannot run."""


def control_group(timeout_s: float) -> dist.ProcessGroup:
    """The gloo group the engine's messages travel on (every rank must call this, in the same order)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


class Lead:
    """Rank 0's side: the `peers` of its `Engine`. Only the engine's worker thread sends (and the
    server's exit, once that thread has ended)."""

    def __init__(self, group: dist.ProcessGroup, heartbeat_s: float = HEARTBEAT_S):
        self.group = group
        self.heartbeat_s = heartbeat_s
        self.broken: str | None = None  # why the group failed
        self.stopped = False
        self.step = 0  # operations sent: each is acknowledged under its number
        self.on_failure = lambda reason: None  # set by the server: end it
        self._lock = threading.Lock()

    def _broadcast(self, message: tuple) -> None:
        with self._lock:
            if self.broken is not None or self.stopped:
                return
            try:
                dist.broadcast_object_list([message], group_src=0, group=self.group)
            except Exception as e:  # noqa: BLE001 - gloo's closed connection or timeout: a rank is gone
                self.broken = f"{type(e).__name__}: {e}"
                log.error("tensor parallel: cannot reach the other ranks: %s", self.broken)

    def open(self, shape: dict) -> None:
        self._broadcast(("open", shape))

    def send(self, operation: str, args: tuple, model: bool) -> int:
        """Send one replica operation before rank 0 runs it; its step number, for `acknowledge`.
        Once the group is broken nothing is sent; an operation that runs the model (`model`) then
        raises GroupFailed, since its collectives would wait for ranks that are gone, while cache
        operations go on locally."""
        self.step += 1
        self._broadcast((operation, args, self.step))
        if model and (self.broken is not None or self.stopped):
            raise GroupFailed(self.broken or "the followers were stopped")
        return self.step

    def acknowledge(self, step: int, ok: bool) -> None:
        """Every rank's outcome of operation `step` (this rank's: `ok`); GroupFailed when the ranks
        disagree (a fault on some ranks only) or drifted (another step), or cannot be heard."""
        with self._lock:
            if self.broken is not None or self.stopped:
                return
            acks = [None] * dist.get_world_size(self.group)
            try:
                dist.all_gather_object(acks, (step, ok), group=self.group)
            except Exception as e:  # noqa: BLE001 - gloo's closed connection or timeout: a rank is gone
                self.broken = f"acknowledging step {step}: {type(e).__name__}: {e}"
            else:
                if any(a != (step, ok) for a in acks):
                    self.broken = f"the ranks disagree on step {step}: (step, succeeded) per rank {acks}"
            if self.broken is not None:
                log.error("tensor parallel: %s", self.broken)
                raise GroupFailed(self.broken)

    def heartbeat(self) -> None:
        self._broadcast(("heartbeat", ()))

    def stop(self) -> None:
        """Tell the followers to exit (once; nothing when the group is broken)."""
        self._broadcast(("stop", ()))
        self.stopped = True

    def failed(self, reason: str) -> None:
        self.on_failure(reason)


def follow(model, group: dist.ProcessGroup) -> int:
    """A follower rank's whole life after loading: run rank 0's operations until it says stop
    (exit status 0) or cannot be heard (1)."""
    rank = dist.get_rank()
    replica = None
    # SIGINT/SIGTERM (a Ctrl-C or the launcher's shutdown reach every rank): rank 0 shuts the
    # server down and then sends "stop"; exiting before it would break its orderly shutdown.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: log.info("rank %d: signal received; waiting for rank 0's stop", rank))
    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, group_src=0, group=group)
        except Exception as e:  # noqa: BLE001 - a closed connection or the timeout
            log.error("rank %d: lost rank 0 (%s: %s); exiting", rank, type(e).__name__, e)
            return 1
        operation, args, *step = box[0]
        if operation == "stop":
            log.info("rank %d: stopped by rank 0", rank)
            return 0
        if operation == "open":
            replica = Replica(model, **args)
            continue
        if operation == "heartbeat":
            continue
        ok = True
        try:
            with torch.no_grad():
                getattr(replica, operation)(*args)
        except Exception as e:  # noqa: BLE001 - rank 0 compares the outcomes (acknowledge)
            log.warning("rank %d: %s failed: %s: %s", rank, operation, type(e).__name__, e)
            ok = False
        try:
            dist.all_gather_object([None] * dist.get_world_size(group), (step[0], ok), group=group)
        except Exception as e:  # noqa: BLE001 - rank 0 is gone or declared the group broken
            log.error("rank %d: cannot acknowledge step %d (%s: %s); exiting", rank, step[0], type(e).__name__, e)
            return 1


def exit_soon(delay: float, status: int) -> threading.Timer:
    """End the process after `delay` seconds whatever it is doing (a shutdown that would hang on
    a broken group must not keep the server alive)."""
    timer = threading.Timer(delay, lambda: (logging.shutdown(), os._exit(status)))
    timer.daemon = True
    timer.start()
    return timer
