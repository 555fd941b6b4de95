"""Real Claude Code and Codex against the server (opt in: ``pytest -m clients``).

They need npm (the pinned CLIs are installed on first use into ~/.cache/ds4_torch/clients), root
(for ``unshare -n``: server and client run in a private network namespace, so the clients can
reach nothing off this machine) and ``ip``. `tests/clients/drive.py` runs them: ``claude -p
"List the files in this directory."`` with only a base URL and a key, and ``codex exec "What is
the weather in Paris?"`` with the README's provider config, its default tools and one stdio MCP
server; a logging proxy records every exchange. Each client must finish, every request it sent
must get a 2xx, and no response body may carry markup. The server runs as a user runs it: the
embedded model and the default context (its 131,072 positions; the clients' first prompts are
20K-26K tokens). Whether the model completes tool loops is measured, not asserted here:
``drive.py --runs 5`` (see README "The default model").
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.clients
HERE = Path(__file__).resolve().parents[1]  # tests/
MARKUP = ("｜DSML｜", "<｜", "<think>", "</think>", "<tool_result>", "</tool_result>")
CLIENTS_DIR = Path(os.environ.get("DS4_CLIENTS_DIR", Path.home() / ".cache" / "ds4_torch" / "clients"))


def _missing(interactive: bool = False, codex: bool = True) -> str | None:
    if os.geteuid() != 0:
        return "needs root for `unshare -n`"
    for tool in ("unshare", "npm", "node", "ip") + (("tmux",) if interactive else ()):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if interactive or not codex:
        return None
    try:
        import mcp  # noqa: F401 - the MCP weather server's package
    except ImportError:
        return "needs the `mcp` package (pip install mcp) for the MCP weather server"
    return None


@pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
@pytest.mark.parametrize("tp", [1, 2], ids=["one-process", "tp2-gloo"])
def test_claude_code_and_codex_complete_with_2xx_and_no_markup(tmp_path, tp):
    out = tmp_path / "run"
    cmd = ["unshare", "-n", sys.executable, str(HERE / "clients" / "drive.py"), "--clients-dir", str(CLIENTS_DIR),
           "--out", str(out), "--tp", str(tp)]
    subprocess.run(cmd, check=True, timeout=3000)
    results = json.loads((out / "result.json").read_text())
    assert [(r["client"], r["status"]) for r in results] == [("claude", 0), ("codex", 0)], results
    exchanges = [json.loads(line) for line in (out / "proxy.jsonl").read_text().splitlines()]
    posts = [e for e in exchanges if e["method"] == "POST"]
    assert {e["path"] for e in posts} >= {"/v1/messages", "/v1/responses"}
    for e in exchanges:
        assert 200 <= e["status"] < 300, (e["path"], e["status"], e["response"][:1000])
        assert not [m for m in MARKUP if m in e["response"]], (e["path"], e["response"][-2000:])


@pytest.mark.skipif(_missing(interactive=True) is not None, reason=str(_missing(interactive=True)))
def test_interactive_claude_code_gets_2xx_and_a_reply(tmp_path):
    """Interactive Claude Code (no -p) in tmux, started as the README says: ANTHROPIC_AUTH_TOKEN
    and the first-run ~/.claude.json (`drive.claude_first_run_config`). Every request it sends
    (its structured-output and title requests too) gets a 2xx with no markup, and the pane shows
    the prompt and a reply after it."""
    out = tmp_path / "run"
    cmd = ["unshare", "-n", sys.executable, str(HERE / "clients" / "drive.py"), "--clients-dir", str(CLIENTS_DIR),
           "--out", str(out), "--clients", "claude-interactive", "--timeout", "1800"]
    subprocess.run(cmd, check=True, timeout=3000)
    results = json.loads((out / "result.json").read_text())
    exchanges = [json.loads(line) for line in (out / "proxy.jsonl").read_text().splitlines()]
    assert [e for e in exchanges if e["method"] == "POST" and e["path"] == "/v1/messages"]
    for e in exchanges:
        assert 200 <= e["status"] < 300, (e["path"], e["status"], e["response"][:1000])
        assert not [m for m in MARKUP if m in e["response"]], (e["path"], e["response"][-2000:])
    assert [(r["client"], r["status"]) for r in results] == [("claude-interactive", 0)], results[0]["stdout"]


def _usage(response: str) -> dict:
    """The usage of a streamed (or whole) Anthropic response: message_start's, updated by message_delta's."""
    usage = {}
    for line in response.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            usage.update((event.get("message") or {}).get("usage") or event.get("usage") or {})
    return usage or json.loads(response).get("usage", {})


@pytest.mark.skipif(_missing(codex=False) is not None, reason=str(_missing(codex=False)))
def test_a_second_claude_code_task_reuses_the_first_ones_system_prompt(tmp_path):
    """`claude -p "List the files in this directory."`, then `claude -p "Say hi."` in the same
    directory, against the default server: the second task's first request reuses the system
    prompt and tools the two share, its prompt up to the nearest checkpoint (every 256 tokens)
    before the task's own words (Claude Code 2.1.330: 20,736 of 25,811 tokens; what follows the
    task is its environment notes, a system message after it). Its first system block, billing
    metadata that differs per task, is left out of the prompt; with it in, the second reused 0."""
    sys.path.insert(0, str(HERE / "clients"))
    from drive import PROMPTS, install_clients

    install_clients(str(CLIENTS_DIR), codex=False)  # here: the private namespace reaches no registry
    out = tmp_path / "run"
    cmd = ["unshare", "-n", sys.executable, str(HERE / "clients" / "drive.py"), "--clients-dir", str(CLIENTS_DIR),
           "--out", str(out), "--clients", "claude", "claude-hi"]
    subprocess.run(cmd, check=True, timeout=3000)
    results = json.loads((out / "result.json").read_text())
    assert [(r["client"], r["status"]) for r in results] == [("claude", 0), ("claude-hi", 0)], results
    exchanges = [json.loads(line) for line in (out / "proxy.jsonl").read_text().splitlines()]
    tasks = [[e for e in exchanges[slice(*r["exchanges"])] if e["method"] == "POST" and e["path"] == "/v1/messages"]
             for r in results]
    firsts = [posts[0] for posts in tasks]
    usage = [_usage(e["response"]) for e in firsts]
    prompts = [u["input_tokens"] + u["cache_read_input_tokens"] for u in usage]
    # The server's access log, one line per request in the order they were sent (one at a time).
    log = [line for line in (out / "server.log").read_text().splitlines() if '"POST /v1/messages"' in line]
    line = log[len(tasks[0])]
    summary = {"prompt_tokens": prompts, "usage": usage, "billing": [json.loads(e["request"])["system"][0]["text"]
                                                                     for e in firsts], "log": line}
    print(json.dumps(summary, indent=1))  # the numbers, for the record (-s)
    reused = usage[1]["cache_read_input_tokens"]
    assert usage[0]["cache_read_input_tokens"] == 0 and f"cached_tokens={reused} " in line, summary
    assert reused >= 20_000, summary
    # Where the two first prompts differ: at the task's own words, the nearest checkpoint before them reused.
    reason = re.search(r"reuse_reason=(\w+)", line).group(1)
    assert reason in ("full", "diverged"), summary
    if reason == "diverged":
        diverged_at = int(re.search(r"diverged_at=(\d+)", line).group(1))
        assert diverged_at - 256 < reused <= diverged_at, summary
        ours, theirs = (json.loads(re.search(f' {k}=("(?:[^"\\\\]|\\\\.)*")', line).group(1)) for k in ("ours", "theirs"))
        assert ours.strip() and PROMPTS["claude-hi"].startswith(ours.strip()[:2]), summary
        assert theirs.strip() and PROMPTS["claude"].startswith(theirs.strip()[:2]), summary
