"""DeepSeek-V4 chat encoding against expectations written by hand.

Every expected prompt here is typed out from DeepSeek's encoder (``encoding/encoding_dsv4.py``
in deepseek-ai/DeepSeek-V4-Flash) and its published golden output
``encoding/tests/test_output_1.txt``, never produced by ds4_torch: special tokens, the tools
section and the reasoning-effort texts are spelled out below on purpose.
"""
import json

import pytest

from ds4_torch.chat_encoding import (
    detect_effort_profile, render_assistant_completion, render_prompt, render_tools_section,
)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"

# The tools section of the official template, for a list of one-line JSON schemas.
TOOLS_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    "\"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"

EFFORT_ABSOLUTE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\nExplicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
EFFORT_BEYOND = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\nDo not stop reasoning until you have "
    "independently verified the solution from multiple angles and are certain that no assumption remains "
    "unchecked and no error remains undiscovered.\n\n"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a specific location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
        "required": ["location"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web for information",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "description": "Search query"},
        "num_results": {"type": "integer", "description": "Number of results to return"}},
        "required": ["query"]}}}
WEATHER_JSON = (
    '{"name": "get_weather", "description": "Get the weather for a specific location", "parameters": '
    '{"type": "object", "properties": {"location": {"type": "string", "description": "The city name"}, '
    '"unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}}, '
    '"required": ["location"]}}'
)
SEARCH_JSON = (
    '{"name": "search", "description": "Search the web for information", "parameters": {"type": "object", '
    '"properties": {"query": {"type": "string", "description": "Search query"}, "num_results": '
    '{"type": "integer", "description": "Number of results to return"}}, "required": ["query"]}}'
)


def call(name, arguments, call_id=None):
    c = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return c if call_id is None else {"id": call_id, **c}


