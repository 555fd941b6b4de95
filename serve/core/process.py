"""The engine core: the engine (scheduler, runner, sessions, checkpoints, the disk KV store) in a
process of its own, serving one or more API processes (serve.core.client) over Unix sockets
(serve.core.wire). `python -m serve.core.process` runs it; `spawn_core` starts one for `ds4-torch serve`.

What it takes: requests as token ids with everything sampling and grammars need (the API
process tokenized and checked them); what it sends: once per engine iteration, one message per
API process holding every token, logprobs and end of that process's requests (`CoreOutput`, the
engine's output part here: text is made in the API process). A stop string found there comes
back as "stop after token k": the engine ends the request at its next iteration, and when
speculating it waits (up to `STOP_WAIT_S`) for the API process to have read the step's tokens
(an "ack"), so a speculative step's tokens past the stop go back exactly as in one process.

Lifecycle: the core dies with the process that started it (PR_SET_PDEATHSIG: SIGKILL, like a
`kill -9` of the server); Ctrl-C reaches the whole process group, so the core ignores SIGINT and
drains when its parent asks ("shutdown"); SIGTERM drains too. An API process whose connection
closes has its requests cancelled (their sessions keep what was computed). One that stops
reading never blocks the engine: its messages wait on a sender thread of its own, and past
`--api-backlog-mb` its output is dropped and its requests cancelled (`APIConnection`).
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener

from serve.engine.loop import Engine, EngineStopped, QueueFull
from serve.engine.output import End, PromptLogprobs, Started, Token
from serve.errors import APIError
from .wire import BACKLOG_MB, dumps, error_fields, error_from, loads, request_from, stats

log = logging.getLogger("ds4.serve")

PR_SET_PDEATHSIG = 1
BYE_S = 10.0   # at shutdown, how long the API processes get to read what is left (a stopped one never does)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Linux: `sig` to this process when its parent dies (no orphan engine holding the model)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the closed connections end it instead
        pass
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)


def peer_pid(conn) -> int | None:
    """The process at the other end of a Unix socket connection (Linux: SO_PEERCRED), or None."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except (OSError, AttributeError):
        return None


