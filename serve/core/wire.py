"""What travels between an API process (serve.core.client) and the engine core (serve.core.process).

One connection per API process: a Unix socket (`multiprocessing.connection`, authenticated with
a per-server key), each message one pickled tuple. Measured against pyzmq 27.3 (PAIR over ipc)
with msgpack 1.2.4 or pickle, between two processes, a step message of 16 token records and its
ack: 45 us round trip and 13 us of the sender's CPU here, against 150 us / 27 us (zmq+msgpack)
and 141 us / 25 us (zmq+pickle); 64 records: 84 / 19 against 223 / 46 and 181 / 35. And a closed
connection tells each side at once that the other process died, which ZMQ does not. So no new
dependency.

API process -> core:
  ("submit", call, [request bytes], continuation)   answered ("reply", call, None | error)
  ("cancel", id)                                     the client left
  ("stop", id, k, error | None)                      a stop string ends the reply at its k-th token
                                                     (or detokenizing it failed: `error`)
  ("ack", seq)                                       step message `seq` was processed
  ("call", call, name, *args)                        health, queue_depth, metrics, cache_report (a request
                                                     id): ("reply", call, value)
  ("shutdown",)                                      drain, save the conversations, exit
core -> API process:
  ("hello", info)                                    once, when the engine is built
  ("step", seq, ack, [record])                       one per engine iteration; `ack`: answer it
  ("reply", call, value, error | None)
  ("dropped", [id])                                  these requests' output was dropped (the API process
                                                     left too much unread) and the core cancelled them
Records: ("t", id, token, end, logprob, top, sampled_at), ("e", id, outcome, reason, error, stage,
stats), ("p", id, [(token, logprob, top)]), ("s", id, cached_tokens, t_start, cache_report). `perf_counter`
times are comparable across processes (CLOCK_MONOTONIC on Linux).

A request travels as its `GenRequest` fields: the whole `SamplingParams` as it is, grammars as
their compiled llguidance spec (the core builds its own `Grammar` from it).
"""
from __future__ import annotations

import pickle

from serve.errors import APIError
from serve.engine.sequence import GenRequest

BACKLOG_MB = 16.0   # --api-backlog-mb: the core's output queued for an API process not reading it, at most

# The counters of a request the engine writes and the client reads (the log line, usage).
STATS = ("cached_tokens", "prefilled_tokens", "prefill_chunks", "attempts", "draft_tokens", "accepted_drafts",
         "t_start")


def dumps(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes):
    return pickle.loads(data)


def request_bytes(req: GenRequest) -> bytes:
    trigger = req.after_trigger
    return dumps(dict(
        id=req.id, prompt_ids=list(req.prompt_ids), max_tokens=req.max_tokens, sampling=req.sampling,
        stop=list(req.stop), logprobs=req.logprobs, ignore_eos=req.ignore_eos, prompt_logprobs=req.prompt_logprobs,
        grammar=None if req.grammar is None else req.grammar.spec,
        after_trigger=None if trigger is None else (trigger.trigger, trigger.grammar.spec),
        tenant=req.tenant, boundaries=tuple(req.boundaries), t_arrival=req.t_arrival))


def request_from(data: bytes, structured) -> GenRequest:
    """The core's `GenRequest` for `request_bytes`; `structured()`: the core's StructuredOutputs."""
    from ds4_torch.structured import Grammar, Triggered

    fields = loads(data)
    grammar, trigger = fields.pop("grammar"), fields.pop("after_trigger")
    req = GenRequest(**fields)
    if grammar is not None:
        req.grammar = Grammar(structured(), grammar)
    if trigger is not None:
        req.after_trigger = Triggered(trigger[0], Grammar(structured(), trigger[1]))
    return req


def error_fields(e: APIError) -> tuple:
    return (e.status, e.message, e.param, e.code, e.type, dict(e.headers))


def error_from(fields: tuple) -> APIError:
    status, message, param, code, type_, headers = fields
    return APIError(status, message, param=param, code=code, type=type_, headers=headers)


def stats(req: GenRequest) -> tuple:
    return tuple(getattr(req, name) for name in STATS)


def set_stats(req: GenRequest, values: tuple) -> None:
    for name, value in zip(STATS, values):
        setattr(req, name, value)
