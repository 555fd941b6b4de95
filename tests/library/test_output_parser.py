"""DeepSeek-V4 output parsing: whole and streamed in pieces split anywhere, malformed output,
schema checks, and the round trip parse -> render that makes re-sent turns hit the cache.

The samples and their expected parses are written by hand from the format's rules.
"""
import json
import random

import pytest

from ds4_torch.chat_encoding import render_assistant_completion, render_prompt
from ds4_torch.json_schema import validate_json_schema
from ds4_torch.output_parser import (
    ContentDelta, MarkupDropped, MarkupFilter, ParseWarning, ReasoningDelta, StreamingOutputParser, ToolCall,
    parse_output,
)

EOS = "<｜end▁of▁sentence｜>"
OPEN, CLOSE = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"


def invoke(name, *params):
    """A canonical invoke: params are (name, string flag, raw value)."""
    lines = [f'<｜DSML｜invoke name="{name}">']
    lines += [f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>' for k, s, v in params]
    return "\n".join(lines + ["</｜DSML｜invoke>"])


def block(*invokes):
    return "\n\n" + OPEN + "\n" + "\n".join(invokes) + "\n" + CLOSE


WEATHER_CALL = invoke("get_weather", ("location", "true", "Beijing"), ("unit", "true", "celsius"))
MIXED_CALL = invoke("mixed", ("text", "true", 'say "hi"\n  <b>line 2</b> ✓ 中文'), ("n", "false", "-3"),
                    ("x", "false", "2.5"), ("ok", "false", "true"), ("none", "false", "null"),
                    ("obj", "false", '{"k": [1, {"z": "y"}], "e": []}'))

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["location"], "additionalProperties": False, "properties": {
            "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "mixed", "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
        "none": {"type": "null"}, "obj": {"type": "object", "properties": {"k": {"type": "array"}}}}}}},
]

# (name, thinking, generated text, reasoning, content, [(tool, arguments)], replays exactly, warning snippets)
SAMPLES = [
    ("plain answer", True, "Simple.</think>The answer is 4." + EOS, "Simple.", "The answer is 4.", [], True, []),
    ("chat mode", False, "a < b, <not markup> and <｜ neither.\n\nNext paragraph.\n" + EOS, "",
     "a < b, <not markup> and <｜ neither.\n\nNext paragraph.\n", [], True, []),
    ("tool call", True, "The user wants weather.</think>" + block(WEATHER_CALL) + EOS, "The user wants weather.", "",
     [("get_weather", {"location": "Beijing", "unit": "celsius"})], True, []),
    ("content and two calls", True, "r</think>Let me look.\n" + block(MIXED_CALL, WEATHER_CALL) + EOS, "r",
     "Let me look.\n",
     [("mixed", {"text": 'say "hi"\n  <b>line 2</b> ✓ 中文', "n": -3, "x": 2.5, "ok": True, "none": None,
                 "obj": {"k": [1, {"z": "y"}], "e": []}}),
      ("get_weather", {"location": "Beijing", "unit": "celsius"})], True, []),
    ("chat mode call", False, block(WEATHER_CALL) + EOS, "", "",
     [("get_weather", {"location": "Beijing", "unit": "celsius"})], True, []),
    ("no </think> before the call", True, "I need the weather." + block(WEATHER_CALL) + EOS, "I need the weather.", "",
     [("get_weather", {"location": "Beijing", "unit": "celsius"})], False, ["inside reasoning"]),
    # A block that does not parse never reaches the text (dropped up to its close or the end).
    ("malformed block", True, "r</think>x" + block(invoke("f", ("a", "maybe", "1"))) + EOS, "r", "x", [], False,
     ["malformed"]),
    ("cut inside a call", True, "r</think>" + "\n\n" + OPEN + '\n<｜DSML｜invoke name="f">\n<｜DSML｜param', "r",
     "", [], False, ["unterminated"]),
    ("eos inside a call", True, "r</think>" + "\n\n" + OPEN + '\n<｜DSML｜invoke name="f">' + EOS + "tail", "r",
     "", [], False, ["unterminated", "after"]),
    # An opener in the middle of a line is prose naming it: only the opener is dropped.
    ("opener mentioned in reasoning", True, f"Use {OPEN} later.</think>Done." + EOS, "Use  later.", "Done.",
     [], False, ["outside a block"]),
    ("markup out of place", False, f"a</think>b<think>c<tool_result>d</｜DSML｜parameter>e<｜User｜>f" + EOS, "",
     "abcdef", [], False, []),
    ("leading <think> in chat mode", False, "<think>hm</think>ok" + EOS, "hm", "ok", [], False, []),
    ("truncated reasoning", True, "still thinking <｜", "still thinking <｜", "", [], False, []),
    ("self-closing and JSON-body invokes", True,
     "r</think>\n\n" + OPEN + '\n<｜DSML｜invoke name="now"/>\n<｜DSML｜invoke name="g">\n{"a": [1, 2], "b": "c"}\n'
     "</｜DSML｜invoke>\n" + CLOSE + EOS, "r", "", [("now", {}), ("g", {"a": [1, 2], "b": "c"})], False, []),
]
IDS = [s[0] for s in SAMPLES]