class APIConnection:
    """The core's side of one API process: its requests by id, what it has acknowledged, and the
    messages queued for it. A sender thread of its own writes them, so an API process that stops
    reading (stopped, wedged) holds up only that thread, never the engine's: once more than
    `EngineCore.backlog` bytes wait for it, its step messages are dropped and replaced by one
    ("dropped", ids) naming the requests whose output was lost, which the core cancels
    (`EngineCore.behind`)."""

    def __init__(self, conn, number: int, core: "EngineCore"):
        self.conn, self.number = conn, number
        pid = peer_pid(conn)  # the number is the order of connecting: the pid names it in the logs
        self.name = f"API process {number}" + ("" if pid is None else f" (process {pid})")
        self.requests: dict[str, object] = {}
        self.lock = threading.Lock()        # the engine thread and reader threads send: numbers and queue
        self._wake = threading.Condition(self.lock)
        self.alive = True
        self.sent_ack = 0                   # the last step message that asked for an ack
        self.acked = 0
        self.lagging = False                # missed an ack deadline: not waited for until it catches up
        self.missed_acks = 0                # flushes that ended waiting for it
        self.seq = 0
        self.core = core
        self.warned = False                 # that it fell behind (logged once)
        self._queue: collections.deque = collections.deque()   # (bytes, request ids of a step message | None)
        self._queued = 0                    # bytes in `_queue` (not the one being written)
        self._closing = False
        self._sender = threading.Thread(target=self._send_loop, name=f"ds4-core-send{number}", daemon=True)
        self._sender.start()

    def send(self, message) -> None:
        """Queue a message that is never dropped (hello, replies, bye: small, and few)."""
        with self.lock:
            cancelled = self._put(dumps(message), None)
        if cancelled is not None:  # it passed the bound: the step messages before it were dropped
            self.core.behind(self, cancelled)

    def send_step(self, records: list, ack: bool) -> None:
        """One iteration's records, numbered in the order sent (an engine thread's step and a
        cancel answered on a reader thread may both send)."""
        with self.lock:
            self.seq += 1
            if ack:
                self.sent_ack = self.seq
            cancelled = self._put(dumps(("step", self.seq, ack, records)), {rec[1] for rec in records})
        if cancelled is not None:
            self.core.behind(self, cancelled)

    def _put(self, data: bytes, ids: set | None):
        """Queue `data` (the lock held); past the backlog, drop the step messages: the requests to
        cancel (their output was dropped, or would come after a gap), else None."""
        if not self.alive or self._closing:
            return None
        self._queue.append((data, ids))
        self._queued += len(data)
        self._wake.notify()
        if self._queued <= self.core.backlog:
            return None
        dropped: set = set()
        for _, step_ids in self._queue:
            dropped |= step_ids or set()
        cancelled = self.core.open_requests(self)
        if not dropped and not cancelled:  # only replies wait: few, as the API process asked for them
            return None
        kept = [(d, i) for d, i in self._queue if i is None]
        notice = dumps(("dropped", sorted(dropped | {req.id for req in cancelled})))
        self._queue = collections.deque(kept + [(notice, None)])  # before any later record of theirs
        self._queued = sum(len(d) for d, _ in self._queue)
        return cancelled

    def close(self, message, timeout: float) -> None:
        """Send `message` last, after what is queued, and wait up to `timeout` s for it to go."""
        self.send(message)
        with self.lock:
            self._closing = True
            self._wake.notify()
        self._sender.join(timeout)

    def gone(self) -> None:
        """The API process closed its connection: drop what is queued; the sender ends."""
        with self.lock:
            self.alive = False
            self._queue.clear()
            self._queued = 0
            self._wake.notify()

    def _send_loop(self) -> None:
        while True:
            with self.lock:
                self._wake.wait_for(lambda: self._queue or self._closing or not self.alive)
                if not self.alive or not self._queue:  # gone, or closing with everything sent
                    return
                data, _ = self._queue.popleft()
                self._queued -= len(data)
            try:
                self.conn.send_bytes(data)
            except OSError:  # the API process is gone: its reader thread cancels its requests
                self.gone()
                return


