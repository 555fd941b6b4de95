"""Run a server app on a background thread (tests, the benchmark): bound to a free loopback
port, started and stopped explicitly."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn

from serve.http.app import HTTP_PARSER


class BackgroundServer:
    """`with BackgroundServer(app) as srv: ... srv.url ...`: uvicorn on its own thread and event
    loop; the app's lifespan (its engine thread) starts and stops with it."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                                     timeout_graceful_shutdown=2, http=HTTP_PARSER)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="ds4-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        engine = getattr(getattr(self.app, "state", None), "engine", None)
        while engine is not None and not engine.warm:  # the first model call pays one-off costs
            if time.monotonic() > deadline:
                raise RuntimeError("the engine did not warm up")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
