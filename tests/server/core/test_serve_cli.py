"""`ds4-torch serve` and `python -m serve`: one set of flags, a real process end to end."""
from __future__ import annotations

import re

import httpx
import pytest

from ds4_torch.cli import build_parser, main
from serve.cli import API_KEY_ENV, _api_key, build_parser as serve_parser
from helpers import gone, interrupt, serve_process, wait_for


def _options(parser) -> dict:
    return {a.dest: (tuple(a.option_strings), a.default, a.choices) for a in parser._actions if a.dest != "help"}


def test_both_commands_take_the_same_flags():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    assert _options(sub) == _options(serve_parser())
    args = serve_parser().parse_args([])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)  # loopback unless told
    args = build_parser().parse_args(["serve", "--kv-disk-dir", "/tmp/kv", "--kv-disk-space-mb", "64",
                                      "--max-queue", "3", "--api-key", "k"])
    assert (args.kv_disk_dir, args.kv_disk_space_mb, args.max_queue, args.api_key) == ("/tmp/kv", 64, 3, ["k"])
    assert _api_key(args.api_key) == "k"  # one key: the config holds it as before
    assert _api_key(["a", "b", "a"]) == ("a", "b")  # several: each a tenant
    args = build_parser().parse_args(["serve", "--checkpoint-interval", "0", "--checkpoint-memory-mb", "8"])
    assert (args.checkpoint_interval, args.checkpoint_memory_mb) == (0, 8)


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_api_backlog_must_be_a_positive_size(capsys, value):
    """An API process's backlog in the core is bounded: no bound (0) is not a choice."""
    with pytest.raises(SystemExit) as e:
        serve_parser().parse_args(["--api-backlog-mb", value])
    assert e.value.code == 2 and "--api-backlog-mb" in capsys.readouterr().err
    assert serve_parser().parse_args(["--api-backlog-mb", "0.5"]).api_backlog_mb == 0.5


def test_api_servers_need_the_engine_core_process(capsys):
    assert main(["serve", "--api-servers", "2", "--engine-core", "thread"]) == 2
    assert "--api-servers N needs the engine core in a process of its own" in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["--max-sessions", "2", "--max-batch", "4"], "--max-sessions 2 is less than --max-batch 4"),
    (["--kv-disk-space-mb", "64"], "--kv-disk-space-mb needs --kv-disk-dir"),
    (["--ctx", "999999999"], "--ctx 999999999 is larger than the model's max_position_embeddings"),
    (["--kv-block-tokens", "100"], "--kv-block-tokens 100 must be a multiple of every compression rate"),
    (["--tp-timeout", "5"], "--tp-timeout needs --tp N"),
    (["--port", "BUSY"], "is in use"),
])
def test_flag_errors_come_before_anything_loads(capsys, monkeypatch, argv, fragment):
    """A flag error that needs no weights is one line, before the tokenizer or the model loads and
    before anything is logged (a port in use included: not after "Application startup complete")."""
    import socket

    import serve.core.setup as setup

    def loading(*args, **kwargs):
        raise AssertionError("loaded before the flags were checked")

    monkeypatch.setattr(setup, "load_model_tokenizer", loading)
    monkeypatch.setattr(setup, "load_model", loading)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        argv = [str(busy.getsockname()[1]) if a == "BUSY" else a for a in argv]
        assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ds4-torch: error: ") and fragment in err, err


def test_the_api_key_help_names_both_headers():
    help_text = next(a.help for a in serve_parser()._actions if "--api-key" in a.option_strings)
    assert "Authorization: Bearer KEY" in help_text and "x-api-key: KEY" in help_text


def test_serve_bad_model_dir(capsys, tmp_path):
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "model directory not found" in capsys.readouterr().err


def test_python_m_serve_process():
    """A real process, its key from the environment (DS4_TORCH_API_KEY, no --api-key); Ctrl-C ends
    it (status 0) and its engine core process."""
    with serve_process("--ctx", "256", "--prefill-chunk", "64", timeout=60, env_extra={API_KEY_ENV: "k3y"}) as proc:
        body = {"model": "ds4-default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "ignore_eos": True}
        r = httpx.post(proc.url + "/v1/chat/completions", timeout=30, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = httpx.post(proc.url + "/v1/chat/completions", timeout=30, json=body, headers={"Authorization": "Bearer k3y"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        log = interrupt(proc)
    core = re.search(r"engine core: process (\d+)", log)
    assert core, log  # by default the engine runs in a process of its own
    wait_for(lambda: gone(int(core.group(1))), 10, "the engine core to exit")
    # A first request reuses nothing: every prompt token is recomputed.
    assert re.search(r"ds4\.serve: .*\"POST /v1/chat/completions\" 200 .*prompt_tokens=(\d+) cached_tokens=0 "
                     r"recomputed_tokens=\1 generated_tokens=3 finish=length", log), log


def test_engine_core_thread_keeps_the_engine_in_the_server_process():
    """`--engine-core thread`: one process (no engine core child), answering as before."""
    with serve_process("--ctx", "256", "--prefill-chunk", "64", "--engine-core", "thread", timeout=60) as proc:
        r = httpx.post(proc.url + "/v1/completions", timeout=30, json={
            "model": "ds4-default", "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        log = interrupt(proc)
    assert "engine core: process" not in log and "API process" not in log


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_a_bind_beyond_loopback_without_a_key_is_warned(monkeypatch, caplog, engine_core):
    """`--host` other than loopback and no key (neither --api-key nor DS4_TORCH_API_KEY): one
    warning. The server is set up as `ds4-torch serve` sets it up, up to uvicorn's run, which
    binds nothing here (a documentation address, and the server never starts: status 3); the
    port check before loading is left out for the same reason (this machine has no such address)."""
    import uvicorn

    import serve.cli

    hosts = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: hosts.append(self.config.host))
    monkeypatch.setattr(serve.cli, "check_port_free", lambda host, port: None)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    caplog.set_level("WARNING", logger="ds4.serve")

    def warnings(*argv, env_key=None):
        caplog.clear()
        if env_key:
            monkeypatch.setenv(API_KEY_ENV, env_key)
        try:
            assert main(["serve", "--ctx", "256", "--engine-core", engine_core, *argv]) == 3
        finally:
            monkeypatch.delenv(API_KEY_ENV, raising=False)
        return [r.getMessage() for r in caplog.records if "--api-key" in r.getMessage()]

    assert warnings("--host", "192.0.2.7") == [
        "binding to 192.0.2.7 without --api-key: anyone who can reach it can use it"]
    assert hosts == ["192.0.2.7"]
    if engine_core == "thread":  # (the key is read in one place for both: the other cases once)
        assert warnings("--host", "192.0.2.7", env_key="k3y") == []
        assert warnings("--host", "192.0.2.7", "--api-key", "k3y") == []
        assert warnings() == [] and hosts[-1] == "127.0.0.1"
        assert warnings("--host", "127.0.0.2") == [] and warnings("--host", "::1") == []  # loopback, all of it
