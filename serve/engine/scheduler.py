"""The scheduler: who runs next.

Requests wait in one FIFO queue (`max_queue` of them; a continuation of admitted work, such as
thinking's second phase, and a retried request go to the front). A request that will take its
state from disk is first sent to a reader thread (`load`, the store's read and check) and waits
aside while the others go on; once read it is admitted first. Requests that would read the same
snapshot (`read_key`) wait for one read and share it (`share`): one host copy, whatever the number
waiting, dropped once the last of them has taken it (the session part then releases it once
copied into the cache). The choices of one request (the same
sequence, queued back to back) are admitted together, so their prompt is prefilled once.

The engine's loop waits here for work (`wait_for_work`); admission (serve.engine.admission) asks, once
per iteration, for the next request to start (`next_waiting`) when a batch slot is free. Everything here is guarded by
one condition variable, so the API's threads can submit and cancel while the engine runs.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Hashable
from typing import Any, Callable

from .sequence import GenRequest

log = logging.getLogger("ds4.serve")


class QueueFull(Exception):
    pass


class EngineStopped(Exception):
    pass


class Scheduler:
    def __init__(self, *, max_queue: int, max_batch: int, metrics,
                 wants_disk: Callable[[GenRequest], bool] = lambda req: False,
                 load: Callable[[GenRequest], Any] | None = None,
                 read_key: Callable[[GenRequest], Hashable | None] = lambda req: None,
                 share: Callable[[Any, GenRequest], Any] = lambda loaded, req: None,
                 abandoned: Callable[[GenRequest], None] = lambda req: None):
        self.max_queue, self.max_batch, self.metrics = max_queue, max_batch, metrics
        self.wants_disk = wants_disk   # does `req` want its state read from disk first?
        self.load = load               # that read (on the reader thread)
        self.read_key = read_key       # what it would read: requests with one key share one read
        self.share = share             # another request's read, for `req` (None: it cannot use it)
        self.abandoned = abandoned     # a request whose client left while it waited: answer it
        self.queue: collections.deque[GenRequest] = collections.deque()
        self.loading: dict[GenRequest, concurrent.futures.Future] = {}
        self._reads: dict[Hashable, tuple[concurrent.futures.Future, GenRequest]] = {}  # key -> (read, its reader)
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self.cv = threading.Condition()
        self.stopping = False

    def __len__(self) -> int:
        return len(self.queue)

    def _depth(self) -> None:
        self.metrics.queue_depth.set(len(self.queue))

    # ------------------------------------------------------------------ any thread
    def submit(self, reqs: list[GenRequest], continuation: bool, running: bool) -> None:
        """Queue `reqs` together, back to back, or none of them (EngineStopped, QueueFull)."""
        with self.cv:
            if self.stopping or not running:
                raise EngineStopped("the engine is not running")
            if not continuation and len(self.queue) + len(reqs) > self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            for req in reqs:
                req.state = "queued"
            if continuation:
                self.queue.extendleft(reversed(reqs))
            else:
                self.queue.extend(reqs)
            self._depth()
            self.cv.notify()

    def remove(self, req: GenRequest) -> bool:
        """Take `req` out of the queue (its client left): True if it was there, else the engine is
        woken (it notices a running request's cancel at its next boundary)."""
        with self.cv:
            try:
                self.queue.remove(req)
            except ValueError:
                self.cv.notify()
                return False
            self._depth()
            return True

    def requeue(self, reqs: list[GenRequest]) -> None:
        """Put `reqs` (retried after a failed step) back at the front, in their order."""
        with self.cv:
            self.queue.extendleft(reversed(reqs))
            self._depth()

    def wake(self) -> None:
        with self.cv:
            self.cv.notify()

    def stop(self) -> list[GenRequest]:
        """No more submissions: the queued requests, taken out (to be answered)."""
        with self.cv:
            self.stopping = True
            return self._take_all(aside=False)

    def take_all(self) -> list[GenRequest]:
        """Everything waiting, in the queue and aside, taken out (shutdown, a broken group)."""
        with self.cv:
            return self._take_all(aside=True)

    def _take_all(self, aside: bool) -> list[GenRequest]:
        reqs = list(self.queue)
        self.queue.clear()
        self._depth()
        if aside:
            reqs += list(self.loading)
            self.loading.clear()
            self._reads.clear()
        return reqs

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=False)

    # ------------------------------------------------------------------ the engine thread
    def has_work(self, busy: bool) -> bool:
        return busy or bool(self.queue) or any(f.done() for f in self.loading.values())

    def wait_for_work(self, busy: Callable[[], bool], heartbeat_s: float | None) -> bool:
        """Wait (holding `cv`) for work or a stop. With `heartbeat_s`, return True after that many
        idle seconds (under tensor parallelism the other ranks wait on rank 0's next message)."""
        while not self.has_work(busy()) and not self.stopping:
            if not self.cv.wait(heartbeat_s):
                return True
        return False

    def next_waiting(self) -> GenRequest | None:
        """The next request to start: one whose disk state was read, else the queue's next, except
        that a request wanting a disk read is sent to the reader thread and waits aside."""
        req = self._loaded()
        if req is not None:
            return req
        while True:
            with self.cv:
                req = None
                while self.queue:
                    req = self.queue.popleft()
                    self._depth()
                    if not req.cancel.is_set():
                        break
                    self.abandoned(req)
                    req = None
            if req is None or req.disk is not None or not self.wants_disk(req):
                return req
            self._read_aside(req)

    def next_with_sequence(self, seq: list[int]) -> GenRequest | None:
        """The queue's next request if it asks for exactly `seq` (the next choice of an `n` > 1
        request, whose prompt is now in a session), else None."""
        while True:
            with self.cv:
                if not self.queue or self.queue[0].sequence() != seq:
                    return None
                req = self.queue.popleft()
                self._depth()
            if not req.cancel.is_set():
                return req
            self.abandoned(req)

    def _read_aside(self, req: GenRequest) -> None:
        key = self.read_key(req)
        shared = self._reads.get(key) if key is not None else None
        if shared is not None:  # the same snapshot is being read (or was, for a request still aside)
            self.loading[req] = shared[0]
            return
        if self._reader is None:
            self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ds4-kv-reader")
        future = self._reader.submit(self.load, req)
        self.loading[req] = future
        if key is not None:
            self._reads[key] = (future, req)
        future.add_done_callback(lambda _: self.wake())

    def _loaded(self) -> GenRequest | None:
        """A request whose disk read finished (its state in `req.disk`), if any."""
        for req, future in list(self.loading.items()):
            if not future.done():
                continue
            del self.loading[req]
            reader = self._forget(future)
            if req.cancel.is_set():
                self.abandoned(req)
                continue
            try:
                loaded = future.result()
                if loaded and reader is not None and req is not reader:
                    loaded = self.share(loaded, req)
            except Exception as e:  # noqa: BLE001 - a store bug: serve without it
                log.warning("engine: kv store read failed: %s: %s", type(e).__name__, e)
                loaded = None
            req.disk = loaded or False
            return req
        return None

    def _forget(self, future: concurrent.futures.Future) -> GenRequest | None:
        """The request `future` was read for; the read is dropped once no other request waits for it."""
        for key, (f, reader) in list(self._reads.items()):
            if f is future:
                if future not in self.loading.values():
                    del self._reads[key]
                return reader
        return None