def merged(events):
    """Events with neighbouring deltas of one channel joined (streaming splits them anywhere);
    dropped markup last, in order (it may be reported before or after text held back with it)."""
    out = []
    for e in events:
        if isinstance(e, MarkupDropped):
            continue
        if out and type(e) is type(out[-1]) and isinstance(e, (ReasoningDelta, ContentDelta)):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out + [e for e in events if isinstance(e, MarkupDropped)]


def stream(text, pieces_at, thinking, tools=None):
    parser = StreamingOutputParser(thinking=thinking, tools=tools)
    events, start = [], 0
    for cut in list(pieces_at) + [len(text)]:
        events += parser.feed(text[start:cut])
        start = cut
    events += parser.finish()
    return events, parser.result


@pytest.mark.parametrize("name, thinking, text, reasoning, content, calls, replays, warnings", SAMPLES, ids=IDS)
def test_parse_whole_output(name, thinking, text, reasoning, content, calls, replays, warnings):
    r = parse_output(text, thinking=thinking)
    assert r.reasoning == reasoning
    assert r.content == content
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == calls
    assert [c.index for c in r.tool_calls] == list(range(len(calls)))
    assert r.replays_exactly is replays
    assert r.ended is (EOS in text)
    assert len(r.warnings) == len(warnings) and all(w in got for w, got in zip(warnings, r.warnings))


@pytest.mark.parametrize("name, thinking, text, reasoning, content, calls, replays, warnings", SAMPLES, ids=IDS)
def test_streaming_equals_whole_at_every_split(name, thinking, text, reasoning, content, calls, replays, warnings):
    whole_events, whole = stream(text, [], thinking)
    assert whole == parse_output(text, thinking=thinking)
    cases = [[k] for k in range(len(text) + 1)]  # every single split point
    cases.append(range(1, len(text)))  # one character at a time
    rng = random.Random(sum(map(ord, name)))
    cases += [sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1)))) for _ in range(40)]
    for cuts in cases:
        events, result = stream(text, cuts, thinking)
        assert merged(events) == merged(whole_events), cuts
        assert result == whole, cuts


@pytest.mark.parametrize("name, thinking, text, reasoning, content, calls, replays, warnings",
                         [s for s in SAMPLES if not s[7]], ids=[s[0] for s in SAMPLES if not s[7]])
def test_no_markup_fragment_in_any_delta(name, thinking, text, reasoning, content, calls, replays, warnings):
    for cuts in ([k] for k in range(len(text) + 1)):
        events, _ = stream(text, cuts, thinking)
        for e in events:
            if isinstance(e, (ReasoningDelta, ContentDelta)):
                # Deltas are pieces of the parsed channels, so no marker text can sit in them.
                assert e.text in (reasoning if isinstance(e, ReasoningDelta) else content), (cuts, e)
                assert "｜DSML｜" not in e.text and "</think>" not in e.text and "<｜end" not in e.text


def test_events_in_order():
    text = "ab</think>cd" + block(WEATHER_CALL) + EOS
    events, _ = stream(text, [1, 5, 11, 13], thinking=True)
    assert merged(events) == [
        ReasoningDelta("ab"), ContentDelta("cd"),
        ToolCall(0, "get_weather", '{"location": "Beijing", "unit": "celsius"}', WEATHER_CALL, ()),
    ]


def test_content_is_not_held_back_longer_than_needed():
    parser = StreamingOutputParser(thinking=False)
    assert parser.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert parser.feed("ld\n") == [ContentDelta("ld")]  # "\n" may begin "\n\n<｜DSML｜tool_calls>"
    assert parser.feed("\nok <") == [ContentDelta("\n\nok ")]
    assert parser.feed("b>") == [ContentDelta("<b>")]
    assert parser.feed("<｜end▁of") == []
    assert parser.feed("▁sentence｜>") == []
    assert parser.finish() == [] and parser.result.ended and parser.result.content == "Hello world\n\nok <b>"