class CoreOutput:
    """The engine's output part in the core process (the interface of serve.engine.output.Output): each
    iteration's records, one message per API process, queued by the engine thread for that
    process's sender thread (`APIConnection`), so the engine never waits on a socket."""

    def __init__(self, core: "EngineCore"):
        self.core = core
        self.speculating = bool(core.engine.speculative_tokens)  # only then does the engine wait (`flush`)
        self.cpu_s = 0.0
        self._acked = threading.Condition()

    def start(self) -> None:
        pass

    def close(self, timeout: float = 0.0) -> None:
        pass

    def busy(self) -> bool:
        return False

    def put(self, batch: list) -> None:
        c0 = time.thread_time()
        out: dict[APIConnection, list] = {}
        ack: set[APIConnection] = set()
        for rec in batch:
            req = rec.req
            conn = self.core.origin.get(req)
            if conn is None:
                continue
            recs = out.setdefault(conn, [])
            if isinstance(rec, Token):
                recs.append(("t", req.id, rec.token, rec.end, rec.logprob, rec.top, rec.sampled_at))
                if req.stop and rec.end is None and self.speculating:  # the engine may wait for its stop strings
                    ack.add(conn)
            elif isinstance(rec, End):
                recs.append(("e", req.id, rec.outcome, rec.reason,
                             None if rec.error is None else error_fields(rec.error), rec.stage, stats(req)))
                self.core.forget(conn, req)
            elif isinstance(rec, Started):
                recs.append(("s", req.id, req.cached_tokens, req.t_start, req.cache_report))
            elif isinstance(rec, PromptLogprobs):
                recs.append(("p", req.id, [(o.token_id, o.logprob, o.top) for o in rec.outs]))
        for conn, recs in out.items():
            conn.send_step(recs, conn in ack)
        self.cpu_s += time.thread_time() - c0

    def acked(self, conn: APIConnection, seq: int) -> None:
        with self._acked:
            conn.acked = max(conn.acked, seq)  # (a dropped step's ack never comes)
            if conn.acked >= conn.sent_ack:
                conn.lagging = False
            self._acked.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until each API process read the step messages it was asked to acknowledge (its
        stop strings are matched, and any stop it found has arrived), or `timeout` seconds. One
        that misses the deadline is not waited for again until it has caught up: a stopped API
        process costs the engine one wait, not one per step (its speculative stops then keep the
        tokens past them in the session, as a stop found late does)."""
        def unacked() -> list[APIConnection]:
            return [c for c in self.core.connections if c.alive and not c.lagging and c.acked < c.sent_ack]

        with self._acked:
            done = self._acked.wait_for(lambda: not unacked(), timeout)
            for conn in unacked():
                conn.lagging = True
                conn.missed_acks += 1
            return done


class EngineCore:
    """Serves `engine` to the API processes that connect to `listener`."""

    def __init__(self, engine: Engine, listener: Listener, info: dict, backlog_mb: float = BACKLOG_MB):
        self.engine, self.listener, self.info = engine, listener, info
        self.backlog = int(backlog_mb * 2**20)  # bytes queued for one API process before it is dropped
        self.connections: list[APIConnection] = []
        self.origin: dict[object, APIConnection] = {}  # each running request's API process
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.output = CoreOutput(self)
        engine.output = self.output
        self._count = 0

    def start(self, config=None, kv_budget: int | None = None) -> None:
        """Start the engine and wait for its warm-up (API processes are greeted once it is warm)."""
        engine = self.engine
        engine.start()
        while not engine.warm and engine.alive:
            time.sleep(0.01)
        self.info.update(config=config, describe=engine.describe(), vocab_size=engine.model.config.vocab_size,
                         kv_budget=kv_budget, pid=os.getpid(), kv_events=engine.kv_event_info())

    def serve(self) -> None:
        """Accept API processes until asked to stop (by one of them or SIGTERM); then drain."""
        threading.Thread(target=self._accept, name="ds4-core-accept", daemon=True).start()
        self.stopping.wait()
        log.info("engine core: stopping")
        self.engine.stop()
        deadline = time.monotonic() + BYE_S
        for conn in list(self.connections):  # what is queued (the last ends), then bye
            conn.close(("bye",), max(0.0, deadline - time.monotonic()))

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                raw = self.listener.accept()
            except Exception as e:  # noqa: BLE001 - a client failing authentication, or the listener closed
                if self.stopping.is_set():
                    return
                log.warning("engine core: a connection was refused: %s: %s", type(e).__name__, e)
                continue
            self._count += 1
            conn = APIConnection(raw, self._count, self)
            with self.lock:
                self.connections.append(conn)
            conn.send(("hello", self.info))
            threading.Thread(target=self._read, args=(conn,), name=f"ds4-core-api{conn.number}",
                             daemon=True).start()

    def forget(self, conn: APIConnection, req) -> None:
        with self.lock:
            self.origin.pop(req, None)
            conn.requests.pop(req.id, None)

    def open_requests(self, conn: APIConnection) -> list:
        with self.lock:
            return list(conn.requests.values())

    def behind(self, conn: APIConnection, requests: list) -> None:
        """`conn`'s backlog passed the bound and its step messages were dropped: cancel its open
        requests (their sessions keep what was fed, as after a disconnect), so no more output
        piles up for it; the other API processes' streams never waited."""
        self.engine.metrics.api_behind.inc()
        with conn.lock:  # (two threads may pass the bound at once: one warning)
            first, conn.warned = not conn.warned, True
        if first:
            log.warning("engine core: %s is not reading its output (over %d bytes queued); dropping "
                        "it and cancelling its %d request(s)", conn.name, self.backlog, len(requests))
        else:
            log.debug("engine core: %s fell behind again; cancelling %d request(s)", conn.name,
                      len(requests))
        with self.output._acked:  # the acks of dropped steps never come: not waited for
            conn.lagging = True
        for req in requests:
            self.engine.cancel(req)

    def _read(self, conn: APIConnection) -> None:
        while True:
            try:
                data = conn.conn.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                message = loads(data)
                self._handle(conn, message)
            except Exception:  # noqa: BLE001 - one bad message is that message's problem alone
                log.exception("engine core: a message from %s could not be handled", conn.name)
        conn.gone()
        with self.lock:
            open_requests = list(conn.requests.values())
            self.connections.remove(conn)
        if open_requests and not self.stopping.is_set():
            log.warning("engine core: %s is gone; cancelling its %d request(s)", conn.name,
                        len(open_requests))
        for req in open_requests:
            self.engine.cancel(req)
        with self.output._acked:
            self.output._acked.notify_all()

    def _handle(self, conn: APIConnection, message: tuple) -> None:
        kind = message[0]
        if kind == "cancel":
            req = conn.requests.get(message[1])
            if req is not None:
                self.engine.cancel(req)
        elif kind == "stop":
            _, rid, at, error = message
            req = conn.requests.get(rid)
            if req is not None:
                if error is not None:
                    req.failure = error_from(error)
                req.stop_at = at
                req.stop_found.set()
                self.engine.scheduler.wake()
        elif kind == "ack":
            self.output.acked(conn, message[1])
        elif kind == "submit":
            _, call, items, continuation = message
            conn.send(("reply", call, self._submit(conn, items, continuation), None))
        elif kind == "call":
            _, call, name, *args = message
            try:
                conn.send(("reply", call, self._call(name, *args), None))
            except Exception as e:  # noqa: BLE001 - answered, so the caller does not wait
                conn.send(("reply", call, None, f"{type(e).__name__}: {e}"))
        elif kind == "shutdown":
            self.stopping.set()
        else:
            log.warning("engine core: unknown message %r from %s", kind, conn.name)

    def _submit(self, conn: APIConnection, items: list[bytes], continuation: bool):
        """Queue the requests of one HTTP request (all or none); None, or (kind, message)."""
        try:
            reqs = [request_from(data, self.engine.structured_outputs) for data in items]
        except Exception as e:  # noqa: BLE001 - a request that cannot be decoded fails alone
            log.exception("engine core: a request from %s could not be decoded", conn.name)
            return ("error", error_fields(APIError(500, f"the engine core could not decode this request "
                                                        f"({type(e).__name__}: {e})", code="internal_error")))
        with self.lock:
            for req in reqs:
                self.origin[req] = conn
                conn.requests[req.id] = req
        try:
            self.engine.submit_all(reqs, continuation=continuation)
            return None
        except (QueueFull, EngineStopped, ValueError) as e:
            for req in reqs:
                self.forget(conn, req)
            return (type(e).__name__, str(e))

    def _call(self, name: str, *args):
        engine = self.engine
        if name == "cache_report":
            return engine.cache_report(*args)
        if name == "health":
            return engine.health()
        if name == "queue_depth":
            return engine.queue_depth()
        if name == "metrics":
            engine.metrics.queue_depth.set(engine.queue_depth())
            return engine.metrics_text()
        if name == "idle":
            return engine.idle()
        if name == "timing":  # bench serve
            return engine.timing()
        raise ValueError(f"unknown call {name!r}")


