"""OpenAI- and Anthropic-compatible HTTP server for ds4_torch models (`ds4-torch serve`,
`python -m serve`), in rooms by job; each imports only the rooms below it:

- `serve.core`: the engine-core process, the API-process side, the wire, --tp followers, set-up;
- `serve.http`: the Starlette app (`serve.http.app.create_app`, `ServerConfig`) and the three APIs;
- `serve.engine`: the batching engine (`serve.engine.loop.Engine`) and its parts;
- `serve.kvstore`: the disk KV cache and its file format.

Beside them: `serve.cli` (the flags and `main`), `serve.background` (the app on a thread, for
tests and benchmarks), `serve.errors` (the one error type) and `serve.metrics` (/metrics).
"""
from __future__ import annotations


def __getattr__(name):
    if name in ("create_app", "ServerConfig"):
        from serve.http import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
