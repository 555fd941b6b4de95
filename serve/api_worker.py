"""The API processes beyond the first (`serve --api-servers N`): each loads the tokenizer, connects
to the engine core (serve.core) and answers HTTP on the same port as the others (SO_REUSEPORT: the
kernel spreads connections over them). `python -m serve.api_worker` runs one; the first API
process (serve.cli) starts them, and they die with it.

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

from .wire import dumps, loads

log = logging.getLogger("ds4.serve")

STOP_WAIT_S = 15.0   # an API process's HTTP drain (uvicorn's 5 s) and exit


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def spawn_api_worker(args, core, port: int, number: int) -> subprocess.Popen:
    """Start API process `number` on `port` for `core` (a serve.core.CoreProcess)."""
    proc = subprocess.Popen([sys.executable, "-m", "serve.api_worker"], stdin=subprocess.PIPE)
    proc.stdin.write(dumps(dict(args=args, address=core.address, authkey=core.authkey, port=port,
                                parent=os.getpid(), number=number)))
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


def main() -> int:
    from ds4_torch.runtime import UserError

    from .cli import connect_core, load_api_side, run_api_server
    from .core import CoreProcess, die_with_parent

    payload = loads(sys.stdin.buffer.read())
    die_with_parent(payload["parent"])
    args = payload["args"]
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the first process ends us in order
    try:
        tokenizer, model_config = load_api_side(args)
        core = CoreProcess(None, payload["address"], payload["authkey"])
        client = connect_core(core, tokenizer, owner=False)
    except UserError as e:
        log.error("API process %d: %s", payload["number"], e)
        return 2
    args.port = payload["port"]
    return run_api_server(args, client, tokenizer, model_config, reuse_port_socket(args.host, payload["port"]))


if __name__ == "__main__":
    sys.exit(main())
