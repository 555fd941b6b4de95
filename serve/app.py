"""The Starlette app: OpenAI-compatible endpoints over one `Engine`.

Endpoints: POST /v1/chat/completions, POST /v1/completions (JSON or SSE streaming),
GET /v1/models, GET /health, GET /metrics (Prometheus), POST /tokenize, POST /detokenize.

How a generation request flows: the body is read (at most `max_body_bytes`, else 413), parsed
and checked (400 in OpenAI's error shape), then queued in the engine (429 when the queue is
full). The handler then waits on a per-request channel fed by the engine thread, polling
`request.is_disconnected()` every `disconnect_poll_interval` seconds; a client that went away
sets the request's cancel flag, which the engine checks at every prefill chunk and decode
token. A streaming request waits up to one keep-alive interval for its first event before
committing to a 200 SSE response, so a request that fails fast still gets a plain 503 with
Retry-After; after that it sends `: keep-alive` comments whenever nothing else was written for
`keepalive_interval` seconds (while queued and during a long prefill), and an engine failure
arrives as an SSE `error` event.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Engine, EngineStopped, GenRequest, QueueFull, TokenOut
from .metrics import Metrics
from .protocol import APIError, ParsedRequest, bad, fit_context, parse_chat, parse_completion, parse_json_object

log = logging.getLogger("ds4.serve")

CLIENT_CLOSED = 499  # nginx's "client closed request": only ever seen in metrics and logs


@dataclass
class ServerConfig:
    model_name: str = "ds4-default"
    model_aliases: tuple[str, ...] = ()
    ctx: int = 4096
    prefill_chunk: int = 256
    decode_mode: str = "auto"
    max_queue: int = 64
    max_batch: int = 8                    # sequences decoding together
    max_sessions: int | None = None       # conversations kept resident (default max(max_batch, 16))
    api_key: str | None = None
    kv_disk_dir: str | None = None        # the disk KV cache (serve.kvstore), attached by serve.cli
    kv_disk_space_mb: int | None = None
    keepalive_interval: float = 5.0       # seconds without output before a `: keep-alive` comment
    disconnect_poll_interval: float = 0.05
    max_body_bytes: int = 32 * 2**20      # larger bodies: 413


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Channel:
    """Events from the engine thread to one request's handler on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.event = asyncio.Event()

    def push(self, event: tuple) -> None:  # engine thread
        self.items.append(event)
        self.loop.call_soon_threadsafe(self.event.set)

    async def get(self, timeout: float) -> list[tuple]:
        if not self.items:
            try:
                await asyncio.wait_for(self.event.wait(), timeout)
            except asyncio.TimeoutError:  # a distinct class before Python 3.11, an alias after
                pass
        self.event.clear()  # before draining: a push racing with us leaves the event set
        out = []
        while self.items:
            out.append(self.items.popleft())
        return out


