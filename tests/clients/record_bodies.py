"""Turn what real clients sent (the logging proxy's log, see `drive.py`) into the request bodies
that `tests/server/http/test_client_bodies.py` replays in the default suite.

    python tests/clients/record_bodies.py PROXY_LOG [PROXY_LOG ...] --out tests/data/clients

Every field and shape is kept; the clients' own text is replaced by short text of ours: every
tool and schema ``description``, the system prompt, instructions and any other string longer
than `LONG` characters (system reminders, environment notes), and identifiers (user and session
ids). The user's prompt (short) stays. One file per (client, endpoint, first request of a run),
named ``{client}-{n}.json``: ``{"client", "endpoint", "headers", "body"}``.
"""
from __future__ import annotations

import argparse
import json
import os
import re

LONG = 160
KEPT_HEADERS = ("anthropic-beta", "anthropic-version")
TEXT = "Short text standing in for the client's own ({n} characters)."


def scrub(value, key: str | None = None, in_tool: bool = False):
    """`value` with the client's own text replaced (see the module docstring)."""
    if isinstance(value, dict):
        tool = in_tool or key == "tools"
        return {k: scrub(v, k, tool) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, key, in_tool or key == "tools") for v in value]
    if isinstance(value, str):
        if key == "description" and in_tool:
            return "Description replaced."
        if key in ("user_id", "prompt_cache_key", "session_id", "thread_id") or key and key.startswith("x-codex"):
            return f"{key}-example"
        if len(value) > LONG:
            return TEXT.format(n=len(value))
    return value


def client_of(entry: dict) -> str:
    agent = entry.get("headers", {}).get("user-agent", "")
    return "claude-code" if "claude" in agent else "codex" if "codex" in agent.lower() else "client"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    counts: dict[str, int] = {}
    for log in a.logs:
        for line in open(log, encoding="utf-8"):
            entry = json.loads(line)
            if entry["method"] != "POST" or not entry["request"]:
                continue
            client = client_of(entry)
            counts[client] = counts.get(client, 0) + 1
            record = {"client": entry.get("headers", {}).get("user-agent", client),
                      "endpoint": entry["path"], "status_seen": entry["status"],
                      "headers": {k: v for k, v in entry.get("headers", {}).items() if k in KEPT_HEADERS},
                      "body": scrub(json.loads(entry["request"]))}
            name = re.sub(r"[^a-z0-9-]", "", client) + f"-{counts[client]}.json"
            with open(os.path.join(a.out, name), "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1, ensure_ascii=False)
                f.write("\n")
            print(name, entry["path"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
