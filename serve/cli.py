"""Command line of the server: `ds4-torch serve ...` and `python -m serve ...` share
`add_arguments`, so both take exactly the same flags."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ds4_torch.runtime import (UserError, add_model_arguments, add_tp_argument, load_config, non_negative_int,
                               positive_float, positive_int, resolve_device)

from serve.core.setup import (API_KEY_ENV, KV_DISK_DEFAULT_EVERY, KV_DISK_DEFAULT_MB, KV_DISK_DEFAULT_MIN_TOKENS,  # noqa: F401
                    REPLAY_SHARE, _api_key, attach_kv_store, check_kv_events, choose_kv_pool, load,
                    load_api_side, warn_if_open)  # (imported from here)
from serve.core.wire import BACKLOG_MB

SHUTDOWN_WAIT_S = 60  # the engine core's drain (it saves conversations for up to 30 s) before it is killed


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=non_negative_int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--ctx", type=positive_int, default=None,
                   help="the most tokens one request may hold: prompt + completion (default: the model's maximum, "
                        "at most what the KV pool holds for one request; logged)")
    p.add_argument("--kv-cache-mb", type=positive_float, default=None, metavar="MB",
                   help="the KV pool, in MiB: the compressed rows of every running and resident sequence, in blocks "
                        "shared by sequences with the same prefix (default: half of the memory left after the "
                        "weights, less the slots' own state, at most what every slot at --ctx would hold; logged)")
    p.add_argument("--kv-dtype", choices=("full", "fp8", "fp8-keep-rope"), default="full",
                   help="how the pool stores compressed and indexer rows: full (the model's --dtype), fp8 (e4m3 with a "
                        "power-of-two scale per 64 values: about half the bytes per token of bf16), fp8-keep-rope "
                        "(the same, an attention row's RoPE channels kept in --dtype) (default full)")
    p.add_argument("--kv-block-tokens", type=positive_int, default=256, metavar="N",
                   help="tokens of context per KV block: a multiple of the model's compression rates (default 256)")
    p.add_argument("--prefill-chunk", type=positive_int, default=256,
                   help="tokens per prefill chunk; disconnects are noticed between chunks (default 256)")
    p.add_argument("--decode-mode", choices=("auto", "eager", "graph"), default="auto",
                   help="decode path (auto: CUDA graphs where available); env DS4_TORCH_DECODE_MODE overrides")
    p.add_argument("--speculative-tokens", type=int, default=0, choices=range(0, 4), metavar="N",
                   help="speculative decoding: draft N tokens (1-3) per step with the model's MTP layer and verify "
                        "them in one forward; the same tokens as without (default 0: off)")
    p.add_argument("--speculative-max-batch", type=positive_int, default=None, metavar="N",
                   help="speculate only while at most N sequences decode together; above, plain steps (a verify "
                        "step of many sequences can cost more than its accepted drafts save; default: always)")
    p.add_argument("--speculative-policy", choices=("auto", "always"), default="always",
                   help="always (default): speculate in every step with at most --speculative-max-batch sequences; "
                        "auto: only in the steps where it measured faster than plain decoding (per batch size, "
                        "re-checked every 32 steps; the tokens are the same either way)")
    p.add_argument("--free-tool-calls", action="store_true",
                   help="do not keep tool calls to what is offered: by default, once the model opens a "
                        "tool-call block its calls may only name offered tools and the parameters each declares, "
                        "and with no tools offered (or tool_choice none) the model cannot open a block at all "
                        "(a call it wrote anyway would be dropped)")
    p.add_argument("--max-batch", type=positive_int, default=8,
                   help="sequences decoding together in one batched step (default 8)")
    p.add_argument("--max-sessions", type=positive_int, default=None,
                   help="conversations kept resident in memory: each holds KV blocks for its tokens (what the pool "
                        "cannot hold leaves, least recently used first, to --kv-disk-dir when set) and a slot of its "
                        "own (window ring and open windows, sized by the model; a slot map of 8 bytes per compressed row of --ctx) "
                        "(default max(--max-batch, "
                        "16); the cache memory is logged at start)")
    p.add_argument("--max-queue", type=non_negative_int, default=64,
                   help="requests that may wait for the engine; one more is answered 429 (default 64)")
    p.add_argument("--api-key", metavar="KEY", action="append", default=None,
                   help=f"require the key on /v1/*, /tokenize, /detokenize, as 'Authorization: Bearer KEY' or "
                        f"'x-api-key: KEY' (Anthropic's clients) (repeatable: any of the keys; each is a tenant of its "
                        f"own, and cached prefixes and replayed turns never cross keys) (default: env {API_KEY_ENV}, "
                        f"else none)")
    p.add_argument("--checkpoint-interval", type=non_negative_int, default=256, metavar="N",
                   help="checkpoint a conversation's cache every N tokens of prefill and decode, besides prompt "
                        "ends and message starts, so a later request diverging from it resumes there "
                        "(default 256; 0: no checkpoints, only exact extensions are reused)")
    p.add_argument("--checkpoint-memory-mb", type=positive_float, default=1024, metavar="MB",
                   help="memory for those checkpoints, in MiB (least recently used dropped first, message "
                        "starts kept longest; default 1024)")
    p.add_argument("--kv-disk-dir", metavar="DIR", default=None,
                   help="directory of the disk KV cache: snapshots of conversations' KV state, restored when the "
                        "live cache misses (default: none)")
    p.add_argument("--kv-disk-space-mb", type=positive_int, default=None, metavar="N",
                   help=f"space budget of the disk KV cache in MiB, quarantine and temporary files included "
                        f"(default {KV_DISK_DEFAULT_MB} with --kv-disk-dir)")
    p.add_argument("--kv-disk-every", type=non_negative_int, default=KV_DISK_DEFAULT_EVERY, metavar="N",
                   help=f"also snapshot a conversation every N generated tokens (default {KV_DISK_DEFAULT_EVERY}; "
                        f"0: only after prefills, when replaced and at shutdown)")
    p.add_argument("--kv-disk-min-tokens", type=positive_int, default=KV_DISK_DEFAULT_MIN_TOKENS, metavar="N",
                   help=f"shorter sequences are not worth a snapshot (default {KV_DISK_DEFAULT_MIN_TOKENS})")
    p.add_argument("--keepalive-interval", type=positive_float, default=5.0, metavar="S",
                   help="seconds without output before a streaming response sends ': keep-alive' (default 5)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--access-log", choices=("on", "off"), default="on",
                   help="one log line per request, rejected ones included, with why (default on)")
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="another name /v1/models lists (repeatable); any name is answered unless --strict-model-name")
    p.add_argument("--allowed-hosts", action="append", default=[], metavar="NAME",
                   help="bound to loopback, Host names answered besides loopback ones (repeatable; a web page "
                        "reaching the server through another name gets 421)")
    p.add_argument("--cors-origins", action="append", default=[], metavar="ORIGIN",
                   help="browser origins given CORS headers (repeatable; none by default)")
    p.add_argument("--strict-model-name", action="store_true",
                   help="answer only the served names: another model name is a 400 (404 on GET /v1/models/{id})")
    p.add_argument("--kv-events", metavar="ENDPOINT", default=None,
                   help="publish the KV pool's full blocks as they are stored and removed, on a ZeroMQ PUB socket "
                        "bound at ENDPOINT (e.g. tcp://127.0.0.1:5557; port * takes a free one), in vLLM 0.29's "
                        "KV-event format: what KV-aware routers (vllm-router --policy kv_aware) place requests by. "
                        "The events carry the blocks' token ids and the socket has no authentication: bind it where "
                        "only the router reaches it (docs/scaling-out.md) (default: none)")
    p.add_argument("--kv-events-replay", metavar="ENDPOINT", default=None,
                   help="with --kv-events: also bind a ZeroMQ ROUTER socket there that sends a subscriber the "
                        "batches it missed (the last 10,000), as vLLM's replay endpoint does (default: none)")
    p.add_argument("--kv-events-all-tenants", action="store_true",
                   help="with --kv-events and several --api-key: publish every tenant's blocks (their token ids) "
                        "to whoever subscribes (a router forwarding every tenant's requests sees them anyway); "
                        "without it, several keys and --kv-events are refused")
    p.add_argument("--api-servers", type=positive_int, default=1, metavar="N",
                   help="HTTP processes answering on the same port over one engine core (default 1; each tokenizes, "
                        "detokenizes and streams its own requests; with --tp, over rank 0's core; not with "
                        "--engine-core thread)")
    p.add_argument("--api-backlog-mb", type=positive_float, default=BACKLOG_MB, metavar="MB",
                   help=f"the engine core's output an API process has not read yet, held for it at most, in MiB "
                        f"(default {BACKLOG_MB:g}): past it that output is dropped and the process's requests are "
                        f"cancelled (503), so an API process that stops reading never holds up the others")
    p.add_argument("--engine-core", choices=("process", "thread"), default="process",
                   help="process (default): the engine (scheduler, model, sessions, disk KV store) runs in a "
                        "process of its own, so HTTP, tokenizing and detokenizing never take its CPU or GIL; "
                        "thread: on a thread of the server's process. With --tp, rank 0's process is the core "
                        "and runs the API processes as its children")
    add_tp_argument(p)
    p.add_argument("--tp-timeout", type=positive_float, default=None, metavar="S",
                   help="with --tp: seconds any collective may wait for the other ranks; a rank that dies or hangs "
                        "ends the server (503s, exit status 1) within this (default 120; a dead process is "
                        "usually noticed at once)")
    return p


def build_parser(prog: str = "python -m serve") -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server for DS4 models."))


def check_flags(args) -> None:
    """The flag errors found without the weights, raised (UserError) before anything loads or logs:
    the flags among themselves, against the model's config.json, and the port."""
    if args.tp_timeout is not None and args.tp == 1:
        raise UserError("--tp-timeout needs --tp N with N > 1")
    if args.api_servers > 1 and args.engine_core == "thread":
        raise UserError("--api-servers N needs the engine core in a process of its own (not --engine-core thread)")
    check_kv_events(args)
    if args.max_sessions is not None and args.max_sessions < args.max_batch:
        raise UserError(f"--max-sessions {args.max_sessions} is less than --max-batch {args.max_batch}: every "
                        "decoding request holds a resident session")
    if args.kv_disk_space_mb is not None and args.kv_disk_dir is None:
        raise UserError("--kv-disk-space-mb needs --kv-disk-dir")
    config = load_config(args.model)
    limit = getattr(config, "max_position_embeddings", None)
    if limit and args.ctx is not None and args.ctx > limit:
        raise UserError(f"--ctx {args.ctx} is larger than the model's max_position_embeddings ({limit})")
    rates = sorted({config.compress_rate(i) for i in range(config.num_hidden_layers)} - {0})
    if any(args.kv_block_tokens % m for m in rates):
        raise UserError(f"--kv-block-tokens {args.kv_block_tokens} must be a multiple of every compression rate of "
                        f"the model ({rates}): a block holds whole compressed rows")
    if os.environ.get("RANK", "0") == "0":  # under torchrun, global rank 0 answers HTTP
        check_port_free(args.host, args.port)


