"""Did a real client complete a tool loop? Read from the logging proxy's exchanges (and, for
Codex, the MCP server's call log): the model called an offered tool, the client ran it and sent
the result back, and the model answered after the result in text.

* Claude Code (Anthropic Messages): a later request carries a ``tool_result`` block for a
  ``tool_use`` of an earlier assistant turn; the tool ran when the block is not an error (a
  refused permission comes back as an error result); the answer is the text of the response to
  that request.
* Codex (Responses): a later request carries a ``function_call_output`` for an earlier
  ``function_call``; an MCP tool ran when the MCP server logged the call; the answer is the
  ``output_text`` of the response to that request.
"""
from __future__ import annotations

import json


def _sse_text(body: str, delta_types: tuple[str, ...]) -> str:
    """The text a streamed (SSE) or whole JSON response carries."""
    text = []
    for line in body.splitlines():
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        delta = event.get("delta")
        if isinstance(delta, dict) and delta.get("type") == "text_delta":  # Anthropic
            text.append(delta.get("text", ""))
        elif event.get("type") in delta_types and isinstance(delta, str):  # Responses
            text.append(delta)
    if not text:
        try:
            whole = json.loads(body)
        except ValueError:
            return ""
        for block in whole.get("content", []) or []:
            if isinstance(block, dict) and block.get("type") == "text":
                text.append(block.get("text", ""))
        for item in whole.get("output", []) or []:
            for part in item.get("content", []) or [] if isinstance(item, dict) else []:
                if isinstance(part, dict) and part.get("type") == "output_text":
                    text.append(part.get("text", ""))
    return "".join(text)


def _result_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return ""


def claude_loop(exchanges: list[dict]) -> dict:
    """{"called": [tool names], "ran": bool, "answered": bool, "result": str, "answer": str}."""
    out = {"called": [], "ran": False, "answered": False, "result": "", "answer": ""}
    for e in exchanges:
        if e.get("method") != "POST" or not e.get("path", "").startswith("/v1/messages") or \
                e["path"].endswith("count_tokens"):
            continue
        try:
            body = json.loads(e["request"])
        except ValueError:
            continue
        uses = {}
        for m in body.get("messages", []):
            for block in m.get("content", []) if isinstance(m.get("content"), list) else []:
                if not isinstance(block, dict):
                    continue
                if m.get("role") == "assistant" and block.get("type") == "tool_use":
                    uses[block.get("id")] = block.get("name")
        last = body.get("messages", [])[-1:] or [{}]
        content = last[0].get("content") if isinstance(last[0].get("content"), list) else []
        results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"
                   and b.get("tool_use_id") in uses]
        if not results:
            continue
        out["called"] = sorted(set(out["called"]) | {uses[b["tool_use_id"]] for b in results})
        ran = [b for b in results if not b.get("is_error")]
        out["ran"] = out["ran"] or bool(ran)
        out["result"] = _result_text((ran or results)[0].get("content"))[:300]
        answer = _sse_text(e.get("response", ""), ())
        if answer.strip() and 200 <= e.get("status", 0) < 300:
            out["answered"], out["answer"] = True, answer[:300]
    return out


def codex_loop(exchanges: list[dict], mcp_calls: list[dict]) -> dict:
    """{"called": [tool names], "ran": bool (the MCP server ran a call), "answered", "answer"}."""
    out = {"called": [], "ran": bool(mcp_calls), "answered": False, "mcp_calls": mcp_calls[:5], "answer": ""}
    for e in exchanges:
        if e.get("method") != "POST" or not e.get("path", "").startswith("/v1/responses"):
            continue
        try:
            body = json.loads(e["request"])
        except ValueError:
            continue
        items = body.get("input", []) if isinstance(body.get("input"), list) else []
        calls = {i.get("call_id"): i.get("name") for i in items if isinstance(i, dict) and i.get("type") in
                 ("function_call", "custom_tool_call")}
        outputs = [i for i in items if isinstance(i, dict) and i.get("type") in
                   ("function_call_output", "custom_tool_call_output") and i.get("call_id") in calls]
        if not outputs or items[-1] not in outputs:  # the turn right after the results
            continue
        out["called"] = sorted(set(out["called"]) | {calls[i["call_id"]] for i in outputs})
        answer = _sse_text(e.get("response", ""), ("response.output_text.delta",))
        if answer.strip() and 200 <= e.get("status", 0) < 300:
            out["answered"], out["answer"] = True, answer[:300]
    return out


def completed(loop: dict) -> bool:
    """The issue's measure: the client ran a tool the model called, and the model answered after."""
    return bool(loop["called"]) and loop["ran"] and loop["answered"]
