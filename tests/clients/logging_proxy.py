"""A logging reverse proxy for driving real agent clients against the server: every request is
forwarded as is, the response streamed back as it arrives, and one JSON line per exchange is
appended to a log (method, path, status, the request body, the response body as the client got
it). `python tests/clients/logging_proxy.py --upstream http://127.0.0.1:8000 --port 8001 --log F`.
"""
from __future__ import annotations

import argparse
import json
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


def build_app(upstream: str, log_path: str) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(600.0))

    async def proxy(request: Request):
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream_req = client.build_request(request.method, request.url.path, params=request.query_params,
                                            headers=headers, content=body)
        response = await client.send(upstream_req, stream=True)
        started = time.time()

        async def relay():
            chunks = []
            try:
                async for chunk in response.aiter_raw():
                    chunks.append(chunk)
                    yield chunk
            finally:
                await response.aclose()
                entry = {"t": started, "method": request.method, "path": request.url.path,
                         "status": response.status_code, "request": body.decode("utf-8", "replace"),
                         "response": b"".join(chunks).decode("utf-8", "replace"),
                         "headers": {k: v for k, v in request.headers.items() if k.lower().startswith(
                             ("anthropic", "x-", "user-agent", "openai", "originator", "session"))}}
                with open(log_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(entry, ensure_ascii=False) + "\n")

        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
        return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers)

    return Starlette(routes=[Route("/{path:path}", proxy, methods=["GET", "POST", "HEAD", "PUT", "DELETE"])])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--upstream", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log", required=True)
    a = p.parse_args()
    uvicorn.run(build_app(a.upstream, a.log), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