def check_port_free(host: str, port: int) -> None:
    """UserError when `host`:`port` cannot be bound: found before the model loads, not after the
    server has logged its start-up."""
    import errno
    import socket

    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is in use (another server?): stop it, or choose another "
                                f"port with --port (0: any free one)") from None
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def run(args) -> int:
    """Load, build the app and serve until interrupted (uvicorn handles SIGINT/SIGTERM). With
    `--tp N` (under torchrun), rank 0 serves and the other ranks follow it (serve.core.tp)."""
    check_flags(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tp == 1 and args.engine_core == "process":
        return serve_with_core(args)
    if args.tp == 1:
        return serve(args, *load(args))
    return run_tensor_parallel(args)


def run_tensor_parallel(args) -> int:
    import torch.distributed as dist

    from ds4_torch.parallel import init_tensor_parallel

    from serve.core import tp as tensor_parallel

    timeout = args.tp_timeout or tensor_parallel.DEFAULT_TIMEOUT_S
    try:  # the group first, with our timeout: loading joins it
        tp = init_tensor_parallel(args.tp, resolve_device(args.device), timeout_s=timeout)
    except ValueError as e:  # no launcher, or a world size other than --tp
        raise UserError(str(e)) from e
    group = tensor_parallel.control_group(timeout)
    loaded = load(args, group)
    if tp.rank != 0:
        status = tensor_parallel.follow(loaded[0], group)
    else:
        lead = tensor_parallel.Lead(group)
        if args.engine_core == "process":
            status = serve_tensor_parallel_core(args, *loaded, lead)
        else:
            status = serve(args, *loaded, peers=lead)
    if status == 0:
        dist.destroy_process_group()
    return status


def serve(args, model, tokenizer, config, peers=None) -> int:
    """Serve `model` until interrupted; 0, or 3 when the server could not start (uvicorn's code).
    `peers` (a serve.core.tp.Lead): the other ranks of a tensor-parallel group; when they fail the
    server ends (status 1)."""
    import uvicorn

    from serve.http.app import HTTP_PARSER, create_app

    from serve.http.replay import ReplayStore

    # Exact-replay records go to the KV directory only once its lock is this process's.
    app = create_app(model, tokenizer, config, peers=peers, replay=ReplayStore())
    store = attach_kv_store(app.state.engine, args)
    if store is not None:
        app.state.replay.max_disk_bytes = store.budget // REPLAY_SHARE
        app.state.replay.open_directory(args.kv_disk_dir)
    warn_if_open(args.host, config.api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                          access_log=False, timeout_graceful_shutdown=5, http=HTTP_PARSER))
    if peers is not None:
        from serve.core.tp import EXIT_GRACE_S, exit_soon

        def end(reason: str) -> None:  # called by the engine's worker once every request has its 503
            server.should_exit = True
            exit_soon(EXIT_GRACE_S, 1)

        peers.on_failure = end
    try:
        server.run()  # after a graceful shutdown uvicorn raises the signal that asked for it again:
    except KeyboardInterrupt:  # SIGINT ends here (status 0), SIGTERM ends the process (as uvicorn.run does)
        pass
    if peers is not None and not app.state.engine.alive:
        # The engine's worker sends the stop as it ends; this covers a worker that never started
        # (the server could not start). A worker still running may be mid-operation: no stop then.
        peers.stop()
    if not server.started:
        return 3
    return 1 if peers is not None and peers.broken is not None else 0