class TokenText:
    """Per-token strings and bytes for logprobs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = type(tokenizer).__name__ == "ByteTokenizer"

    @functools.lru_cache(maxsize=65536)
    def text(self, token_id: int) -> str:
        try:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        except TypeError:
            return self.tokenizer.decode([token_id])

    def bytes(self, token_id: int) -> list[int]:
        if self.byte_level:
            return [token_id]
        return list(self.text(token_id).encode("utf-8"))


def _usage(req: GenRequest) -> dict:
    n, g = len(req.prompt_ids), len(req.generated)
    return {"prompt_tokens": n, "completion_tokens": g, "total_tokens": n + g,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}


class Generation:
    """Formats one request's output as chat or completion objects."""

    def __init__(self, state: "AppState", parsed: ParsedRequest, req: GenRequest):
        self.s, self.p, self.req = state, parsed, req
        self.chat = parsed.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + req.id
        self.created = int(time.time())
        self.offset = 0  # text offset, for completions logprobs

    def _logprobs(self, outs: list[TokenOut]) -> dict | None:
        if self.p.logprobs is None:
            return None
        tt = self.s.token_text
        if self.chat:
            return {"content": [{
                "token": tt.text(o.token_id), "logprob": o.logprob, "bytes": tt.bytes(o.token_id),
                "top_logprobs": [{"token": tt.text(t), "logprob": lp, "bytes": tt.bytes(t)} for t, lp in o.top or ()],
            } for o in outs]}
        offsets = []
        for o in outs:
            offsets.append(self.offset)
            self.offset += len(o.text)
        return {"tokens": [tt.text(o.token_id) for o in outs], "token_logprobs": [o.logprob for o in outs],
                "top_logprobs": [{tt.text(t): lp for t, lp in o.top or ()} for o in outs]
                if self.p.logprobs > 0 else None,
                "text_offset": offsets}

    def _choice(self, text: str | None, outs: list[TokenOut], finish: str | None, delta: bool) -> dict:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            if delta:
                choice["delta"] = {} if text is None else {"content": text}
            else:
                choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self._logprobs(outs) if outs else None
        choice["finish_reason"] = finish
        if self.p.return_token_ids:
            choice["token_ids"] = [o.token_id for o in outs]
        return choice

    def _object(self, choices: list[dict], chunk: bool) -> dict:
        obj = "chat.completion" + (".chunk" if chunk else "") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.s.config.model_name,
                "system_fingerprint": None, "choices": choices}

    def response(self, outs: list[TokenOut]) -> dict:
        body = self._object([self._choice(self.req.text, outs, self.req.finish_reason, delta=False)], chunk=False)
        body["usage"] = _usage(self.req)
        if self.p.return_token_ids:
            body["prompt_token_ids"] = self.req.prompt_ids
        return body

    def _sse(self, obj: dict) -> bytes:
        if self.p.include_usage:
            obj["usage"] = None
        return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    def first_chunk(self) -> bytes:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice.update(delta={"role": "assistant", "content": ""}, logprobs=None, finish_reason=None)
        else:
            choice.update(text="", logprobs=None, finish_reason=None)
        obj = self._object([choice], chunk=True)
        if self.p.return_token_ids:
            obj["prompt_token_ids"] = self.req.prompt_ids
        return self._sse(obj)

    def token_chunk(self, out: TokenOut) -> bytes | None:
        if not out.text and self.p.logprobs is None and not self.p.return_token_ids:
            return None
        return self._sse(self._object([self._choice(out.text, [out], None, delta=True)], chunk=True))

    def final_chunks(self) -> bytes:
        choice = self._choice(None if self.chat else "", [], self.req.finish_reason, delta=True)
        data = self._sse(self._object([choice], chunk=True))
        if self.p.include_usage:
            usage = self._object([], chunk=True)
            usage["usage"] = _usage(self.req)
            data += b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n"
        return data + b"data: [DONE]\n\n"

    @staticmethod
    def error_event(e: APIError) -> bytes:
        return b"event: error\ndata: " + json.dumps(e.body()).encode() + b"\n\n"


