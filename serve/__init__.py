"""OpenAI-compatible HTTP server for ds4_torch models (`ds4-torch serve`, `python -m serve`).

- `serve.app.create_app(model, tokenizer, ServerConfig(...))`: the Starlette app;
- `serve.engine.Engine`: the worker thread that owns the model and the live KV cache;
- `serve.background.BackgroundServer`: uvicorn on a background thread (tests, benchmark);
- `serve.cli`: the flags, shared by both commands.
"""
from __future__ import annotations


def __getattr__(name):
    if name in ("create_app", "ServerConfig"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
