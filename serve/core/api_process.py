"""An API process over an engine core (serve.core.process): the HTTP side (the app, tokenizing,
detokenizing, SSE) on a `CoreClient` (`run_api_server`). `serve` runs the first itself; with
`--api-servers N` it starts N - 1 more (`python -m serve.core.api_process`), each loading the tokenizer,
connecting to the core and answering on the same port (SO_REUSEPORT: the kernel spreads
connections over them); they die with the first.

One that dies leaves the others serving: the core cancels its open requests (its connection
closed). At shutdown the first process ends them (SIGTERM: each drains its HTTP connections)
before it drains the core.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys

from ds4_torch.runtime import UserError

from .setup import REPLAY_SHARE, warn_if_open
from .wire import dumps, loads

log = logging.getLogger("ds4.serve")

STOP_WAIT_S = 15.0   # an API process's HTTP drain (uvicorn's 5 s) and exit


def reuse_port_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """A listening TCP socket on (host, port) that other processes may bind too (SO_REUSEPORT);
    not `listen`ing, it only holds the port for them (the kernel gives it no connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def spawn_api_worker(args, core, port: int | None, number: int, owner: bool = False) -> subprocess.Popen:
    """Start API process `number` for `core` (a serve.core.process.CoreProcess): on `port`, shared with the
    others, or (None) on --host/--port, bound by itself. The `owner` drains the core when it stops
    (under --tp the core is rank 0's process and this its only API process)."""
    proc = subprocess.Popen([sys.executable, "-m", "serve.core.api_process"], stdin=subprocess.PIPE)
    proc.stdin.write(dumps(dict(args=args, address=core.address, authkey=core.authkey, port=port,
                                parent=os.getpid(), number=number, owner=owner)))
    proc.stdin.close()
    log.info("API process %d: process %d", number, proc.pid)
    return proc


def stop_api_workers(workers: list[subprocess.Popen]) -> None:
    """SIGTERM to each (they drain their HTTP connections), then wait; kill what is left."""
    for proc in workers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in workers:
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("API process %d did not exit within %.0f s; killing it", proc.pid, STOP_WAIT_S)
            proc.kill()
            proc.wait()


def connect_core(core, tokenizer, owner: bool):
    """A `CoreClient` of `core` (a serve.core.process.CoreProcess); UserError with the core's reason when
    it refused to serve. Only the `owner`'s stop drains the core."""
    from .client import CoreClient

    try:
        return CoreClient.connect(core, tokenizer, owner=owner)
    except (OSError, RuntimeError) as e:
        raise UserError(str(e)) from None


def run_api_server(args, client, tokenizer, model_config, sock=None) -> int:
    """The HTTP side over `client` until interrupted: on `sock` (pre-bound, shared by several API
    processes) or on --host/--port. 0; 1 when the core died; 3 when it could not start."""
    import types

    import uvicorn

    from serve.http.app import HTTP_PARSER, create_app
    from serve.http.replay import ReplayStore

    config = client.config
    app = create_app(types.SimpleNamespace(config=model_config), tokenizer, config, replay=ReplayStore(),
                     engine=client)
    if client.info["kv_budget"] is not None:  # the core holds the KV directory's lock: the server's
        app.state.replay.max_disk_bytes = client.info["kv_budget"] // REPLAY_SHARE
        app.state.replay.open_directory(args.kv_disk_dir)
    if client.owner:  # (one warning for the N API processes)
        warn_if_open(args.host, config.api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                          access_log=False, timeout_graceful_shutdown=5, http=HTTP_PARSER))

    def end(reason: str) -> None:  # the core died: its requests have their 503s; the server ends
        server.should_exit = True

    client.on_lost = end
    try:
        server.run(sockets=None if sock is None else [sock])
    except KeyboardInterrupt:
        pass
    finally:
        if not server.started:
            client.stop()
    if not server.started:
        return 3
    return 1 if client.died else 0


def main() -> int:
    from .process import CoreProcess, die_with_parent
    from .setup import load_api_side

    payload = loads(sys.stdin.buffer.read())
    die_with_parent(payload["parent"])
    args = payload["args"]
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: our parent ends us in order
    try:
        tokenizer, model_config = load_api_side(args)
        core = CoreProcess(None, payload["address"], payload["authkey"])
        client = connect_core(core, tokenizer, owner=payload["owner"])
    except UserError as e:
        log.error("API process %d: %s", payload["number"], e)
        return 2
    if payload["port"] is None:
        return run_api_server(args, client, tokenizer, model_config)
    args.port = payload["port"]
    return run_api_server(args, client, tokenizer, model_config, reuse_port_socket(args.host, payload["port"]))


if __name__ == "__main__":
    sys.exit(main())