@contextlib.contextmanager
def threaded_core(engine: Engine, tokenizer, config=None, backlog_mb: float = BACKLOG_MB):
    """`engine` served by an `EngineCore` on threads of this process, over a real Unix socket:
    yields a connected `serve.core.client.CoreClient` (tests: the wire path without a second process;
    `engine` is still at hand to inspect, the `EngineCore` as `client.core`, and where another
    connection reaches it as `client.core_address`)."""
    from .client import CoreClient

    address, authkey = new_address()
    directory = os.path.dirname(address)
    listener = Listener(address, "AF_UNIX", authkey=authkey)
    core = EngineCore(engine, listener, {}, backlog_mb)
    core.start(config)
    thread = threading.Thread(target=core.serve, name="ds4-core", daemon=True)
    thread.start()
    conn = Client(address, "AF_UNIX", authkey=authkey)
    client = CoreClient(conn, loads(conn.recv_bytes())[1], tokenizer)
    client.core, client.core_address = core, (address, authkey)
    try:
        yield client
    finally:
        core.stopping.set()
        thread.join(60)
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)


# --------------------------------------------------------------------------- the process
@dataclass
class CoreProcess:
    """A started engine core: the process and where to reach it."""
    proc: subprocess.Popen | None     # None in the API processes it did not start
    address: str
    authkey: bytes

    def connect(self, timeout: float = 60.0):
        """A connection to the core (waiting for it to listen); OSError if it died first."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise OSError(f"the engine core process exited with status {self.proc.returncode}")
            try:
                return Client(self.address, "AF_UNIX", authkey=self.authkey)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def wait(self, timeout: float) -> int:
        """Its exit status, killing it after `timeout` seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("engine core: did not exit within %.0f s; killing it", timeout)
            self.proc.kill()
            return self.proc.wait()
        finally:
            shutil.rmtree(os.path.dirname(self.address), ignore_errors=True)