def test_tool_calls_come_out_when_their_block_closes():
    text = "</think>" + block(MIXED_CALL, WEATHER_CALL) + "after"
    closed_at = text.index(CLOSE) + len(CLOSE)
    for piece in (1, 3, 7):
        parser = StreamingOutputParser(thinking=True)
        for start in range(0, len(text), piece):
            calls = [e for e in parser.feed(text[start:start + piece]) if isinstance(e, ToolCall)]
            closes_here = start < closed_at <= start + piece
            assert len(calls) == (2 if closes_here else 0), (piece, start)


def test_raw_span_is_the_sampled_invoke():
    sloppy = '<｜DSML｜invoke  name="get_weather" >\n  <｜DSML｜parameter name="location"  string="true" >Oslo</｜DSML｜parameter>\n</｜DSML｜invoke>'
    r = parse_output("</think>" + "\n\n" + OPEN + sloppy + "\n" + CLOSE, thinking=True)
    (c,) = r.tool_calls
    assert c.raw == sloppy and json.loads(c.arguments) == {"location": "Oslo"}
    assert not r.replays_exactly  # the layout is not the canonical one


# --------------------------------------------------------------------------- round trip
ROUND_TRIP_ARGUMENTS = [
    ("text", "true", 'quotes " \' and \\ backslash'),
    ("lines", "true", "line 1\nline 2\n\n  indented\ttab"),
    ("unicode", "true", "héllo 中文 🙂 \u2028"),
    ("empty", "true", ""),
    ("looks_like_json", "true", '{"a": 1}'),
    ("int", "false", "42"),
    ("neg", "false", "-7"),
    ("float", "false", "3.25"),
    ("big", "false", "123456789012345678901234567890"),
    ("t", "false", "true"),
    ("f", "false", "false"),
    ("nothing", "false", "null"),
    ("list", "false", '[1, "two", null, [], {}]'),
    ("nested", "false", '{"a": {"b": [{"c": "d\\"e\\n"}]}, "ü": false}'),
]


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no tools"])  # no tools: earlier reasoning drops
@pytest.mark.parametrize("thinking", [True, False])
def test_render_of_parse_is_the_sampled_text(thinking, tools):
    """Generated turns re-render byte for byte: in the conversation, prompt + sample is what the
    next request's prompt starts with."""
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    head = "Reasoning here.</think>" if thinking else ""
    samples = [
        head + "Just text." + EOS,
        head + block(invoke("f", *ROUND_TRIP_ARGUMENTS)) + EOS,
        head + "Calling two.\n" + block(WEATHER_CALL, invoke("f", ("x", "false", "[]"))) + EOS,
        head + "\n\n" + OPEN + '\n<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n' + CLOSE + EOS,  # no arguments
    ]
    prompt = render_prompt(conversation, tools=tools, thinking=thinking)
    for sample in samples:
        r = parse_output(sample, thinking=thinking)
        assert r.replays_exactly, sample
        assert render_assistant_completion(r.to_message(), thinking=thinking) + EOS == sample
        after = render_prompt(conversation + [r.to_message()], tools=tools, thinking=thinking)
        assert after == prompt + sample


@pytest.mark.parametrize("sampled_value, parsed", [
    ('{"a":1}', {"a": 1}),  # not json.dumps spacing
    ("1.50", 1.5),
    ('"a string"', "a string"),  # a JSON string under string="false"
])
def test_non_canonical_values_parse_but_do_not_replay(sampled_value, parsed):
    r = parse_output("</think>" + block(invoke("f", ("v", "false", sampled_value))) + EOS, thinking=True)
    assert json.loads(r.tool_calls[0].arguments) == {"v": parsed}
    assert not r.replays_exactly


def test_string_false_value_that_is_not_json_is_kept_as_a_string():
    r = parse_output(block(invoke("f", ("v", "false", "hello"), ("w", "false", "NaN"))) + EOS, thinking=False)
    (c,) = r.tool_calls
    assert json.loads(c.arguments) == {"v": "hello", "w": "NaN"}
    assert len(c.problems) == 2 and all('string="false" but is not JSON' in p for p in c.problems)


def _strict_json(text):
    def reject(constant):
        raise AssertionError(f"{constant} in the arguments")
    return json.loads(text, parse_constant=reject)