def serve_with_core(args) -> int:
    """Serve with the engine core in a process of its own (serve.core.process): this process loads only
    the tokenizer and runs the HTTP side; with `--api-servers N`, N - 1 more API processes
    (serve.core.api_process) answer on the same port (SO_REUSEPORT), each with its own connection to
    the core. 0 after a clean shutdown (Ctrl-C, SIGTERM: the other API processes drain, then the
    core, which saves the conversations), 1 when the core died (every open request answered 503),
    2 when it refused the flags, 3 when the server could not start."""
    from serve.core.api_process import connect_core, run_api_server
    from serve.core.process import spawn_core

    tokenizer, model_config = load_api_side(args)
    core = spawn_core(args)
    try:
        client = connect_core(core, tokenizer, owner=True)
    except UserError:
        core.wait(SHUTDOWN_WAIT_S)
        raise
    sock = None
    workers: list = []
    if args.api_servers > 1:
        from serve.core.api_process import reuse_port_socket, spawn_api_worker, stop_api_workers

        sock = reuse_port_socket(args.host, args.port)
        port = sock.getsockname()[1]
        workers = [spawn_api_worker(args, core, port, number) for number in range(2, args.api_servers + 1)]
        logging.getLogger("ds4.serve").info("%d API processes answering on http://%s:%d", args.api_servers,
                                            args.host, port)
        client.before_stop = lambda: stop_api_workers(workers)
    try:
        status = run_api_server(args, client, tokenizer, model_config, sock)
    finally:
        if workers:
            stop_api_workers(workers)
        core_status = core.wait(SHUTDOWN_WAIT_S)
    if status == 1:
        logging.getLogger("ds4.serve").error("the engine core process died (%s; exit status %s); the server exits",
                                             client.lost, core_status)
    return status


