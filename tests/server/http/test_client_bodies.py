"""Request bodies the real agent clients sent (Claude Code 2.1.330, Codex CLI 0.169.0), replayed.

`tests/data/clients/` holds what `tests/clients/record_bodies.py` kept of real runs (every
field and shape; the clients' own prompts and tool descriptions replaced by short text), and
the hand-cut bodies that today's clients were refused with (``minimal-*``). Each must be
answered 2xx by a server with its defaults (the embedded model), through the endpoint the client
used (and count_tokens for Anthropic bodies), with no markup anywhere in what comes back.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from ds4_torch.default_model import DEFAULT_MODEL_DIR
from ds4_torch.model import DS4ForCausalLM
from helpers import server

DATA = Path(__file__).resolve().parents[2] / "data" / "clients"
RECORDS = sorted(DATA.glob("*.json"))
MARKUP = ("｜DSML｜", "<｜", "<think>", "</think>", "<tool_result>", "</tool_result>")


@pytest.fixture(scope="module")
def srv(tok):
    model = DS4ForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, progress=False)
    # 8,192 tokens hold every recorded prompt (<= 5,817) and bound a sampled reply that never ends (the bodies ask
    # for up to 32,000 tokens) to seconds: what is checked is that each body is accepted and answered.
    with server(model, tok, ctx=8192) as s:
        yield s


def test_there_are_recorded_bodies_of_both_clients():
    clients = {json.loads(p.read_text())["client"].split("/")[0] for p in RECORDS}
    assert {"claude-cli", "codex_exec"} <= clients, clients


@pytest.mark.parametrize("path", RECORDS, ids=[p.stem for p in RECORDS])
def test_a_recorded_client_request_is_served(srv, path):
    record = json.loads(path.read_text())
    body = record["body"]
    headers = {"content-type": "application/json", "x-api-key": "x", **record["headers"]}
    r = httpx.post(srv.url + record["endpoint"], json=body, headers=headers, timeout=300)
    assert 200 <= r.status_code < 300, r.text[:2000]
    assert not [m for m in MARKUP if m in r.text], r.text[-2000:]
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events and not any(e.get("type") == "error" for e in events)
        last = events[-1]
        assert last.get("type") in ("message_stop", "response.completed", "response.incomplete"), last
    elif record["endpoint"] == "/v1/responses":
        assert r.json()["model"] == body["model"]  # one model answers to any name, echoed
    if record["endpoint"] == "/v1/messages":
        counted = httpx.post(srv.url + "/v1/messages/count_tokens", json=body, headers=headers)
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