# --------------------------------------------------------------------------- published golden output
def test_official_golden_case_1_thinking_with_tools():
    """encoding/tests/test_output_1.txt: tools on the system prompt, a reasoned tool call, its
    result in a user turn, and a final answer; with tools nothing is dropped."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Beijing?"},
        {"role": "assistant", "content": "",
         "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
         "tool_calls": [call("get_weather", '{"location": "Beijing", "unit": "celsius"}', "call_001")]},
        {"role": "tool", "tool_call_id": "call_001",
         "content": '{"temperature": 22, "condition": "sunny", "humidity": 45}'},
        {"role": "assistant",
         "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity.",
         "reasoning_content": "Got the weather data. Let me format a nice response."},
    ]
    expected = (
        BOS + "You are a helpful assistant.\n\n" + TOOLS_HEAD + WEATHER_JSON + "\n" + SEARCH_JSON + TOOLS_TAIL
        + U + "What's the weather in Beijing?" + A
        + "<think>The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        "<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"location\" string=\"true\">Beijing</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"unit\" string=\"true\">celsius</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>" + EOS
        + U + "<tool_result>{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}</tool_result>"
        + A + "<think>Got the weather data. Let me format a nice response.</think>"
        "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity." + EOS
    )
    assert len(expected) == 2281  # the published file's length
    assert render_prompt(messages, tools=[WEATHER, SEARCH], thinking=True) == expected


# --------------------------------------------------------------------------- thinking and chat modes
TWO_TURNS = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "One"},
    {"role": "assistant", "content": "First answer.", "reasoning_content": "First reasoning."},
    {"role": "user", "content": "Two"},
]


def test_thinking_drops_earlier_reasoning():
    # The earlier turn loses its reasoning and its </think> moves to the prompt side.
    assert render_prompt(TWO_TURNS, thinking=True) == (
        f"{BOS}S{U}One{A}</think>First answer.{EOS}{U}Two{A}<think>")


def test_tools_keep_earlier_reasoning():
    echo = {"type": "function", "function": {"name": "echo", "description": "Echo the text back.", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "description": "The text"}}, "required": ["text"]}}}
    schema = ('{"name": "echo", "description": "Echo the text back.", "parameters": {"type": "object", "properties": '
              '{"text": {"type": "string", "description": "The text"}}, "required": ["text"]}}')
    assert render_prompt(TWO_TURNS, tools=[echo], thinking=True) == (
        f"{BOS}S\n\n{TOOLS_HEAD}{schema}{TOOLS_TAIL}"
        f"{U}One{A}<think>First reasoning.</think>First answer.{EOS}{U}Two{A}<think>")


def test_drop_thinking_off_keeps_earlier_reasoning():
    assert render_prompt(TWO_TURNS, thinking=True, drop_thinking=False) == (
        f"{BOS}S{U}One{A}<think>First reasoning.</think>First answer.{EOS}{U}Two{A}<think>")


def test_chat_mode_has_no_reasoning_anywhere():
    assert render_prompt(TWO_TURNS, thinking=False) == (
        f"{BOS}S{U}One{A}</think>First answer.{EOS}{U}Two{A}</think>")


def test_last_assistant_turn_keeps_reasoning_and_earlier_ones_do_not():
    conversation = TWO_TURNS + [{"role": "assistant", "content": "Second.", "reasoning_content": "Why."}]
    assert render_prompt(conversation, thinking=True) == (
        f"{BOS}S{U}One{A}</think>First answer.{EOS}{U}Two{A}<think>Why.</think>Second.{EOS}")


def test_add_generation_prompt_false_stops_after_the_user_turn():
    assert render_prompt(TWO_TURNS, thinking=True, add_generation_prompt=False) == (
        f"{BOS}S{U}One{A}</think>First answer.{EOS}{U}Two")


def test_tools_without_a_system_message_follow_bos():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert render_prompt([{"role": "user", "content": "Q"}], tools=[tool]) == (
        f"{BOS}\n\n{TOOLS_HEAD}" '{"name": "f", "parameters": {"type": "object"}}' f"{TOOLS_TAIL}{U}Q{A}</think>")
    assert render_tools_section([tool]) == TOOLS_HEAD + '{"name": "f", "parameters": {"type": "object"}}' + TOOLS_TAIL


def test_response_format_follows_the_system_prompt():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert render_prompt(messages, response_format={"type": "json_object", "path": "a/b"}) == (
        f"{BOS}S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        '{"type": "json_object", "path": "a/b"}' f"{U}Q{A}</think>")


# --------------------------------------------------------------------------- reasoning effort
@pytest.mark.parametrize("profile, effort, prefix", [
    ("v4", None, ""), ("v4", "low", ""), ("v4", "high", ""), ("v4", "max", EFFORT_ABSOLUTE),
    ("v4-0731", None, ""), ("v4-0731", "low", ""), ("v4-0731", "high", EFFORT_ABSOLUTE),
    ("v4-0731", "max", EFFORT_BEYOND),
])
def test_reasoning_effort_prefixes_the_prompt_in_thinking_mode(profile, effort, prefix):
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "1+1=?"}]
    thinking = render_prompt(messages, thinking=True, reasoning_effort=effort, effort_profile=profile)
    assert thinking == f"{BOS}{prefix}You are a helpful assistant.{U}1+1=?{A}<think>"
    chat = render_prompt(messages, thinking=False, reasoning_effort=effort, effort_profile=profile)
    assert chat == f"{BOS}You are a helpful assistant.{U}1+1=?{A}</think>"  # chat mode ignores it


def test_detect_effort_profile_from_encoder_source():
    first_release = 'REASONING_EFFORT_MAX = (\n    "Reasoning Effort: ..."\n)\n'
    refresh = ('REASONING_EFFORT_PROMPTS: Dict[str, str] = {\n    "low": "",\n    "high": (\n        "x"\n    ),\n'
               '    "max": (\n        "y"\n    ),\n}\nDEFAULT_REASONING_EFFORT = "low"\n')
    assert detect_effort_profile(first_release) == "v4"
    assert detect_effort_profile(refresh) == "v4-0731"
    assert detect_effort_profile("# REASONING_EFFORT_PROMPTS = {\n'low': ''\n}\n") == "v4"  # a comment


# --------------------------------------------------------------------------- tool calls and results
def test_tool_results_join_one_user_turn_in_call_order():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "reasoning_content": "R",
         "tool_calls": [call("alpha", '{"n": "1"}', "call_A"), call("beta", '{"n": "2"}', "call_B")]},
        {"role": "tool", "tool_call_id": "call_B", "content": "B result"},
        {"role": "tool", "tool_call_id": "call_A", "content": "A result"},
    ]
    # No tools given, so thinking mode drops the reasoning of the turn before the results.
    assert render_prompt(messages, thinking=True) == (
        f"{BOS}S{U}Q{A}</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        "<｜DSML｜invoke name=\"alpha\">\n<｜DSML｜parameter name=\"n\" string=\"true\">1</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n"
        "<｜DSML｜invoke name=\"beta\">\n<｜DSML｜parameter name=\"n\" string=\"true\">2</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{EOS}"
        f"{U}<tool_result>A result</tool_result>\n\n<tool_result>B result</tool_result>{A}<think>")


def test_user_text_after_tool_results_joins_their_turn():
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": None, "tool_calls": [call("alpha", {"n": "1"}, "c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "part 1"},
                                                            {"type": "text", "text": "part 2"}]},
        {"role": "user", "content": [{"type": "text", "text": "And now "}, {"type": "text", "text": "this."}]},
    ]
    assert render_prompt(messages, thinking=False) == (
        f"{BOS}{U}Q{A}</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        "<｜DSML｜invoke name=\"alpha\">\n<｜DSML｜parameter name=\"n\" string=\"true\">1</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{EOS}"
        f"{U}<tool_result>part 1\n\npart 2</tool_result>\n\nAnd now this.{A}</think>")


def test_leading_system_messages_join_with_a_blank_line():
    # The official encoder would concatenate them with nothing between; we keep them apart.
    messages = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}, {"role": "user", "content": "Q"}]
    assert render_prompt(messages) == f"{BOS}A\n\nB{U}Q{A}</think>"


def test_a_later_system_message_is_a_block_of_the_user_turn_it_stands_in():
    """Claude Code's mid-conversation system messages: after a user message they join its turn;
    after an assistant turn they open the next user turn; the prompt still ends with the
    generation prompt (the official encoder would leave none after a trailing system message)."""
    assert render_prompt([{"role": "user", "content": "hi"}, {"role": "system", "content": "Be brief."}]) == \
        f"{BOS}{U}hi\n\nBe brief.{A}</think>"
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}, {"role": "system", "content": "Now in French."},
            {"role": "user", "content": "q2"}]
    assert render_prompt(conv) == f"{BOS}S{U}q{A}</think>a{EOS}{U}Now in French.\n\nq2{A}</think>"
    assert render_prompt(conv[:4]) == f"{BOS}S{U}q{A}</think>a{EOS}{U}Now in French.{A}</think>"


def test_consecutive_user_messages_share_a_turn():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_prompt(messages) == f"{BOS}{U}a\n\nb{A}</think>"


def test_content_and_calls_are_separated_by_a_blank_line():
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "I will look.", "tool_calls": [call("echo", '{"text": "hi"}')]}]
    assert render_prompt(messages) == (
        f"{BOS}{U}Q{A}</think>I will look.\n\n"
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"echo\">\n"
        "<｜DSML｜parameter name=\"text\" string=\"true\">hi</｜DSML｜parameter>\n"
        f"</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}")


def test_call_without_arguments():
    assert render_assistant_completion({"role": "assistant", "tool_calls": [call("now", "{}")]}) == (
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"now\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")


# The argument rule: keys in order; strings verbatim with string="true"; every other value as
# Python's json.dumps(value, ensure_ascii=False) with string="false".
ARGUMENT_SHAPES = [
    ('"say \\"hi\\"\\nline 2 ✓ 中文 \\\\ end"', 'true', 'say "hi"\nline 2 ✓ 中文 \\ end'),
    ('""', 'true', ''),
    ('"42"', 'true', '42'),
    ('-3', 'false', '-3'),
    ('2.5', 'false', '2.5'),
    ('12345678901234567890', 'false', '12345678901234567890'),
    ('true', 'false', 'true'),
    ('false', 'false', 'false'),
    ('null', 'false', 'null'),
    ('[]', 'false', '[]'),
    ('[1, "two", {"k": null}]', 'false', '[1, "two", {"k": null}]'),
    ('{"k": [1, {"z": "y\\"q"}], "é": true}', 'false', '{"k": [1, {"z": "y\\"q"}], "é": true}'),
]


@pytest.mark.parametrize("value_json, string_flag, dsml_value", ARGUMENT_SHAPES)
def test_argument_shapes_render_as_dsml(value_json, string_flag, dsml_value):
    expected = (
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
        "<｜DSML｜parameter name=\"first\" string=\"true\">a</｜DSML｜parameter>\n"
        f"<｜DSML｜parameter name=\"v\" string=\"{string_flag}\">{dsml_value}</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    as_string = '{"first": "a", "v": ' + value_json + '}'
    for arguments in (as_string, json.loads(as_string)):  # a JSON string or a dict
        message = {"role": "assistant", "content": "", "tool_calls": [call("f", arguments)]}
        assert render_assistant_completion(message) == expected


def test_assistant_completion_in_thinking_mode():
    message = {"role": "assistant", "content": "Hi", "reasoning": "r"}
    assert render_assistant_completion(message, thinking=True) == "r</think>Hi"
    assert render_assistant_completion(message, thinking=False) == "Hi"


def test_prompt_plus_completion_is_the_next_prompt():
    """What makes a re-sent conversation hit the prefix cache: rendering the conversation with
    the sampled turn appended extends the prompt the turn was sampled from by exactly it."""
    tools = [WEATHER]
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    turn = {"role": "assistant", "content": "", "reasoning_content": "think",
            "tool_calls": [call("get_weather", '{"location": "Paris", "days": 3}', "c1")]}
    for thinking in (True, False):
        prompt = render_prompt(conversation, tools=tools, thinking=thinking)
        sampled = render_assistant_completion(turn, thinking=thinking) + EOS
        after = render_prompt(conversation + [turn, {"role": "tool", "tool_call_id": "c1", "content": "rain"}],
                              tools=tools, thinking=thinking)
        assert after.startswith(prompt + sampled)
        assert after == prompt + sampled + f"{U}<tool_result>rain</tool_result>{A}" + (
            "<think>" if thinking else "</think>")


# --------------------------------------------------------------------------- invalid input
@pytest.mark.parametrize("messages, message", [
    ([], "messages must not be empty"),
    ("hi", "messages must be a list"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role must be one of"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"messages\[0\]\.content\[0\] must be a text part"),
    ([{"role": "assistant", "content": "a"}], r"messages\[0\]: an assistant message must follow a user or tool message"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
     r"messages\[2\]: an assistant message must follow"),
    ([{"role": "user", "content": "q", "tool_calls": []}], r"messages\[0\]\.tool_calls: only assistant messages"),
    ([{"role": "user", "content": "q"}, {"role": "user", "content": "q"},
      {"role": "assistant", "tool_calls": [call("f", '{"a": 1,}')]}],
     r"messages\[2\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call("f", "[1]")]}],
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON object, got list"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call("", "{}")]}],
     r"messages\[1\]\.tool_calls\[0\]\.function\.name must be a non-empty string"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": {"function": {}}}],
     r"messages\[1\]\.tool_calls must be a list"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "reasoning": "a", "reasoning_content": "b"}],
     r"messages\[1\]: reasoning_content and reasoning differ"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "reasoning_content": 5}],
     r"messages\[1\]\.reasoning_content must be a string"),
    ([{"role": "tool", "content": "r", "tool_call_id": 7}], r"messages\[0\]\.tool_call_id must be a string"),
])
def test_invalid_messages_name_the_field(messages, message):
    with pytest.raises(ValueError, match=message):
        render_prompt(messages)


@pytest.mark.parametrize("kwargs, message", [
    ({"tools": {"type": "function"}}, "tools must be a list"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, r"tools\[0\]\.function\.name"),
    ({"tools": [{"type": "retrieval"}]}, r"tools\[0\]\.type must be \"function\""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, r"tools\[0\]\.function\.parameters"),
    ({"reasoning_effort": "medium"}, "reasoning_effort must be one of low, high, max"),
    ({"effort_profile": "v5"}, "effort profile must be one of"),
    ({"response_format": "json"}, "response_format must be an object"),
])
def test_invalid_options_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        render_prompt([{"role": "user", "content": "q"}], **kwargs)


# --------------------------------------------------------------------------- parts (for exact replay)
def test_prompt_parts_join_to_the_prompt_and_set_each_assistant_body_apart():
    from ds4_torch.chat_encoding import render_prompt_parts

    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "Call it.",
             "tool_calls": [call("get_weather", {"location": "Oslo"}, "c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": "cold"},
            {"role": "assistant", "content": "It is cold.", "reasoning_content": "Answer."},
            {"role": "user", "content": "Thanks"}]
    for thinking, tools in ((False, None), (True, [WEATHER]), (True, None)):
        parts = render_prompt_parts(conv, tools=tools, thinking=thinking)
        assert "".join(p.text for p in parts) == render_prompt(conv, tools=tools, thinking=thinking)
        bodies = [p for p in parts if p.message is not None]
        assert [p.message.content for p in bodies] == ["", "It is cold."]
        for p, m in zip(bodies, (conv[2], conv[4])):
            # A kept body is exactly what the model generated for that message.
            if p.with_reasoning:
                assert p.text == render_assistant_completion(m, thinking=True)
        # Reasoning is kept with tools, dropped before the last user turn without them.
        assert [p.with_reasoning for p in bodies] == [thinking and tools is not None] * 2
        # Every body is followed by EOS (it starts the next part).
        assert all(parts[parts.index(p) + 1].text.startswith(EOS) for p in bodies)
