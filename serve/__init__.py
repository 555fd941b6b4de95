"""OpenAI-compatible HTTP server for ds4_torch models (`ds4-torch serve`, `python -m serve`).

- `serve.app.create_app(model, tokenizer, ServerConfig(...))`: the Starlette app;
- `serve.engine.Engine`: the worker thread, a loop over its parts: `serve.scheduler` (who runs),
  `serve.sessions` (resident slots, prefixes, checkpoints, disk), `serve.runner` (the model, the
  caches and the batched sampler) and `serve.output` (text, stops, events on a thread of its own),
  which share only `serve.sequence.GenRequest`;
- `serve.background.BackgroundServer`: uvicorn on a background thread (tests, benchmark);
- `serve.cli`: the flags, shared by both commands.
"""
from __future__ import annotations


def __getattr__(name):
    if name in ("create_app", "ServerConfig"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