class AppState:
    def __init__(self, model, tokenizer, config: ServerConfig, engine: Engine, metrics: Metrics):
        self.model, self.tokenizer, self.config, self.engine, self.metrics = model, tokenizer, config, engine, metrics
        self.token_text = TokenText(tokenizer)
        self.names = {config.model_name, *config.model_aliases}
        self.created = int(time.time())

    # ------------------------------------------------------------------ helpers
    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise bad(f"The model '{name}' does not exist; this server serves '{self.config.model_name}'",
                      "model", "model_not_found")

    async def read_json(self, request: Request) -> dict:
        limit = self.config.max_body_bytes
        too_big = APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                           code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise bad("invalid Content-Length header", code="invalid_header")
            if int(length) > limit:
                raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return parse_json_object(b"".join(chunks))

    def log_request(self, endpoint: str, status: int, req: GenRequest | None, stream: bool = False) -> None:
        if req is None:
            log.info("%s %d", endpoint, status)
            return
        now = time.perf_counter()
        start = req.t_start or now
        end = req.t_end or now
        first = req.t_first
        gen = len(req.generated)
        decode_s = (end - first) if first else 0.0
        rate = f" ({(gen - 1) / decode_s:.1f} tok/s)" if gen > 1 and decode_s > 0 else ""
        log.info("%s %d id=%s stream=%s prompt_tokens=%d cached_tokens=%d generated_tokens=%d finish=%s "
                 "queue=%.3fs prefill=%.3fs ttft=%s decode=%.3fs%s total=%.3fs attempts=%d",
                 endpoint, status, req.id, str(stream).lower(), len(req.prompt_ids), req.cached_tokens, gen,
                 req.finish_reason, start - req.t_arrival, ((first or end) - start),
                 f"{first - req.t_arrival:.3f}s" if first else "-", decode_s, rate, end - req.t_arrival,
                 req.attempts)

    # ------------------------------------------------------------------ generation
    async def generate(self, request: Request, kind: str) -> Response:
        endpoint = request.url.path
        try:
            body = await self.read_json(request)
            if kind == "chat":
                parsed = parse_chat(body, self.tokenizer)
            else:
                parsed = parse_completion(body, self.tokenizer, self.model.config.vocab_size)
            self.check_model(parsed.model)
            max_tokens = fit_context(parsed, self.config.ctx)
        except APIError as e:
            self.log_request(endpoint, e.status, None)
            raise
        channel = Channel(asyncio.get_running_loop())
        req = GenRequest(parsed.prompt_ids, max_tokens, sampling=parsed.sampling, stop=parsed.stop,
                         logprobs=parsed.logprobs, ignore_eos=parsed.ignore_eos, emit=channel.push)
        try:
            self.engine.submit(req)
        except QueueFull as e:
            self.log_request(endpoint, 429, req)
            raise APIError(429, f"{e}; retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineStopped as e:
            self.log_request(endpoint, 503, req)
            raise APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "5"}) from None
        gen = Generation(self, parsed, req)
        if parsed.stream:
            return await self._stream(request, endpoint, gen, channel)
        return await self._collect(request, endpoint, gen, channel)

    def _poll_interval(self, req: GenRequest) -> float:
        # While queued a disconnect costs nothing (the engine skips a cancelled request), so poll
        # slowly: many waiting requests polling fast would steal the GIL from the engine thread.
        poll = self.config.disconnect_poll_interval
        return max(poll, min(0.5, self.config.keepalive_interval / 4)) if req.state == "queued" else poll

    async def _wait(self, request: Request, req: GenRequest, channel: Channel, timeout: float):
        """Events within `timeout`; None when the client went away (the request is then cancelled)."""
        events = await channel.get(min(timeout, self._poll_interval(req)))
        if not events and await request.is_disconnected():
            self.engine.cancel(req)
            return None
        return events

    async def _collect(self, request: Request, endpoint: str, gen: Generation, channel: Channel) -> Response:
        req, outs, status = gen.req, [], CLIENT_CLOSED
        try:
            while True:
                events = await self._wait(request, req, channel, 3600.0)
                if events is None:
                    return Response(status_code=CLIENT_CLOSED)
                for kind, value in events:
                    if kind == "token":
                        outs.append(value)
                    elif kind == "done":
                        status = 200
                        return JSONResponse(gen.response(outs))
                    elif kind == "error":
                        status = value.status
                        raise value
                    elif kind == "cancelled":
                        return Response(status_code=CLIENT_CLOSED)
        finally:
            if not req.finished():
                self.engine.cancel(req)
            self.log_request(endpoint, status, req)

    async def _stream(self, request: Request, endpoint: str, gen: Generation, channel: Channel) -> Response:
        req = gen.req
        interval = max(self.config.keepalive_interval - self.config.disconnect_poll_interval, 0.01)
        # Wait (up to one keep-alive interval) for the first event before committing to 200.
        first: list[tuple] = []
        deadline = time.monotonic() + interval
        try:
            while not first and time.monotonic() < deadline:
                events = await self._wait(request, req, channel, deadline - time.monotonic())
                if events is None:
                    self.log_request(endpoint, CLIENT_CLOSED, req, stream=True)
                    return Response(status_code=CLIENT_CLOSED)
                first = events
        except BaseException:
            self.engine.cancel(req)
            raise
        if first and first[0][0] == "error":
            self.log_request(endpoint, first[0][1].status, req, stream=True)
            raise first[0][1]
        if first and first[0][0] == "cancelled":
            self.log_request(endpoint, CLIENT_CLOSED, req, stream=True)
            return Response(status_code=CLIENT_CLOSED)

        async def body():
            pending = list(first)
            last_write = time.monotonic()
            last_poll = last_write
            started = False
            outcome = CLIENT_CLOSED
            try:
                if not pending:
                    yield b": keep-alive\n\n"
                while True:
                    now = time.monotonic()
                    if not pending or now - last_poll >= self._poll_interval(req):
                        if await request.is_disconnected():
                            self.engine.cancel(req)
                            return
                        last_poll = now
                    if not pending:
                        pending = await channel.get(min(self._poll_interval(req),
                                                        max(0.0, interval - (now - last_write))))
                    out, done = [], False
                    for kind, value in pending:
                        if kind == "token":
                            if not started:
                                out.append(gen.first_chunk())
                                started = True
                            data = gen.token_chunk(value)
                            if data is not None:
                                out.append(data)
                        elif kind == "done":
                            if not started:
                                out.append(gen.first_chunk())
                            out.append(gen.final_chunks())
                            outcome, done = 200, True
                        elif kind == "error":
                            out.append(gen.error_event(value))
                            outcome, done = value.status, True
                        elif kind == "cancelled":
                            done = True
                    pending = []
                    now = time.monotonic()
                    if out:
                        yield b"".join(out)
                        last_write = now
                    elif now - last_write >= interval:
                        yield b": keep-alive\n\n"
                        last_write = now
                    if done:
                        return
            finally:
                if not req.finished():
                    self.engine.cancel(req)
                self.log_request(endpoint, outcome, req, stream=True)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ small endpoints
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "ds4_torch",
            "max_model_len": self.config.ctx}]})

    async def health(self, request: Request) -> Response:
        reason = self.engine.health()
        if reason is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "degraded", "reason": reason}, status_code=503,
                            headers={"Retry-After": str(self.engine.retry_after_s)})

    async def metrics_text(self, request: Request) -> Response:
        self.metrics.queue_depth.set(self.engine.queue_depth())
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def tokenize(self, request: Request) -> Response:
        body = await self.read_json(request)
        allowed = {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens"}
        unknown = set(body) - allowed
        if unknown:
            raise bad(f"Unrecognized request argument supplied: {sorted(unknown)[0]}", sorted(unknown)[0],
                      "unknown_parameter")
        self.check_model(body.get("model"))
        if ("prompt" in body) == ("messages" in body):
            raise bad("send exactly one of 'prompt' (a string) or 'messages' (a chat)", "prompt",
                      "missing_required_parameter")
        if "prompt" in body:
            if not isinstance(body["prompt"], str):
                raise bad("'prompt' must be a string", "prompt", "invalid_type")
            add_special = body.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise bad("'add_special_tokens' must be a boolean", "add_special_tokens", "invalid_type")
            ids = self.tokenizer.encode(body["prompt"], add_special_tokens=add_special)
        else:
            agp = body.get("add_generation_prompt", True)
            if not isinstance(agp, bool):
                raise bad("'add_generation_prompt' must be a boolean", "add_generation_prompt", "invalid_type")
            chat = {"messages": body["messages"]}
            ids = parse_chat(chat, self.tokenizer).prompt_ids if agp else None
            if ids is None:
                try:
                    ids = self.tokenizer.encode_chat(body["messages"], add_generation_prompt=False)
                except ValueError as e:
                    raise bad(str(e), "messages") from None
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.config.ctx})

    async def detokenize(self, request: Request) -> Response:
        body = await self.read_json(request)
        unknown = set(body) - {"model", "tokens"}
        if unknown:
            raise bad(f"Unrecognized request argument supplied: {sorted(unknown)[0]}", sorted(unknown)[0],
                      "unknown_parameter")
        self.check_model(body.get("model"))
        ids = body.get("tokens")
        vocab = self.model.config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad("'tokens' must be an array of token ids", "tokens", "invalid_type")
        if any(not 0 <= t < vocab for t in ids):
            raise bad(f"'tokens' holds an id outside the vocabulary [0, {vocab})", "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(ids)})


def create_app(model, tokenizer, config: ServerConfig | None = None, kv_store=None) -> Starlette:
    """The server app for `model`; its engine thread starts and stops with the app's lifespan.
    `app.state.engine`, `app.state.metrics` and `app.state.config` are there for tests and tools."""
    config = config or ServerConfig()
    metrics = Metrics()
    engine = Engine(model, tokenizer, ctx=config.ctx, prefill_chunk=config.prefill_chunk,
                    decode_mode=config.decode_mode, max_queue=config.max_queue, max_batch=config.max_batch,
                    max_sessions=config.max_sessions, metrics=metrics, kv_store=kv_store)
    state = AppState(model, tokenizer, config, engine, metrics)

    def endpoint(name: str, fn, auth: bool = True):
        async def handler(request: Request) -> Response:
            try:
                if auth:
                    state.check_auth(request)
                response = await fn(request)
            except APIError as e:
                response = error_response(e)
            except ClientDisconnect:
                response = Response(status_code=CLIENT_CLOSED)
            except Exception as e:  # noqa: BLE001 - a bug of ours: 500 in the same shape
                log.exception("%s: internal error", name)
                response = error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                                   code="internal_error"))
            metrics.requests.labels(endpoint=name, code=str(response.status_code)).inc()
            return response
        return handler

    routes = [
        Route("/v1/chat/completions", endpoint("/v1/chat/completions", lambda r: state.generate(r, "chat")),
              methods=["POST"]),
        Route("/v1/completions", endpoint("/v1/completions", lambda r: state.generate(r, "completion")),
              methods=["POST"]),
        Route("/v1/models", endpoint("/v1/models", state.models), methods=["GET"]),
        Route("/health", endpoint("/health", state.health, auth=False), methods=["GET"]),
        Route("/metrics", endpoint("/metrics", state.metrics_text, auth=False), methods=["GET"]),
        Route("/tokenize", endpoint("/tokenize", state.tokenize), methods=["POST"]),
        Route("/detokenize", endpoint("/detokenize", state.detokenize), methods=["POST"]),
    ]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       code=code))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        log.info("serving %s: ctx %d, prefill chunk %d, decode mode %s, max batch %d, %d resident sessions, "
                 "max queue %d%s; KV cache %.1f MiB (%d resident + %d batch slots x %.2f MiB at ctx %d)",
                 config.model_name, config.ctx, config.prefill_chunk, engine.decoder.mode, engine.max_batch,
                 engine.max_sessions, config.max_queue, ", API key required" if config.api_key else "",
                 engine.cache_bytes / 2**20, engine.resident.batch_size, engine.batch.batch_size,
                 engine.resident.nbytes / engine.resident.batch_size / 2**20, config.ctx)
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.config = config
    app.state.server = state
    return app
