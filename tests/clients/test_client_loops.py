"""tests/clients/loops.py judges whether a real client completed a tool loop; here on exchanges
written in each API's wire format (the shapes Claude Code and Codex send and get)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from loops import claude_loop, codex_loop, completed  # noqa: E402


def _sse(events: list[dict]) -> str:
    return "".join(f"event: {e.get('type', 'message')}\ndata: {json.dumps(e)}\n\n" for e in events)


def _anthropic_text(text: str) -> str:
    return _sse([{"type": "message_start", "message": {"content": []}},
                 {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                 {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
                 {"type": "message_stop"}])


def _claude_exchanges(result_block: dict, answer: str) -> list[dict]:
    user = {"role": "user", "content": [{"type": "text", "text": "List the files in this directory."}]}
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                             "input": {"command": "ls"}}]}
    first = {"method": "POST", "path": "/v1/messages", "status": 200,
             "request": json.dumps({"messages": [user]}), "response": _sse([{"type": "message_stop"}])}
    second = {"method": "POST", "path": "/v1/messages", "status": 200,
              "request": json.dumps({"messages": [user, use, {"role": "user", "content": [result_block]}]}),
              "response": _anthropic_text(answer)}
    return [first, second]


def test_claude_loop_ran_and_answered():
    loop = claude_loop(_claude_exchanges({"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "main.py\nREADME.md"}, "There are two files."))
    assert loop["called"] == ["Bash"] and loop["ran"] and loop["answered"] and completed(loop)
    assert loop["answer"] == "There are two files." and "main.py" in loop["result"]


def test_claude_refused_permission_or_no_answer_is_no_loop():
    refused = claude_loop(_claude_exchanges({"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                             "content": "permission denied"}, "I could not."))
    assert refused["called"] == ["Bash"] and not refused["ran"] and not completed(refused)
    silent = claude_loop(_claude_exchanges({"type": "tool_result", "tool_use_id": "toolu_1", "content": "a"}, ""))
    assert silent["ran"] and not silent["answered"] and not completed(silent)
    assert not completed(claude_loop(_claude_exchanges({"type": "text", "text": "no tool"}, "hello")))


def _codex_exchanges(with_output: bool, answer: str) -> list[dict]:
    ask = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "namespace": "mcp__weather",
            "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": '{"conditions": "sunny"}'}
    items = [ask, call] + ([output] if with_output else [])
    response = _sse([{"type": "response.output_text.delta", "delta": answer},
                     {"type": "response.completed", "response": {"output": []}}])
    return [{"method": "POST", "path": "/v1/responses", "status": 200, "request": json.dumps({"input": [ask]}),
             "response": _sse([{"type": "response.completed"}])},
            {"method": "POST", "path": "/v1/responses", "status": 200, "request": json.dumps({"input": items}),
             "response": response}]


def test_codex_loop_needs_the_mcp_call_the_output_and_an_answer():
    ran = [{"tool": "get_weather", "city": "Paris"}]
    loop = codex_loop(_codex_exchanges(True, "It is sunny in Paris."), ran)
    assert loop["called"] == ["get_weather"] and completed(loop) and loop["answer"] == "It is sunny in Paris."
    assert not completed(codex_loop(_codex_exchanges(True, "It is sunny."), []))  # the MCP server ran nothing
    assert not completed(codex_loop(_codex_exchanges(False, "It is sunny."), ran))  # no result went back
    assert not completed(codex_loop(_codex_exchanges(True, ""), ran))  # no answer after it
