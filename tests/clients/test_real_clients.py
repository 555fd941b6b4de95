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
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.clients
HERE = Path(__file__).resolve().parents[1]  # tests/
MARKUP = ("｜DSML｜", "<｜", "<think>", "</think>", "<tool_result>", "</tool_result>")
CLIENTS_DIR = Path(os.environ.get("DS4_CLIENTS_DIR", Path.home() / ".cache" / "ds4_torch" / "clients"))


def _missing(interactive: bool = False) -> str | None:
    if os.geteuid() != 0:
        return "needs root for `unshare -n`"
    for tool in ("unshare", "npm", "node", "ip") + (("tmux",) if interactive else ()):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if interactive:
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
