"""The Starlette app: three APIs over one `Engine`.

Endpoints: POST /v1/chat/completions and /v1/completions (OpenAI, `serve.http.openai_api`),
POST /v1/responses (OpenAI Responses, `serve.http.responses_api`), POST /v1/messages and
/v1/messages/count_tokens (Anthropic, `serve.http.anthropic_api`), GET /v1/models, GET /health (and
/api/hello, Claude Code's connectivity check), GET /metrics (Prometheus), POST /tokenize, POST /detokenize,
GET /v1/cache/explain/{request_id} (what a recent request reused and why not more: `serve.http.cache_explain`).
For routers in front of several replicas (docs/scaling-out.md): POST /v1/chat/completions/render,
/v1/completions/render and /v1/responses/render (the prompt's token ids, as vLLM's), GET
/get_server_info and /kv_event_sources (this run's id, the KV block size, where `--kv-events` publishes).

Each API module only translates: its JSON into one internal request (`serve.http.chat`), and the
internal events of the `Generation` back into its JSON or SSE (a "view" with `start`, `feed`,
`error` and `body`). This module holds what they share: authentication (``Authorization:
Bearer`` or ``x-api-key``), the body limit, the model check, and `respond`, the one loop between
a generation and the HTTP response. An `APIError` raised anywhere is answered in the shape of the
API whose route received the request.

How a generation request flows: the body is read (at most `max_body_bytes`, else 413), parsed
and checked (400), then queued in the engine (429 when the queue is full). The handler then
waits for events, polling `request.is_disconnected()` every `disconnect_poll_interval` seconds;
a client that went away cancels the request, which the engine checks at every prefill chunk and
decode token. A streaming request waits up to one keep-alive interval for its first event
before committing to a 200 SSE response, so a request that fails fast still gets a plain 503
with Retry-After; after that it sends `: keep-alive` comments whenever nothing else was written
for `keepalive_interval` seconds (while queued and during a long prefill), and an engine
failure arrives as the API's SSE error event.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ds4_torch.sampling import stop_token_ids

from . import anthropic_api
from . import cache_explain
from . import openai_api
from . import responses_api
from .chat import TENANT, Cancelled, Failed, Generation, chat_prompt, dsml_tokens, encode_conversation, tenant_of
from serve.engine.loop import Engine, EngineClient
from .guard import BrowserGuard
from serve.metrics import Metrics
from .protocol import APIError, bad, parse_json_object, type_name
from .request_policy import LIMITS, ignore_unknown
from .replay import ReplayStore

log = logging.getLogger("ds4.serve")

CLIENT_CLOSED = 499  # nginx's "client closed request": only ever seen in metrics and logs

# uvicorn's HTTP parser, whatever else is installed: h11 refuses a request whose headers pass
# 16 KB with a 400; httptools, which uvicorn takes by default when present, passed a 1 MB header
# and 20,000 headers to the app, and measured no faster here (`bench serve`, 16 streams, three
# paired runs). The event loop is uvicorn's choice: uvloop when installed (a dependency).
HTTP_PARSER = "h11"


@dataclass
class ServerConfig:
    model_name: str = "ds4-default"
    model_aliases: tuple[str, ...] = ()
    served_model_names: tuple[str, ...] = ()  # more names /v1/models lists
    strict_model_name: bool = False       # True: a model name not served is a 400 (404 on /v1/models/{id})
    access_log: bool = True               # one line per request, rejected ones included
    host: str = "127.0.0.1"               # where it is bound: on loopback, Host must name loopback (serve.http.guard)
    allowed_hosts: tuple[str, ...] = ()   # more Host names to answer
    cors_origins: tuple[str, ...] = ()    # browser origins given CORS headers (none by default)
    ctx: int = 4096
    prefill_chunk: int = 256
    decode_mode: str = "auto"
    max_queue: int = 64
    max_batch: int = 8                    # sequences decoding together
    max_sessions: int | None = None       # conversations kept resident (default max(max_batch, 16))
    api_key: str | tuple[str, ...] | None = None   # one key, or several: each its own tenant (no reuse across them)
    checkpoint_interval: int = 256        # a cache checkpoint every N tokens of prefill and decode (0: none)
    checkpoint_memory_mb: float = 1024    # memory for checkpoints (LRU; message boundaries kept longest)
    kv_cache_mb: float | None = None      # the KV pool (None: blocks for every slot at ctx)
    kv_block_tokens: int = 256            # tokens of context per KV block
    kv_rows: str = "full"                 # how compressed rows are stored (ds4_torch.kv_format): --kv-dtype
    speculative_tokens: int = 0           # MTP drafts verified per decode step (0: no speculation)
    speculative_max_batch: int | None = None  # speculate only while at most this many decode (None: always)
    speculative_policy: str = "always"    # "always", or "auto": the kind of step measured faster (serve.engine.speculation)
    # Tool calls kept to what is offered: a block names offered tools only (serve.http.chat.offered_calls_grammar),
    # and none opens when no tools are offered (serve.http.chat.no_calls_sampling). False: --free-tool-calls.
    tool_call_grammar: bool = True
    kv_disk_dir: str | None = None        # the disk KV cache (serve.kvstore.store), attached by serve.cli;
                                          # exact-replay records (serve.http.replay) persist there too
    kv_disk_space_mb: int | None = None
    keepalive_interval: float = 5.0       # seconds without output before a `: keep-alive` comment
    disconnect_poll_interval: float = 0.05
    max_body_bytes: int = 32 * 2**20      # larger bodies: 413
    kv_events: str | None = None          # publish the KV pool's blocks there, vLLM's format (serve.engine.kv_events)
    kv_events_replay: str | None = None   # and answer replay requests there


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


class AppState:
    def __init__(self, model, tokenizer, config: ServerConfig, engine: EngineClient, metrics: Metrics,
                 replay: ReplayStore | None):
        self.model, self.tokenizer, self.config, self.engine, self.metrics = model, tokenizer, config, engine, metrics
        self.replay = replay
        self.eos_ids = frozenset(stop_token_ids(model.config, tokenizer))
        self.token_text = TokenText(tokenizer)
        if config.tool_call_grammar:
            dsml_tokens(tokenizer)  # the vocabulary decoded once now, not on the first request's time
        self.names = {config.model_name, *config.model_aliases, *config.served_model_names}
        self.created = int(time.time())

    # ------------------------------------------------------------------ checks
    def api_keys(self) -> tuple[str, ...]:
        key = self.config.api_key
        return (key,) if isinstance(key, str) else tuple(k for k in key or () if k)

    def check_auth(self, request: Request) -> None:
        """401 unless a key is required and given; the key given is the request's tenant (with
        several keys: prefix reuse and exact replay never cross keys; with one, one tenant)."""
        keys = self.api_keys()
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        offered = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        # Every key is compared (no early exit): the time taken does not tell which one is close.
        matches = [hmac.compare_digest(offered.encode(), k.encode()) for k in keys]
        if any(matches) and len(keys) > 1:
            TENANT.set(tenant_of(offered))
        if not any(matches):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           code="invalid_api_key", type="authentication_error", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, name: str | None) -> None:
        """One model answers to any name (as llama.cpp's server does; replies echo the name asked
        for), unless `strict_model_name`."""
        if name is not None and not isinstance(name, str):
            raise bad(f"'model' must be a string, got {type_name(name)}", "model", "invalid_type")
        if self.config.strict_model_name and name is not None and name not in self.names:
            raise bad(self.unknown_model(name), "model", "model_not_found")

    def unknown_model(self, name: str) -> str:
        """What a model name not served gets told: every name /v1/models lists."""
        served = ", ".join(f"'{n}'" for n in dict.fromkeys([self.config.model_name, *self.config.served_model_names]))
        return f"The model '{name}' does not exist; this server serves {served} (GET /v1/models lists them)"

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
        raw = b"".join(chunks)
        # Parsing costs per value, holding the GIL: bound the values (the commas) before it.
        if raw.count(b",") > LIMITS["array_items"]:
            raise bad(f"the request body holds more than {LIMITS['array_items']} values; this server takes at most "
                      f"that many", code="too_large")
        body = parse_json_object(raw)
        request.state.model = body.get("model")
        return body

    def access(self, request: Request, status: int, details: str = "", error: str | None = None) -> None:
        """The access log's line for `request` (once): client, method, path, status, duration,
        and what went wrong for a rejected one."""
        if not self.config.access_log or getattr(request.state, "logged", False):
            return
        request.state.logged = True
        client = f"{request.client.host}:{request.client.port}" if request.client else "-"
        took = time.perf_counter() - getattr(request.state, "t_start", time.perf_counter())
        line = f'{client} "{request.method} {request.url.path}" {status} {took:.3f}s'
        model = getattr(request.state, "model", None)
        if isinstance(model, str):
            line += " model=" + json.dumps(model[:200], ensure_ascii=False)
        if details:
            line += " " + details
        if error is not None:
            line += " error=" + json.dumps(error[:500], ensure_ascii=False)
        (log.warning if status >= 500 else log.info)("%s", line)

    def log_request(self, request: Request, status: int, gen: Generation | None, stream: bool = False,
                    error: str | None = None) -> None:
        req = gen.request if gen is not None else None
        if req is None:
            self.access(request, status, error=error)
            return
        first_req = gen.requests[0]
        now = time.perf_counter()
        start = first_req.t_start or now
        end = req.t_end or now
        first = first_req.t_first
        n = len(gen.generated)
        decode_s = (end - first) if first else 0.0
        rate = f" ({(n - 1) / decode_s:.1f} tok/s)" if n > 1 and decode_s > 0 else ""
        self.access(request, status, (
            f"id={first_req.id} stream={str(stream).lower()} "
            f"prompt_tokens={len(first_req.prompt_ids)} cached_tokens={first_req.cached_tokens} "
            f"recomputed_tokens={sum(r.prefilled_tokens for r in gen.requests)} generated_tokens={n} "
            f"finish={gen.done.finish if gen.done else req.finish_reason} tool_calls={len(gen.calls)} "
            f"queue={start - first_req.t_arrival:.3f}s prefill={(first or end) - start:.3f}s "
            f"ttft={f'{first - first_req.t_arrival:.3f}s' if first else '-'} decode={decode_s:.3f}s{rate} "
            f"total={end - first_req.t_arrival:.3f}s attempts={req.attempts}{self._speculation(gen)}"
            f"{cache_explain.log_fields(first_req.cache_report, self.tokenizer)}"), error=error)

    @staticmethod
    def _speculation(gen: Generation) -> str:
        """The request log's speculation fields (when the engine speculated for it)."""
        drafted = sum(r.draft_tokens for r in gen.requests)
        if not drafted:
            return ""
        accepted = sum(r.accepted_drafts for r in gen.requests)
        return f" draft_tokens={drafted} accepted_drafts={accepted} acceptance={accepted / drafted:.2f}"

    # ------------------------------------------------------------------ one generation -> one response
    def _poll_interval(self, gen: Generation) -> float:
        # While queued a disconnect costs nothing (the engine skips a cancelled request), so poll
        # slowly: many waiting requests polling fast would steal the GIL from the engine thread.
        poll = self.config.disconnect_poll_interval
        return max(poll, min(0.5, self.config.keepalive_interval / 4)) if gen.queued else poll

    async def _wait(self, request: Request, gen: Generation, timeout: float):
        """Events within `timeout`; None when the client went away (the generation is then cancelled)."""
        events = await gen.next_events(min(timeout, self._poll_interval(gen)))
        if not events and await request.is_disconnected():
            gen.cancel()
            return None
        return events

    async def respond(self, request: Request, gen: Generation, make_view: Callable, stream: bool) -> Response:
        """Queue `gen` in the engine and answer with the view `make_view()` builds: a JSON body
        once it is done, or an SSE stream."""
        try:
            gen.submit()
        except APIError as e:
            self.log_request(request, e.status, gen, error=e.message)
            raise
        view = make_view()
        if stream:
            return await self._stream(request, gen, view)
        return await self._collect(request, gen, view)

    async def _collect(self, request: Request, gen: Generation, view) -> Response:
        status, error = CLIENT_CLOSED, None
        try:
            while True:
                events = await self._wait(request, gen, 3600.0)
                if events is None:
                    return Response(status_code=CLIENT_CLOSED)
                view.feed(events)
                for ev in events:
                    if isinstance(ev, Failed):
                        status, error = ev.error.status, ev.error.message
                        raise ev.error
                    if isinstance(ev, Cancelled):
                        return Response(status_code=CLIENT_CLOSED)
                if gen.finished():  # every choice is done
                    status = 200
                    return JSONResponse(view.body(), headers=self._cache_header(request, gen))
        finally:
            gen.cancel()
            self.log_request(request, status, gen, error=error)

    async def _stream(self, request: Request, gen: Generation, view) -> Response:
        interval = max(self.config.keepalive_interval - self.config.disconnect_poll_interval, 0.01)
        # Wait (up to one keep-alive interval) for the first event before committing to 200.
        first: list = []
        deadline = time.monotonic() + interval
        try:
            while not first and time.monotonic() < deadline:
                events = await self._wait(request, gen, deadline - time.monotonic())
                if events is None:
                    self.log_request(request, CLIENT_CLOSED, gen, stream=True)
                    return Response(status_code=CLIENT_CLOSED)
                first = events
        except BaseException:
            gen.cancel()
            raise
        if first and isinstance(first[0], Failed):
            self.log_request(request, first[0].error.status, gen, stream=True, error=first[0].error.message)
            raise first[0].error
        if first and isinstance(first[0], Cancelled):
            self.log_request(request, CLIENT_CLOSED, gen, stream=True)
            return Response(status_code=CLIENT_CLOSED)

        async def body():
            pending = list(first)
            last_write = time.monotonic()
            outcome, error = CLIENT_CLOSED, None
            started = False  # the view's opening is written with the first event
            try:
                if not pending:
                    yield b": keep-alive\n\n"
                while True:
                    if not pending:
                        # Polls for a disconnect only after a poll interval without events (a
                        # prefill, the queue): while tokens flow, the response's own disconnect
                        # listener ends this stream, and a poll (a cancelled receive, ~100 us of
                        # the GIL the engine thread needs) per few tokens is what it would cost.
                        pending = await self._wait(request, gen, max(0.0, interval - (time.monotonic() - last_write)))
                        if pending is None:  # the client left; `_wait` cancelled the generation
                            return
                    data = b""
                    if pending and not started:
                        data, started = view.start(), True
                    data += view.feed(pending)
                    done = False
                    for ev in pending:
                        if isinstance(ev, Failed):
                            data += view.error(ev.error)
                            outcome, error, done = ev.error.status, ev.error.message, True
                        elif isinstance(ev, Cancelled):
                            done = True
                    if not done and gen.finished():  # every choice is done
                        outcome, done = 200, True
                    pending = []
                    now = time.monotonic()
                    if data:
                        yield data
                        last_write = now
                    elif now - last_write >= interval:
                        yield b": keep-alive\n\n"
                        last_write = now
                    if done:
                        return
            finally:
                gen.cancel()
                self.log_request(request, outcome, gen, stream=True, error=error)

        # (The report is known once the request was admitted: by its first event, unless it waited in
        # the queue past the first keep-alive.)
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          **self._cache_header(request, gen)})

    def _cache_header(self, request: Request, gen: Generation) -> dict[str, str]:
        first = gen.requests[0] if gen.requests else None
        return cache_explain.header(request, None if first is None else first.cache_report, self.tokenizer)

    # ------------------------------------------------------------------ small endpoints
    def _model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "ds4_torch",
                "max_model_len": self.config.ctx,
                # Anthropic's shape, for clients that list models that way.
                "type": "model", "display_name": name, "created_at": time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))}

    async def models(self, request: Request) -> Response:
        names = [self.config.model_name, *self.config.served_model_names]
        data = [self._model(n) for n in dict.fromkeys(names)]
        return JSONResponse({"object": "list", "data": data, "has_more": False, "first_id": data[0]["id"],
                             "last_id": data[-1]["id"]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["name"]
        if self.config.strict_model_name and name not in self.names:
            raise APIError(404, self.unknown_model(name), param="model", code="model_not_found")
        return JSONResponse(self._model(name))

    async def root(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.config.model_name})

    async def health(self, request: Request) -> Response:
        reason = self.engine.health()
        if reason is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "degraded", "reason": reason}, status_code=503,
                            headers={"Retry-After": str(self.engine.retry_after_s)})

    async def metrics_text(self, request: Request) -> Response:
        self.metrics.queue_depth.set(self.engine.queue_depth())
        return Response(self.engine.metrics_text(), media_type=self.metrics.content_type)

    async def tokenize(self, request: Request) -> Response:
        body = await self.read_json(request)
        ignore_unknown("tokenize", body, {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens"})
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
            messages = openai_api.parse_chat({"messages": body["messages"]})[0].messages
            try:
                ids = encode_conversation(self.tokenizer, self.replay, messages, tenant=TENANT.get()) if agp else \
                    self.tokenizer.encode_chat(messages, add_generation_prompt=False)
            except ValueError as e:
                raise bad(str(e), "messages") from None
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.config.ctx})

    async def render_chat(self, request: Request) -> Response:
        """The token ids the chat request would prefill (vLLM's /v1/chat/completions/render: what a
        KV-aware router hashes to find the replica holding the most of them)."""
        creq, opts = openai_api.parse_chat(await self.read_json(request), state=self)
        self.check_model(opts.model)
        return JSONResponse({"token_ids": chat_prompt(self, creq), "model": opts.model or self.config.model_name})

    async def render_response(self, request: Request) -> Response:
        """The token ids a Responses request would prefill (as `render_chat`)."""
        creq, echo = responses_api.parse_request(await self.read_json(request), self)
        self.check_model(echo["model"])
        return JSONResponse({"token_ids": chat_prompt(self, creq), "model": echo["model"] or self.config.model_name})

    async def render_completion(self, request: Request) -> Response:
        """The token ids of each prompt of a completions request (a list, as vLLM's)."""
        body = await self.read_json(request)
        self.check_model(body.get("model"))
        name = body.get("model") or self.config.model_name
        return JSONResponse([{"token_ids": ids, "model": name} for ids, _ in openai_api.parse_prompts(body, self)])

    async def server_info(self, request: Request) -> Response:
        """What a router's discovery reads (vllm-router's kv_aware: the model identity replicas
        share, this run's id, the KV block size its events' blocks have)."""
        info = self.engine.kv_event_info()
        return JSONResponse({"model_id": self.config.model_name, "instance_id": info["instance_id"],
                             "kv_block_size": info["kv_block_size"], "kv_events": info["sources"] is not None})

    async def kv_event_sources(self, request: Request) -> Response:
        """Where this server publishes its KV events, by data-parallel rank (404 without --kv-events)."""
        sources = self.engine.kv_event_info()["sources"]
        if sources is None:
            raise APIError(404, "this server publishes no KV events: start it with --kv-events ENDPOINT",
                           code="not_found")
        return JSONResponse(sources)

    async def detokenize(self, request: Request) -> Response:
        body = await self.read_json(request)
        ignore_unknown("detokenize", body, {"model", "tokens"})
        self.check_model(body.get("model"))
        ids = body.get("tokens")
        vocab = self.model.config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad("'tokens' must be an array of token ids", "tokens", "invalid_type")
        if any(not 0 <= t < vocab for t in ids):
            raise bad(f"'tokens' holds an id outside the vocabulary [0, {vocab})", "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(ids)})


def create_app(model, tokenizer, config: ServerConfig | None = None, kv_store=None,
               replay: ReplayStore | None = None, peers=None, engine: EngineClient | None = None) -> Starlette:
    """The server app for `model`; its engine thread starts and stops with the app's lifespan.
    `replay`: the exact-replay store (default: one in `config.kv_disk_dir`, else in memory).
    `peers`: the other ranks of a tensor-parallel group (serve.core.tp.Lead), for the engine.
    `engine`: what the app talks to (default: an `Engine` in this process, built from `config`;
    `serve.core.client.CoreClient`: an engine core in a process of its own); `model` then needs only
    its `config`.
    `app.state.engine`, `.metrics`, `.config`, `.server` and `.replay` are there for tests and tools."""
    config = config or ServerConfig()
    if engine is None:
        metrics = Metrics()
        engine = Engine.from_config(model, tokenizer, config, metrics, kv_store=kv_store, peers=peers)
    else:
        metrics = engine.metrics
    replay = replay if replay is not None else ReplayStore(config.kv_disk_dir)
    state = AppState(model, tokenizer, config, engine, metrics, replay)

    def endpoint(name: str, fn, errors=openai_api.error_response, auth: bool = True, method: str = "POST",
                 label: str | None = None):
        async def handler(request: Request) -> Response:
            request.state.t_start = time.perf_counter()
            error = None
            try:
                if auth:
                    state.check_auth(request)
                response = await fn(state, request)
            except APIError as e:
                response, error = errors(e), e.message
            except ClientDisconnect:
                response = Response(status_code=CLIENT_CLOSED)
            except Exception as e:  # noqa: BLE001 - a bug of ours: 500 in the same shape
                log.exception("%s: internal error", name)
                error = f"internal error: {type(e).__name__}: {e}"
                response = errors(APIError(500, error, code="internal_error"))
            metrics.requests.labels(endpoint=label or name, code=str(response.status_code)).inc()
            if not isinstance(response, StreamingResponse):  # a stream logs itself when it ends
                state.access(request, response.status_code, error=error)
            return response
        return Route(name, handler, methods=[method] if method != "GET" else ["GET", "HEAD"])

    anthropic = anthropic_api.error_response
    routes = [
        endpoint("/v1/chat/completions", openai_api.chat_completions),
        endpoint("/v1/completions", openai_api.completions),
        endpoint("/v1/responses", responses_api.responses),
        endpoint("/v1/messages", anthropic_api.messages, anthropic),
        endpoint("/v1/messages/count_tokens", anthropic_api.count_tokens, anthropic),
        endpoint("/v1/models", AppState.models, method="GET"),
        endpoint("/v1/models/{name:path}", AppState.model, method="GET", label="/v1/models/{name}"),
        endpoint("/", AppState.root, auth=False, method="GET"),
        endpoint("/health", AppState.health, auth=False, method="GET"),
        # Interactive Claude Code checks its base URL with HEAD /api/hello at start: answered as /health.
        endpoint("/api/hello", AppState.health, auth=False, method="GET"),
        endpoint("/metrics", AppState.metrics_text, auth=False, method="GET"),
        endpoint("/v1/cache/explain/{request_id}", cache_explain.explain, method="GET",
                 label="/v1/cache/explain/{request_id}"),
        endpoint("/tokenize", AppState.tokenize),
        endpoint("/detokenize", AppState.detokenize),
        endpoint("/v1/chat/completions/render", AppState.render_chat),
        endpoint("/v1/completions/render", AppState.render_completion),
        endpoint("/v1/responses/render", AppState.render_response),
        # Open, as /health: a router finds a replica's events before any client's key reaches it.
        endpoint("/get_server_info", AppState.server_info, auth=False, method="GET"),
        endpoint("/kv_event_sources", AppState.kv_event_sources, auth=False, method="GET"),
    ]

    paths = {route.path for route in routes}

    def did_you_mean(path: str) -> str:
        """The API path a client likely meant: its base URL without `/v1` (OpenAI's clients want
        it in the base URL, Anthropic's add it) or with it twice."""
        for candidate in ("/v1" + path, path.removeprefix("/v1")):
            if candidate != path and (candidate in paths or candidate.startswith("/v1/models/")):
                return (f"; did you mean {candidate}? (an OpenAI client's base URL ends in /v1, an Anthropic "
                        f"client's does not)")
        return ""

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        hint = did_you_mean(request.url.path) if exc.status_code == 404 else ""
        e = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}{hint}", code=code)
        shape = anthropic if request.url.path.startswith("/v1/messages") else openai_api.error_response
        state.access(request, exc.status_code, error=e.message)
        return shape(e)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        log.info("serving %s: %s%s", config.model_name, engine.describe(),
                 ", API key required" if config.api_key else "")
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)
            replay.close()

    def shaped(path: str, e: APIError) -> Response:
        return (anthropic if path.startswith("/v1/messages") else openai_api.error_response)(e)

    middleware = [Middleware(BrowserGuard, bind_host=config.host, allowed_hosts=config.allowed_hosts,
                             error_response=shaped, access_log=config.access_log,
                             on_reject=lambda path, status: metrics.requests.labels(endpoint=path,
                                                                                    code=str(status)).inc())]
    if config.cors_origins:
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                                        allow_methods=["GET", "POST", "HEAD"], allow_headers=["*"]))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error},
                    middleware=middleware)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.config = config
    app.state.server = state
    app.state.replay = replay
    return app
