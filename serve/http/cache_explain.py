"""What a request reused of the cache and why not more, shown three ways (the report itself is the
engine's: `serve.engine.reuse`):

- the access log line (the operator's: `other_tenant` included);
- the ``x-ds4-cache`` response header, when the request sends ``x-ds4-cache: 1``;
- ``GET /v1/cache/explain/{request_id}`` (the access log's ``id=``; the header's ``request=``),
  behind the API key; with several keys a key sees only its own requests.

A client sees its own tenant's view: where its prompt diverged from an earlier one of the same
tenant, in that prompt's words, never whether another tenant's prompt matched more.
"""
from __future__ import annotations

import asyncio
import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serve.engine.reuse import operator_reason
from .chat import TENANT
from .protocol import APIError

HEADER = "x-ds4-cache"
EXCERPT_CHARS = 60
TEXTS = ("before", "ours", "theirs")


def _text(tokenizer, ids: list[int]) -> str:
    try:
        text = tokenizer.decode(ids, skip_special_tokens=False)
    except TypeError:
        text = tokenizer.decode(ids)
    return text[:EXCERPT_CHARS]


def client_view(report: dict, tokenizer) -> dict:
    """The report as its client may see it: excerpts decoded, nothing of another tenant's."""
    out = {k: v for k, v in report.items() if k not in ("tenant", "other_tenant")}
    for key in TEXTS:
        if key in out:
            out[key] = _text(tokenizer, out[key])
    return out


def _fields(view: dict) -> list[tuple[str, str]]:
    return [(k, json.dumps(v) if isinstance(v, str) and k in TEXTS else str(v)) for k, v in view.items()]


def log_fields(report: dict | None, tokenizer) -> str:
    """The access log's fields (the operator's view)."""
    if report is None:
        return ""
    view = client_view(report, tokenizer)
    out = f" reuse_source={view['source']} reuse_reason={operator_reason(report)}"
    if report.get("other_tenant"):
        out += f" other_tenant_shared={report['other_tenant']}"
    for key, value in _fields(view):
        if key in ("shared", "diverged_at", *TEXTS):
            out += f" {'reuse_shared' if key == 'shared' else key}={value}"
    return out


def wants_header(request: Request) -> bool:
    value = request.headers.get(HEADER, "").strip().lower()
    return value not in ("", "0", "false", "no")


def header(request: Request, report: dict | None, tokenizer) -> dict[str, str]:
    """The response header, when the request asked for it and its report is known."""
    if report is None or not wants_header(request):
        return {}
    # json.dumps escapes every non-ASCII character: a header value is Latin-1 on the wire.
    return {HEADER: "; ".join(f"{k}={v}" for k, v in _fields(client_view(report, tokenizer)))}


SOURCES = {"session": "its conversation's resident session", "shared": "a running request's state (shared)",
           "checkpoint": "a checkpoint", "disk": "a snapshot on disk", "none": "nowhere"}
WHY = {
    "new": "no earlier prompt shared a token with it",
    "full": "no earlier prompt shared more",
    "diverged": "an earlier prompt shared {shared} tokens: it differs from this one at token {diverged_at}, and "
                "the nearest state before that was reused",
    "no_checkpoint": "an earlier prompt shared {shared} tokens, but no state of it lay at or before token "
                     "{diverged_at}, where they differ",
    "evicted": "an earlier prompt that shared {shared} tokens left memory for another conversation (every "
               "resident session was taken) and was not on disk",
    "pool": "an earlier prompt that shared {shared} tokens left memory because the KV pool needed its blocks for "
            "other requests, and was not on disk",
    "evicted_to_disk": "an earlier prompt that shared {shared} tokens was written to the disk store when it left "
                       "memory, and the store did not give it back",
    "prompt_logprobs": "it asked for prompt logprobs: the whole prompt is prefilled for them",
}


def describe(view: dict) -> str:
    """A report (the client view) in words: `ds4-torch cache-explain` prints it."""
    lines = [f"request {view['request']}: {view['reused']:,} of {view['prompt']:,} prompt tokens reused, from "
             f"{SOURCES.get(view['source'], view['source'])}",
             f"why not more: {WHY.get(view['reason'], view['reason']).format_map(view)} ({view['reason']})"]
    for key, name in (("before", "before it"), ("ours", "this prompt"), ("theirs", "the earlier one")):
        if key in view:
            lines.append(f"  {name:>15}: {json.dumps(view[key], ensure_ascii=False)}")
    return "\n".join(lines)


async def explain(state, request: Request) -> Response:
    """GET /v1/cache/explain/{request_id}: the client view of a recent request's report."""
    rid = request.path_params["request_id"]
    report = await asyncio.get_running_loop().run_in_executor(None, state.engine.cache_report, rid)
    if report is None or report.get("tenant") != TENANT.get():
        raise APIError(404, f"no cache report for request {rid!r}: ids are the access log's id= (the x-ds4-cache "
                            f"header's request=), and only the latest requests are kept", param="request_id",
                       code="not_found")
    return JSONResponse(client_view(report, state.tokenizer))