def test_a_number_beyond_float_range_is_kept_as_its_text():
    """1e400 would parse as inf, which JSON cannot carry: the value stays the text sampled, with a
    problem noted; in range numbers beside it parse. A JSON body with one is malformed."""
    r = parse_output(block(invoke("f", ("v", "false", "1e400"), ("w", "false", "-2.5e400"), ("x", "false", "1e300")))
                     + EOS, thinking=False)
    (c,) = r.tool_calls
    assert _strict_json(c.arguments) == {"v": "1e400", "w": "-2.5e400", "x": 1e300}
    assert len(c.problems) == 2 and all('string="false" but is not JSON' in p for p in c.problems)
    r = parse_output(block('<｜DSML｜invoke name="f">\n{"a": [1e999]}\n</｜DSML｜invoke>') + EOS, thinking=False)
    assert r.tool_calls == [] and "out of range" in " ".join(r.warnings)


@pytest.mark.parametrize("body, reason", [
    (invoke("f", ("a", "true", "1"), ("a", "true", "2")), "given twice"),
    ('<｜DSML｜invoke name="">\n</｜DSML｜invoke>', "empty tool name"),
    ('<｜DSML｜invoke name="f">\n{"a": 1\n</｜DSML｜invoke>', "not a JSON object"),
    ('<｜DSML｜invoke name="f">\n[1]\n</｜DSML｜invoke>', "expected"),
    ("", "without an invoke"),
    ('<｜DSML｜invoke name="' + "x" * 300 + '">', "longer than"),
])
def test_malformed_blocks_are_dropped_whole(body, reason):
    text = "Before" + "\n\n" + OPEN + "\n" + body + "\n" + CLOSE + "After" + EOS
    events, r = stream(text, range(1, len(text), 7), thinking=False)
    assert r.tool_calls == [] and r.content == "BeforeAfter"
    assert len(r.warnings) == 1 and reason in r.warnings[0]
    assert [e.text for e in events if isinstance(e, MarkupDropped)] == [text[6:-len("After" + EOS)]]


# --------------------------------------------------------------------------- schema validation
def test_tool_calls_are_checked_against_their_schema():
    calls = block(
        invoke("get_weather", ("unit", "true", "kelvin"), ("extra", "false", "1")),
        invoke("mixed", ("n", "false", "1.5"), ("ok", "true", "yes"), ("obj", "false", '{"k": "no"}')),
        invoke("delete_everything"),
    )
    r = parse_output(calls + EOS, thinking=False, tools=TOOLS)
    assert [c.problems for c in r.tool_calls] == [
        ("arguments: missing required property 'location'",
         "arguments.unit: 'kelvin' is not one of ['celsius', 'fahrenheit']",
         "arguments: unexpected property 'extra'"),
        ("arguments.n: expected integer, got number",
         "arguments.ok: expected boolean, got string",
         "arguments.obj.k: expected array, got string"),
        ("unknown tool 'delete_everything'",),
    ]
    ok = parse_output(block(WEATHER_CALL, MIXED_CALL) + EOS, thinking=False, tools=TOOLS)
    assert [c.problems for c in ok.tool_calls] == [(), ()]
    assert parse_output(block(invoke("anything")), thinking=False).tool_calls[0].problems == ()  # no tools: no check


@pytest.mark.parametrize("value, schema, errors", [
    (3, {"type": "integer"}, []),
    (3.0, {"type": "integer"}, []),
    (True, {"type": "integer"}, ["$: expected integer, got boolean"]),
    (True, {"type": "number"}, ["$: expected number, got boolean"]),
    (None, {"type": ["string", "null"]}, []),
    (1, {"type": ["string", "null"]}, ["$: expected string or null, got integer"]),
    (1, {"enum": [True, "1"]}, ["$: 1 is not one of [True, '1']"]),
    ("a", {"const": "a"}, []),
    ({"a": [1, "x"]}, {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}},
     ["$.a[1]: expected integer, got string"]),
    ({"a": {"b": {}}}, {"properties": {"a": {"properties": {"b": {"required": ["c"]}}}}},
     ["$.a.b: missing required property 'c'"]),
    ({"x": 1}, {"additionalProperties": {"type": "string"}}, ["$.x: expected string, got integer"]),
    ("s", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, []),
    ([], {"anyOf": [{"type": "integer"}, {"type": "string"}]}, ["$: matches none of the anyOf alternatives"]),
    (1, {"oneOf": [{"type": "integer"}, {"type": "number"}]}, ["$: matches 2 of the oneOf alternatives, not exactly one"]),
    (1, {"allOf": [{"type": "integer"}, {"enum": [2]}]}, ["$: 1 is not one of [2]"]),
    ("anything", {"format": "uri", "$ref": "#/x"}, []),  # keywords outside the subset are not checked
    (1, False, ["$: no value is allowed here"]),
])
def test_validate_json_schema(value, schema, errors):
    assert validate_json_schema(value, schema) == errors