def new_address() -> tuple[str, bytes]:
    """A fresh Unix socket path (in a directory of its own) and an authentication key."""
    return os.path.join(tempfile.mkdtemp(prefix="ds4-core-"), "core.sock"), secrets.token_bytes(32)


def spawn_core(args) -> CoreProcess:
    """Start `python -m serve.core.process` for parsed `serve` arguments (it loads the model itself)."""
    address, authkey = new_address()
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "serve.core.process"], stdin=subprocess.PIPE, env=env)
    proc.stdin.write(dumps(dict(args=args, address=address, authkey=authkey, parent=os.getpid())))
    proc.stdin.close()
    log.info("engine core: process %d", proc.pid)
    return CoreProcess(proc, address, authkey)


def main() -> int:
    payload = loads(sys.stdin.buffer.read())
    die_with_parent(payload["parent"])
    args = payload["args"]
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ds4_torch.runtime import UserError

    from . import setup

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the API process drains, then asks
    listener = Listener(payload["address"], "AF_UNIX", authkey=payload["authkey"])
    try:
        model, tokenizer, config = setup.load(args)
        engine = Engine.from_config(model, tokenizer, config)
        store = setup.attach_kv_store(engine, args)
    except UserError as e:
        _refuse(listener, str(e))
        return 2
    core = EngineCore(engine, listener, {}, args.api_backlog_mb)
    core.start(config, kv_budget=None if store is None else store.budget)
    signal.signal(signal.SIGTERM, lambda *_: core.stopping.set())
    core.serve()
    listener.close()
    return 0


def _refuse(listener: Listener, message: str, timeout: float = 30.0) -> None:
    """Tell the API process why the core cannot serve (a user error: bad flags for this model)."""
    def tell() -> None:
        try:
            conn = listener.accept()
            conn.send_bytes(dumps(("fatal", message)))
            conn.close()
        except OSError:
            pass

    teller = threading.Thread(target=tell, daemon=True)
    teller.start()
    teller.join(timeout)


if __name__ == "__main__":
    sys.exit(main())
