"""The API process's side of an engine core in another process (serve.core.process): `CoreClient`, an
`EngineClient` (serve.engine.loop) the app talks to as it would to an `Engine`.

Requests go to the core as token ids and settings (serve.core.wire); what comes back, one message per
engine iteration, is turned into text here by the output part (serve.engine.output.Output, on this
client's reader thread: detokenizing, stop strings, the events of each request's channel), so
none of that costs the engine's process anything. A stop string found here is sent back ("stop
after token k"); the core ends the request at its next iteration.

The core dying (its connection closes) answers every open request 503 and calls `on_lost`
(serve.cli ends the server with status 1).
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time

from serve.engine.loop import EngineStopped, QueueFull, SHUTDOWN_SAVE_S
from serve.metrics import Metrics
from serve.engine.output import End, Output, PromptLogprobs, Token
from serve.errors import APIError
from serve.engine.sequence import GenRequest, TokenOut
from .wire import dumps, error_fields, error_from, loads, request_bytes, set_stats

log = logging.getLogger("ds4.serve")

CALL_TIMEOUT_S = 30.0        # a call the core does not answer within this fails (503)
SUBMIT_ERRORS = {"QueueFull": QueueFull, "EngineStopped": EngineStopped, "ValueError": ValueError}


class CoreLost(Exception):
    pass


class CoreClient:
    """An engine core reached over `conn` (a multiprocessing Connection, after its hello)."""

    retry_after_s = 1
    warm = True   # the core says hello once warm

    def __init__(self, conn, info: dict, tokenizer, owner: bool = True):
        self.conn, self.info, self.tokenizer = conn, info, tokenizer
        self.owner = owner                              # its stop() drains the core (the others only leave)
        self.before_stop = lambda: None                 # the owner: the other API processes end first
        self.config = info["config"]
        self.metrics = Metrics()
        self.output = Output(tokenizer, self.metrics)   # not started: runs on the reader thread
        self.requests: dict[str, GenRequest] = {}
        self.on_lost = lambda reason: None
        self.lost: str | None = None
        self._stopping = False
        self._died = False
        self._send_lock = threading.Lock()
        self._calls: dict[int, list] = {}               # call id -> [event, value, error]
        self._call_ids = itertools.count(1)
        self._stops_sent: set[str] = set()
        self._structured = None
        self._structured_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self.cpu_s = 0.0                                # the reader thread's CPU time (bench serve)

    @classmethod
    def connect(cls, core, tokenizer, timeout: float = 600.0, owner: bool = True) -> "CoreClient":
        """Connect to a `serve.core.process.CoreProcess` and wait for its hello (the model loaded and
        warm); RuntimeError with the core's reason when it cannot serve."""
        conn = core.connect(timeout)
        try:
            message = loads(conn.recv_bytes())
        except (EOFError, OSError):
            status = "unknown" if core.proc is None else core.proc.wait(30)
            raise RuntimeError(f"the engine core process exited while starting (status {status})") from None
        if message[0] == "fatal":
            raise RuntimeError(message[1])
        return cls(conn, message[1], tokenizer, owner)

    # ------------------------------------------------------------------ EngineClient
    @property
    def alive(self) -> bool:
        return self.lost is None and self._reader is not None and self._reader.is_alive()

    def start(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name="ds4-core-client", daemon=True)
            self._reader.start()

    @property
    def died(self) -> bool:
        """The core went away without being asked to (the server then exits with status 1)."""
        return self._died

    def stop(self, timeout: float = SHUTDOWN_SAVE_S + 10) -> None:
        """The owner: ask the core to drain (its requests answered, conversations saved) and wait
        for it; another API process: leave (the core cancels what is still open)."""
        if self._stopping:
            return
        self._stopping = True
        if not self.owner:
            self._hang_up()
            if self._reader is not None:
                self._reader.join(timeout)
            return
        self.before_stop()
        try:
            self._send(("shutdown",))
        except CoreLost:
            pass
        if self._reader is not None:
            self._reader.join(timeout)
        self.conn.close()

    def describe(self) -> str:
        return f"{self.info['describe']} (engine core: process {self.info['pid']})"

    def kv_event_info(self) -> dict:
        return self.info["kv_events"]

    def structured_outputs(self):
        """The `StructuredOutputs` of this tokenizer: the grammars built here travel as their spec."""
        with self._structured_lock:
            if self._structured is None:
                from ds4_torch.structured import StructuredOutputs

                self._structured = StructuredOutputs(self.tokenizer, self.info["vocab_size"])
            return self._structured

    def submit(self, req: GenRequest) -> None:
        self.submit_all([req])

    def submit_all(self, reqs: list[GenRequest], continuation: bool = False) -> None:
        if self.lost is not None:
            raise EngineStopped(f"the engine core process is gone ({self.lost})")
        items = [request_bytes(r) for r in reqs]
        for r in reqs:  # known before the core answers: its first records may come before the reply
            self.requests[r.id] = r
        try:
            error = self._call("submit", items, continuation)
        except CoreLost as e:
            error = ("EngineStopped", str(e))
        if error is None:
            for r in reqs:
                if r.state == "new":
                    r.state = "queued"
            return
        for r in reqs:
            self.requests.pop(r.id, None)
        kind, detail = error
        if kind == "error":
            raise error_from(detail)
        raise SUBMIT_ERRORS[kind](detail)

    def cancel(self, req: GenRequest) -> None:
        req.cancel.set()
        if req.id in self.requests:
            try:
                self._send(("cancel", req.id))
            except CoreLost:
                pass

    def health(self) -> str | None:
        if self.lost is not None:
            return f"the engine core process is gone ({self.lost})"
        try:
            return self._call("call", "health", timeout=5.0)
        except CoreLost as e:
            return str(e)

    def queue_depth(self) -> int:
        try:
            return self._call("call", "queue_depth", timeout=5.0)
        except CoreLost:
            return 0

    def timing(self) -> dict:
        """The core's `Engine.timing()`, and `api_cpu_s`: this process's reader thread (the
        output part, detokenizing), in CPU seconds (bench serve)."""
        return {**self._call("call", "timing"), "api_cpu_s": self.cpu_s}

    def cache_report(self, request_id: str) -> dict | None:
        """The core's report of what a recent request reused (`Engine.cache_report`)."""
        return self._call("call", "cache_report", request_id, timeout=5.0)

    def idle(self) -> bool:
        return not self.requests and self._call("call", "idle")

    def metrics_text(self) -> bytes:
        """This process's metrics (HTTP, tokens out, latency) merged with the core's."""
        local = self.metrics.render()
        try:
            core = self._call("call", "metrics", timeout=5.0)
        except CoreLost:
            return local
        return merge_metrics(core, local)

    # ------------------------------------------------------------------ the connection
    def _hang_up(self) -> None:
        """Close the connection both ways: the reader thread, blocked in a read, sees its end."""
        try:
            sock = socket.socket(fileno=os.dup(self.conn.fileno()))
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        except OSError:
            pass

    def _send(self, message) -> None:
        data = dumps(message)
        with self._send_lock:
            if self.lost is not None:
                raise CoreLost(self.lost)
            try:
                self.conn.send_bytes(data)
            except OSError as e:
                raise CoreLost(f"{type(e).__name__}: {e}") from None

    def _call(self, kind: str, *fields, timeout: float = CALL_TIMEOUT_S):
        call = next(self._call_ids)
        slot = self._calls[call] = [threading.Event(), None, None]
        try:
            self._send((kind, call, *fields))
            if not slot[0].wait(timeout):
                raise CoreLost(f"the engine core did not answer within {timeout:.0f} s")
        finally:
            self._calls.pop(call, None)
        if slot[2] is not None:
            raise CoreLost(slot[2])
        return slot[1]

    def _read(self) -> None:
        reason = "its connection closed"
        while True:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                break
            c0 = time.thread_time()
            try:
                message = loads(data)
                kind = message[0]
                if kind == "step":
                    self._step(*message[1:])
                elif kind == "reply":
                    slot = self._calls.get(message[1])
                    if slot is not None:
                        slot[1], slot[2] = message[2], message[3]
                        slot[0].set()
                elif kind == "dropped":
                    self._dropped(message[1])
                elif kind == "bye":  # the core stopped (its process may live on: rank 0 under --tp)
                    reason = "it stopped"
                    break
                else:
                    log.warning("core client: unknown message %r", kind)
            except Exception:  # noqa: BLE001 - one bad message: logged, the others go on
                log.exception("core client: a message from the engine core could not be handled")
            self.cpu_s += time.thread_time() - c0
        self._lost(reason)

    def _step(self, seq: int, ack: bool, records: list) -> None:
        batch, touched = [], []
        for rec in records:
            req = self.requests.get(rec[1])
            if req is None:
                continue
            try:
                kind = rec[0]
                if kind == "t":
                    _, _, token, end, logprob, top, sampled_at = rec
                    req.generated.append(token)
                    batch.append(Token(req, token, end, logprob, top, sampled_at))
                    touched.append(req)
                elif kind == "s":
                    req.state, req.cached_tokens, req.t_start, req.cache_report = "running", *rec[2:5]
                elif kind == "p":
                    outs = [TokenOut(t, "", lp, top) for t, lp, top in rec[2]]
                    req.prompt_logprob_outs = outs
                    batch.append(PromptLogprobs(req, outs))
                elif kind == "e":
                    _, rid, outcome, reason, error, stage, values = rec
                    set_stats(req, values)
                    del self.requests[rid]
                    self._stops_sent.discard(rid)
                    batch.append(End(req, outcome, reason, None if error is None else error_from(error), stage))
                else:
                    raise ValueError(f"unknown record {kind!r}")
            except Exception as e:  # noqa: BLE001 - this request's record is bad: it fails alone
                log.exception("core client: a record of %s could not be read", req.id)
                self._fail(req, APIError(500, f"a message of this request from the engine core could not be read "
                                              f"({type(e).__name__}: {e})", code="internal_error"))
        self.output.put(batch)
        for req in touched:  # a stop string (or a failure to detokenize) found here ends it in the core
            if req.stop_found.is_set() and req.id in self.requests and req.id not in self._stops_sent:
                self._stops_sent.add(req.id)
                self._quietly(("stop", req.id, req.stop_at,
                               None if req.failure is None else error_fields(req.failure)))
        if ack:
            self._quietly(("ack", seq))

    def _dropped(self, ids: list[str]) -> None:
        """This process fell behind the core's output (stopped, or too slow to read it): the core
        dropped these requests' records and cancelled them. Each fails with a 503 (an SSE error
        event once streaming), never with the gap in its text."""
        failed = [req for req in (self.requests.pop(rid, None) for rid in ids) if req is not None]
        log.warning("core client: this API process fell behind the engine core's output; %d request(s) cancelled",
                    len(failed))
        error = APIError(503, "the server fell behind in sending this reply and cancelled it; retry",
                         code="api_process_behind", headers={"Retry-After": str(self.retry_after_s)})
        for req in failed:
            self._stops_sent.discard(req.id)
        self.output.put([End(req, "failed", error=error) for req in failed])

    def _quietly(self, message) -> None:
        try:
            self._send(message)
        except CoreLost:
            pass

    def _fail(self, req: GenRequest, error: APIError) -> None:
        self.requests.pop(req.id, None)
        self._quietly(("cancel", req.id))
        self.output.put([End(req, "failed", error=error)])

    def _lost(self, reason: str) -> None:
        """The core is gone: every open request answered 503, pending calls failed, `on_lost`."""
        with self._send_lock:
            self.lost = reason
        for slot in list(self._calls.values()):
            slot[2] = f"the engine core process is gone ({reason})"
            slot[0].set()
        if self._stopping:
            error = APIError(503, "the server is shutting down", code="server_shutting_down",
                             headers={"Retry-After": str(self.retry_after_s)})
        else:
            self._died = True
            log.error("core client: the engine core process is gone (%s); failing %d open request(s)", reason,
                      len(self.requests))
            error = APIError(503, "the engine core process exited; the server is exiting", code="engine_unavailable",
                             headers={"Retry-After": str(self.retry_after_s)})
        open_requests, self.requests = list(self.requests.values()), {}
        self.output.put([End(req, "failed", error=error) for req in open_requests])
        if not self._stopping:
            self.on_lost(reason)


def merge_metrics(core: bytes, local: bytes) -> bytes:
    """One exposition of two processes' registries of the same metrics (serve.metrics): counters
    and histograms summed; gauges are the core's (the API process sets none of its own)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, object] = {}
    samples: dict[str, dict] = {}
    for text, own in ((core, True), (local, False)):
        for fam in text_string_to_metric_families(text.decode()):
            if fam.name not in families:
                families[fam.name] = fam
                samples[fam.name] = {}
            elif fam.type == "gauge":
                continue
            merged = samples[fam.name]
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                have = merged.get(key)
                merged[key] = s if have is None else have._replace(value=have.value + s.value)
    for name, fam in families.items():
        fam.samples = list(samples[name].values())

    class Families:
        @staticmethod
        def collect():
            return families.values()

    return generate_latest(Families)