def serve_tensor_parallel_core(args, model, tokenizer, config, lead) -> int:
    """Rank 0 under `--tp`: this process is the engine core, leading the other ranks (serve.core.tp),
    and `--api-servers` API processes (serve.core.api_process, its children) answer HTTP, on one port
    (SO_REUSEPORT) when there are several. SIGINT or SIGTERM: the other API processes drain, then
    the first, which drains the core (the other ranks are told to stop), then this process exits
    (by SIGTERM again, as uvicorn does); the group failing: 503s, status 1; the first API process
    dying: the core stops, status 1; another dying: the others keep serving."""
    import signal
    import subprocess
    import threading
    from multiprocessing.connection import Listener

    from serve.core.api_process import reuse_port_socket, spawn_api_worker, stop_api_workers
    from serve.core.process import CoreProcess, EngineCore, new_address
    from serve.engine.loop import Engine
    from serve.core.tp import EXIT_GRACE_S, exit_soon

    engine = Engine.from_config(model, tokenizer, config, peers=lead)
    store = attach_kv_store(engine, args)
    address, authkey = new_address()
    core = EngineCore(engine, Listener(address, "AF_UNIX", authkey=authkey), {}, args.api_backlog_mb)
    signals: list[int] = []
    api_gone: list[int] = []

    def group_failed(reason: str) -> None:  # every request has its 503 (the engine's worker answered them)
        core.stopping.set()
        exit_soon(EXIT_GRACE_S, 1)

    lead.on_failure = group_failed
    core.start(config, kv_budget=None if store is None else store.budget)
    where, port, hold = CoreProcess(None, address, authkey), None, None
    if args.api_servers > 1:  # the port held (not listened on: this process answers no HTTP) for them all
        hold = reuse_port_socket(args.host, args.port, listen=False)
        port = hold.getsockname()[1]
    api = spawn_api_worker(args, where, port, 1, owner=True)
    others = [spawn_api_worker(args, where, port, number) for number in range(2, args.api_servers + 1)]
    if others:
        logging.getLogger("ds4.serve").info("%d API processes answering on http://%s:%d", args.api_servers,
                                            args.host, port)

    def stop_api() -> None:  # the others first: the first one's drain stops the core
        stop_api_workers(others)
        if api.poll() is None:
            api.send_signal(signal.SIGTERM)

    def stop(signum, frame) -> None:
        signals.append(signum)
        threading.Thread(target=stop_api, name="ds4-api-stop", daemon=True).start()  # (waits: not in a handler)

    def watch() -> None:
        api_gone.append(api.wait())
        core.stopping.set()  # after its drain ("shutdown"), or it died

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    threading.Thread(target=watch, name="ds4-api-watch", daemon=True).start()
    core.serve()
    stop_api_workers(others)  # (the first died, or the group failed)
    try:
        api.wait(SHUTDOWN_WAIT_S)
    except subprocess.TimeoutExpired:
        api.kill()
    core.listener.close()
    if hold is not None:
        hold.close()
    if lead.broken is not None:
        return 1
    if signal.SIGTERM in signals:  # exit by the signal, as uvicorn does after a graceful shutdown
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    return 0 if signals else 1


def add_explain_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("request_id", help="the request's id: the access log's id=, the x-ds4-cache header's request=")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the running server (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", metavar="KEY", default=None,
                   help=f"a key of the server, the one the request was sent with (default: env {API_KEY_ENV})")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def explain_cache(args) -> int:
    """`ds4-torch cache-explain ID`: ask a running server what a past request reused of the cache
    and why not more (GET /v1/cache/explain/{ID}), and print it."""
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    from serve.http.cache_explain import describe

    key = args.api_key or os.environ.get(API_KEY_ENV)
    url = f"{args.url.rstrip('/')}/v1/cache/explain/{urllib.parse.quote(args.request_id, safe='')}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            view = json.load(r)
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise UserError(f"{url}: {e.code}: {message}") from None
    except OSError as e:
        raise UserError(f"cannot reach {args.url}: {e}") from None
    print(json.dumps(view, indent=1, ensure_ascii=False) if args.json else describe(view))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except UserError as e:
        print(f"python -m serve: error: {e}", file=sys.stderr)
        return 2
