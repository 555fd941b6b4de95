"""Drive the real agent clients (Claude Code, Codex) against `ds4-torch serve`, offline.

Run it inside a private network namespace, so the clients can reach nothing off this machine
(root is needed for that)::

    unshare -n python tests/clients/drive.py --clients-dir DIR --out OUT [--model M] [--tp 2]

It brings the loopback interface up, starts the server and a logging proxy in front of it
(`logging_proxy.py`), then runs, each in a scratch directory with a scratch HOME:

* ``claude -p "List the files in this directory."`` with only ANTHROPIC_BASE_URL and a key set
  (``claude-hi``, not run by default: the same with ``claude -p "Say hi."``, a second task);
* ``codex exec "What is the weather in Paris?"`` with the README's provider config and one stdio
  MCP server (`weather_mcp.py`);
* ``claude-interactive`` (not run by default): interactive Claude Code (no ``-p``) in a tmux
  session, as a user runs it: ANTHROPIC_AUTH_TOKEN (interactive mode asks before using an
  ANTHROPIC_API_KEY, and shows "Not logged in" until then) and a first-run ``~/.claude.json``
  marking onboarding done and the folder trusted (`claude_first_run_config`); the prompt is
  typed with send-keys, and the turn is over once the proxy has been idle and the pane no
  longer shows Claude Code working. The pane is kept in OUT (``claude-interactive-pane.txt``).

OUT gets ``proxy.jsonl`` (every request and response body as the client saw it), each client's
output, exit status and lines of ``proxy.jsonl`` in ``result.json``, and the server's log.
`install_clients(DIR)` installs the pinned client versions with npm (the tests' `clients` group
and `record_bodies.py` use it).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loops import claude_loop, codex_loop, completed  # noqa: E402

CLAUDE_CODE_VERSION = "2.1.330"
CODEX_VERSION = "0.169.0"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PROMPTS = {"claude": "List the files in this directory.", "codex": "What is the weather in Paris?",
           "claude-interactive": "Hello! What can you do?", "claude-hi": "Say hi."}
CLAUDE_TASKS = ("claude", "claude-hi")  # `claude -p`, each with its own prompt (a second task after the first)
QUIET_CLAUDE = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1"}


def install_clients(clients_dir: str, codex: bool = True) -> None:
    """The pinned Claude Code (and Codex) CLIs in `clients_dir` (npm; skipped when present)."""
    packages = {"claude": f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}"}
    if codex:
        packages["codex"] = f"@openai/codex@{CODEX_VERSION}"
    if all(os.path.exists(os.path.join(clients_dir, "node_modules", ".bin", b)) for b in packages):
        return
    subprocess.run(["npm", "install", "--prefix", clients_dir, "--no-audit", "--no-fund", *packages.values()],
                   check=True, stdout=subprocess.DEVNULL)


def codex_config(base_url: str, mcp_command: list[str], mcp_env: dict[str, str] | None = None) -> str:
    """The README's Codex provider config, plus one stdio MCP server (started with `mcp_env`:
    Codex passes an MCP server only the variables its config names)."""
    args = ", ".join(json.dumps(a) for a in mcp_command[1:])
    env = ", ".join(f"{k} = {json.dumps(v)}" for k, v in (mcp_env or {}).items())
    return (f'model = "ds4-default"\nmodel_provider = "ds4"\n\n'
            f'[model_providers.ds4]\nname = "ds4_torch"\nbase_url = "{base_url}/v1"\nwire_api = "responses"\n\n'
            f'[mcp_servers.weather]\ncommand = {json.dumps(mcp_command[0])}\nargs = [{args}]\n'
            # `codex exec` never asks: a server's tools run only when approved beforehand
            f'default_tools_approval_mode = "approve"\n' + (f'env = {{ {env} }}\n' if env else ''))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def claude_first_run_config(work: str) -> dict:
    """`~/.claude.json` for a first interactive run against a local server: onboarding (theme,
    login method, security notes) marked done, and `work` trusted (else a trust dialog waits)."""
    return {"hasCompletedOnboarding": True, "theme": "dark",
            "projects": {work: {"hasTrustDialogAccepted": True, "hasCompletedProjectOnboarding": True}}}


def _tmux(sock: str, *args: str, env: dict | None = None) -> str:
    return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True, env=env,
                          check=True).stdout


def _in_flight(server_url: str) -> float:
    """Requests the server is working on or holds in its queue (its /metrics)."""
    with urllib.request.urlopen(server_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("ds4_requests_running ", "ds4_queue_depth ")))


# A dialog waiting for the user (a tool's permission, a notice): answered with Escape, which
# declines it (a weak model's tool calls are not run as root here).
DIALOGS = ("Esc to cancel", "Do you want to proceed?")
REPLY_MARKS = ("●", "⏺")  # how Claude Code starts each reply line (text or a tool use)


def run_claude_interactive(bin_dir: str, proxy_url: str, out: str, timeout: float, run: int = 0,
                           server_url: str | None = None) -> dict:
    """Interactive Claude Code in tmux: start it, type the prompt, wait for the turn to end (no
    request in flight at `server_url`, the pane no longer showing Claude Code at work).
    status 0: the pane shows the prompt and, after it, a reply; else what went wrong."""
    tag = f"claude-interactive-{run}" if run else "claude-interactive"
    work, home = os.path.join(out, f"{tag}-work"), os.path.join(out, f"{tag}-home")
    os.makedirs(work, exist_ok=True)
    os.makedirs(home, exist_ok=True)
    with open(os.path.join(work, "main.py"), "w") as f:
        f.write("print('hello')\n")
    with open(os.path.join(home, ".claude.json"), "w") as f:
        json.dump(claude_first_run_config(work), f)
    # As a user starts it: the two variables alone (no switch for nonessential traffic: its
    # requests, such as a structured-output one, must be answered too).
    env = {"PATH": os.environ.get("PATH", ""), "HOME": home, "TERM": "xterm-256color", "LANG": "C.UTF-8",
           "ANTHROPIC_BASE_URL": proxy_url, "ANTHROPIC_AUTH_TOKEN": "x"}
    sock, log = f"ds4-{os.getpid()}-{run}", os.path.join(out, "proxy.jsonl")
    pane_path = os.path.join(out, f"{tag}-pane.txt")
    t0 = time.time()

    def pane() -> str:
        return _tmux(sock, "capture-pane", "-p", "-J", "-t", "claude")

    status, shown = "timeout", ""
    try:
        _tmux(sock, "new-session", "-d", "-s", "claude", "-x", "160", "-y", "50", "-c", work,
              os.path.join(bin_dir, "claude"), env=env)
        # Ready once the screen stops changing (the input box drawn).
        last, stable = "", 0
        while time.time() - t0 < 120 and stable < 3:
            time.sleep(1)
            now = pane()
            stable = stable + 1 if now == last and now.strip() else 0
            last = now
        with open(os.path.join(out, f"{tag}-pane-start.txt"), "w") as f:
            f.write(last)
        seen = _lines(log)
        _tmux(sock, "send-keys", "-t", "claude", "-l", PROMPTS["claude-interactive"])
        time.sleep(1)
        _tmux(sock, "send-keys", "-t", "claude", "Enter")
        # The turn is over when, for 15 s, the server had nothing in flight (the proxy logs an
        # exchange only once it ended), the proxy logged nothing new and the pane no longer says
        # Claude Code is working ("esc to interrupt").
        quiet_since, count = time.time(), seen
        while time.time() - t0 < timeout:
            time.sleep(2)
            shown = pane()
            if any(d in shown for d in DIALOGS):
                _tmux(sock, "send-keys", "-t", "claude", "Escape")
                quiet_since = time.time()
                continue
            now = _lines(log)
            busy = "esc to interrupt" in shown or (server_url is not None and _in_flight(server_url) > 0)
            if now != count or busy:
                count, quiet_since = now, time.time()
            if count > seen and time.time() - quiet_since > 15:
                after = shown.split(PROMPTS["claude-interactive"], 1)
                replied = len(after) == 2 and any(m in after[1] for m in REPLY_MARKS)
                status = 0 if replied else "no reply in the pane"
                break
    except (subprocess.CalledProcessError, OSError) as e:
        status = f"tmux: {e}"
    finally:
        try:
            shown = pane()
        except (subprocess.CalledProcessError, OSError):
            pass
        with open(pane_path, "w") as f:
            f.write(shown)
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)
    return {"client": "claude-interactive", "run": run, "status": status, "seconds": round(time.time() - t0, 1),
            "stdout": shown, "stderr": ""}


def run_client(name: str, bin_dir: str, proxy_url: str, out: str, timeout: float, run: int = 0,
               server_url: str | None = None) -> dict:
    if name == "claude-interactive":
        return run_claude_interactive(bin_dir, proxy_url, out, timeout, run, server_url)
    # Claude Code's tasks run as one user's would, one after another: the same directory and HOME
    # (the system prompt names both; a second task on another path would share less of it).
    base = "claude" if name in CLAUDE_TASKS else name
    tag = f"{base}-{run}" if run else base
    work = os.path.join(out, f"{tag}-work")
    home = os.path.join(out, f"{tag}-home")
    os.makedirs(work, exist_ok=True)
    os.makedirs(home, exist_ok=True)
    for fname, text in (("main.py", "print('hello')\n"), ("README.md", "# demo\n"), ("notes.txt", "todo\n")):
        with open(os.path.join(work, fname), "w") as f:
            f.write(text)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": home, "TERM": "dumb", "LANG": "C.UTF-8"}
    if name in CLAUDE_TASKS:
        env.update(QUIET_CLAUDE, ANTHROPIC_BASE_URL=proxy_url, ANTHROPIC_API_KEY="x")
        cmd = [os.path.join(bin_dir, "claude"), "-p", PROMPTS[name]]
    else:
        codex_home = os.path.join(home, ".codex")
        os.makedirs(codex_home, exist_ok=True)
        mcp = [sys.executable, os.path.join(HERE, "weather_mcp.py")]
        calls_log = os.path.join(out, f"{tag}-weather_calls.jsonl")
        with open(os.path.join(codex_home, "config.toml"), "w") as f:
            f.write(codex_config(proxy_url, mcp, {"WEATHER_MCP_LOG": calls_log}))
        env.update(CODEX_HOME=codex_home)
        cmd = [os.path.join(bin_dir, "codex"), "exec", "--skip-git-repo-check", PROMPTS[name]]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        status, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        status, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
    return {"client": name, "run": run, "status": status, "seconds": round(time.time() - t0, 1),
            "stdout": stdout if isinstance(stdout, str) else stdout.decode("utf-8", "replace"),
            "stderr": (stderr if isinstance(stderr, str) else stderr.decode("utf-8", "replace"))[-4000:]}


def _entries(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _lines(path: str) -> int:
    return len(_entries(path))


def judge_loop(name: str, exchanges: list[dict], out: str, run: int) -> dict:
    tag = f"{name}-{run}" if run else name
    if name.startswith("claude"):
        return claude_loop(exchanges)
    calls_path = os.path.join(out, f"{tag}-weather_calls.jsonl")
    return codex_loop(exchanges, _entries(calls_path))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients-dir", required=True, help="where the npm clients are (installed if missing)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--ctx", type=int, default=None)
    p.add_argument("--tp", type=int, default=1, help="serve with torchrun --nproc-per-node N (gloo)")
    p.add_argument("--clients", nargs="+", default=["claude", "codex"],
                   choices=[*CLAUDE_TASKS, "codex", "claude-interactive"])
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per client run")
    p.add_argument("--serve-args", default="", help="more arguments for the server, one string (e.g. "
                                                       "'--speculative-tokens 2')")
    p.add_argument("--runs", type=int, default=1, help="runs per client, each in a fresh directory; with more "
                                                      "than one, each run's tool loop is judged (loops.py)")
    p.add_argument("--record", default=None, metavar="TRAINING_JSON",
                   help="append the tool-loop tally to this training.json's 'real_clients' list (the model's record)")
    a = p.parse_args()
    if "codex" in a.clients:
        try:
            import mcp  # noqa: F401 - Codex's MCP weather server needs it: without it Codex offers no get_weather
        except ImportError:
            p.error("codex needs the `mcp` package for its MCP weather server (pip install mcp)")
    os.makedirs(a.out, exist_ok=True)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    install_clients(a.clients_dir, codex="codex" in a.clients)
    port, proxy_port = _free_port(), _free_port()
    serve = ["serve", "--port", str(port)] + (["--model", a.model] if a.model else []) + \
        (["--ctx", str(a.ctx)] if a.ctx else []) + shlex.split(a.serve_args)
    if a.tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.tp), "-m", "ds4_torch",
               *serve, "--tp", str(a.tp)]
    else:
        cmd = [sys.executable, "-m", "ds4_torch", *serve]
    server_log = open(os.path.join(a.out, "server.log"), "w")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    server = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT, env=env)
    proxy = subprocess.Popen([sys.executable, os.path.join(HERE, "logging_proxy.py"), "--upstream",
                              f"http://127.0.0.1:{port}", "--port", str(proxy_port), "--log",
                              os.path.join(a.out, "proxy.jsonl")], env=env)
    results = []
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", 600, server)
        _wait_http(f"http://127.0.0.1:{proxy_port}/health", 60, proxy)
        bin_dir = os.path.join(a.clients_dir, "node_modules", ".bin")
        log = os.path.join(a.out, "proxy.jsonl")
        for run in range(1, a.runs + 1) if a.runs > 1 else [0]:
            for name in a.clients:
                seen = _lines(log)
                result = run_client(name, bin_dir, f"http://127.0.0.1:{proxy_port}", a.out, a.timeout, run,
                                    server_url=f"http://127.0.0.1:{port}")
                time.sleep(1)  # the proxy writes an exchange once its response has ended
                result["exchanges"] = [seen, _lines(log)]  # its lines of proxy.jsonl
                result["loop"] = judge_loop(name, _entries(log)[seen:], a.out, result["run"])
                result["completed_loop"] = completed(result["loop"])
                results.append(result)
    finally:
        for proc in (proxy, server):
            proc.terminate()
        for proc in (proxy, server):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server_log.close()
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(results, f, indent=2)
    for r in results:
        loop = r["loop"]
        print(f"{r['client']} run {r['run']}: status {r['status']} in {r['seconds']} s; called {loop['called']}, "
              f"ran {loop['ran']}, answered {loop['answered']}: {'loop completed' if r['completed_loop'] else 'no loop'}")
    for name in a.clients:
        mine = [r for r in results if r["client"] == name]
        print(f"{name}: {sum(r['completed_loop'] for r in mine)} of {len(mine)} runs completed a tool loop")
    if a.record:
        record_tally(a, results)
    return 0


def record_tally(a, results: list[dict]) -> None:
    """The runs' tally in the model's training.json, beside its training record."""
    with open(a.record) as f:
        record = json.load(f)
    tally = {"script": "tests/clients/drive.py", "date": time.strftime("%Y-%m-%d"), "runs": a.runs,
             "model": a.model or "embedded", "serve_args": a.serve_args, "tp": a.tp}
    for name in a.clients:
        mine = [r for r in results if r["client"] == name]
        tally[name] = {"completed_loops": sum(r["completed_loop"] for r in mine), "runs": len(mine),
                       "called": [r["loop"]["called"] for r in mine],
                       "ran": [r["loop"]["ran"] for r in mine], "answered": [r["loop"]["answered"] for r in mine]}
    record.setdefault("real_clients", []).append(tally)
    with open(a.record, "w") as f:
        json.dump(record, f, indent=2, ensure_ascii=False)


if __name__ == "__main__":
    if shutil.which("ip") is None:
        sys.exit("drive.py needs `ip` (iproute2) to bring up the loopback interface")
    sys.exit(main())
