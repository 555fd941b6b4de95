"""Tool-call blocks constrained to the offered tools (`serve.http.chat.offered_calls_grammar`): with
tools offered and tool_choice auto, once the model opens a `<｜DSML｜tool_calls>` block the calls
in it may only name offered tools, with the parameter names a tool declares when its schema
allows no others; the text before the block stays free. The independent expectations: the
encoding's own rendering of calls (accepted or rejected by the grammar), the same server with
`--free-tool-calls` (the tiny model, left alone, calls the weather tool it was trained on, which
the server must drop), and the same server without speculation (speculating, the grammar starts
inside a step's tokens and the rest must be given back)."""
from __future__ import annotations

import concurrent.futures
import json
from types import SimpleNamespace

import anthropic
import openai
import pytest

from ds4_torch.chat_encoding import TOOL_CALLS_OPEN, render_assistant_completion
from ds4_torch.structured import StructuredOutputs
from serve.http.chat import ChatRequest, ToolChoice, offered_calls_grammar
from serve.cli import build_parser

from helpers import metric, server, wait_for

MODEL = "ds4-default"
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def tool(name, properties, closed=True, required=()):
    """`properties`: names (typed string) or {name: type}."""
    types = properties if isinstance(properties, dict) else dict.fromkeys(properties, "string")
    params = {"type": "object", "properties": {p: {"type": t} for p, t in types.items()}, "required": list(required)}
    if closed:
        params["additionalProperties"] = False
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool.", "parameters": params}}


# Claude Code names its tools this way and closes their schemas (additionalProperties false).
BASH = tool("Bash", {"command": "string", "timeout": "number", "description": "string"}, required=["command"])
READ = tool("Read", ["file_path"])
PLACEHOLDER = tool("DeferredToolPlaceholder", [])
OPEN_TOOL = tool("lookup", ["query"], closed=False)


# --------------------------------------------------------------------------- the grammar itself
@pytest.fixture(scope="module")
def state(model, tok):
    so = StructuredOutputs(tok, model.config.vocab_size)
    return SimpleNamespace(engine=SimpleNamespace(structured_outputs=lambda: so), tokenizer=tok,
                           config=SimpleNamespace(tool_call_grammar=True))


def block_matcher(state, tok, tools):
    """'rejected' / 'open' / 'stopped' for the text of a reply, fed to the grammar after its trigger."""
    triggered = offered_calls_grammar(state, ChatRequest(messages=[], tools=tools))
    assert triggered is not None
    hf = getattr(tok, "hf", tok)
    assert hf.encode(TOOL_CALLS_OPEN, add_special_tokens=False) == [triggered.trigger]

    def run(reply: str) -> str:
        ids = hf.encode(reply, add_special_tokens=False)
        at = ids.index(triggered.trigger)  # everything before the block is free
        m = triggered.grammar.constraint().matcher
        for t in ids[at + 1:]:
            if not m.consume_token(t):
                return "rejected"
        return "stopped" if m.is_stopped() else "open"
    return run


def rendered(*calls, content=""):
    return render_assistant_completion({"role": "assistant", "content": content, "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls]})


def test_block_grammar_takes_offered_calls_as_the_encoding_renders_them(state, tok):
    run = block_matcher(state, tok, [BASH, READ, PLACEHOLDER, OPEN_TOOL])
    assert run(rendered(("Bash", {"command": "ls"}))) == "stopped"
    assert run(rendered(("Bash", {"command": "ls", "description": "list"}), ("Read", {"file_path": "a.py"}),
                        content="Let me look. <b>free</b> text")) == "stopped"
    assert run(rendered(("DeferredToolPlaceholder", {}))) == "stopped"
    assert run(rendered(("lookup", {"query": "x", "anything": [1, 2]}))) == "stopped"  # its schema allows others
    assert run(rendered(("Bash", {"command": "ls"})).split("</｜DSML｜invoke>")[0]) == "open"  # a call's prefix


def test_block_grammar_rejects_tools_not_offered_and_undeclared_parameters(state, tok):
    run = block_matcher(state, tok, [BASH, READ, PLACEHOLDER, OPEN_TOOL])
    assert run(rendered(("get_weather", {"city": "Paris"}))) == "rejected"
    assert run(rendered(("bash", {"command": "ls"}))) == "rejected"
    assert run(rendered(("Bash", {"city": "Paris"}))) == "rejected"  # additionalProperties false
    assert run(rendered(("DeferredToolPlaceholder", {"city": "Paris"}))) == "rejected"
    assert run(rendered(("Bash", {"command": "ls"})) + "more") == "rejected"  # the block ended
    # A closed schema's properties in its order, the required ones always.
    assert run(rendered(("Bash", {"description": "list"}))) == "rejected"  # command is required
    assert run(rendered(("Bash", {"description": "list", "command": "ls"}))) == "rejected"  # not its order
    assert run(rendered(("Read", {}))) == "stopped"  # nothing required
    # Values of a declared type: text for a string, JSON of the type for the others.
    assert run(rendered(("Bash", {"command": "ls", "timeout": 5}))) == "stopped"
    assert run(rendered(("Bash", {"command": 3}))) == "rejected"
    assert run(rendered(("Bash", {"command": "ls", "timeout": "soon"}))) == "rejected"
    assert run(rendered(("Bash", {"command": "ls", "timeout": [5]}))) == "rejected"


def test_block_grammar_keeps_a_closed_schemas_string_enums(state, tok):
    """A property whose values are a string enum (Claude Code's ReportFindings `level`, Codex's
    sandbox modes) takes one of them, in a non-strict tool's closed schema as in a strict one's."""
    report = tool("ReportFindings", {"summary": "string"}, required=["summary", "level"])
    report["function"]["parameters"]["properties"]["level"] = {
        "type": "string", "enum": ["info", "warning", "error"], "description": "How serious."}
    report["function"]["parameters"]["properties"]["mode"] = {"enum": ["fast", ""]}  # no type: still text
    run = block_matcher(state, tok, [report, BASH])
    assert run(rendered(("ReportFindings", {"summary": "ok", "level": "warning"}))) == "stopped"
    assert run(rendered(("ReportFindings", {"summary": "ok", "level": "error", "mode": ""}))) == "stopped"
    assert run(rendered(("ReportFindings", {"summary": "ok", "level": "severe"}))) == "rejected"
    assert run(rendered(("ReportFindings", {"summary": "ok", "level": "warn"}))) == "rejected"  # a prefix
    assert run(rendered(("ReportFindings", {"summary": "ok", "level": "info", "mode": "slow"}))) == "rejected"


def test_odd_schemas_still_give_a_grammar(state, tok):
    """Whatever a client's schema holds (a list of types, a property that is not an object, no
    properties at all), the grammar is built, or calls stay free: never an error."""
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "additionalProperties": False, "required": "x",
        "properties": {"u": {"type": ["string", "null"]}, "v": True, "w": {"enum": [1, 2]}}}}}
    bare = {"type": "function", "function": {"name": "bare"}}
    run = block_matcher(state, tok, [odd, bare])
    assert run(rendered(("odd", {"u": "x", "v": [1], "w": 2}))) == "stopped"
    assert run(rendered(("odd", {"u": None}))) == "stopped"
    assert run(rendered(("bare", {"anything": "goes"}))) == "stopped"
    assert run(rendered(("odd", {"z": 1}))) == "rejected"


def test_no_block_grammar_when_off_or_when_another_rule_holds(state):
    tools = [BASH]
    assert offered_calls_grammar(state, ChatRequest(messages=[], tools=tools)) is not None
    assert offered_calls_grammar(state, ChatRequest(messages=[], tools=[])) is None
    for choice in (ToolChoice("none"), ToolChoice("required"), ToolChoice("function", "Bash")):
        assert offered_calls_grammar(state, ChatRequest(messages=[], tools=tools, tool_choice=choice)) is None
    assert offered_calls_grammar(state, ChatRequest(messages=[], tools=tools, grammar=object())) is None
    off = SimpleNamespace(**{**vars(state), "config": SimpleNamespace(tool_call_grammar=False)})
    assert offered_calls_grammar(off, ChatRequest(messages=[], tools=tools)) is None


def test_no_block_grammar_for_tool_lists_too_big_to_compile_quickly(state, caplog):
    """A hostile request (thousands of tools or parameters) must not stall the others: compiling
    and the first mask grow with the grammar, so past the caps calls stay free (checked after)."""
    from serve.http import chat

    many = [tool(f"t{i}", ["a"]) for i in range(chat.MAX_CONSTRAINED_TOOLS + 1)]
    assert offered_calls_grammar(state, ChatRequest(messages=[], tools=many[:-1])) is not None
    assert offered_calls_grammar(state, ChatRequest(messages=[], tools=many)) is None
    wide = tool("wide", [f"p{i}" for i in range(5000)])
    assert offered_calls_grammar(state, ChatRequest(messages=[], tools=[wide])) is None
    assert all(len(r.getMessage()) < 500 for r in caplog.records)


def test_cli_flag_turns_it_off():
    assert build_parser().parse_args(["--free-tool-calls"]).free_tool_calls
    assert not build_parser().parse_args([]).free_tool_calls


# --------------------------------------------------------------------------- through the server
def calls_server(model, **config):
    return server(model, **{"ctx": 1024, "prefill_chunk": 64, "max_batch": 4, **config})


def weather_calls(srv, tools, n=8, **extra):
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = oai.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=tools, temperature=1.0, seed=3, n=n,
                                    max_tokens=80, **extra)
    return r.choices


def test_the_model_left_free_calls_a_tool_not_offered_and_constrained_calls_an_offered_one(model):
    with calls_server(model, tool_call_grammar=False) as srv:
        free = weather_calls(srv, [BASH, READ])
        dropped = metric(srv, "ds4_markup_dropped_total", kind="call")
    # The independent expectation: left alone, the tiny model calls its drilled weather tool,
    # which the server drops (nothing of it reaches the text).
    assert dropped >= 1 and not any(c.message.tool_calls for c in free)
    with calls_server(model) as srv:
        constrained = weather_calls(srv, [BASH, READ])
        assert metric(srv, "ds4_markup_dropped_total", kind="call") == 0
    calls = [t for c in constrained for t in c.message.tool_calls or []]
    assert len(calls) >= dropped  # every block it opened became a call
    for c in constrained:
        assert "｜DSML｜" not in (c.message.content or "")
        for t in c.message.tool_calls or []:
            args = json.loads(t.function.arguments)
            assert t.function.name in ("Bash", "Read") and set(args) <= {"Bash": {"command", "timeout", "description"},
                                                                          "Read": {"file_path"}}[t.function.name]
            assert c.finish_reason == "tool_calls"


@pytest.mark.parametrize("thinking", [False, True])
def test_anthropic_tool_use_names_an_offered_tool(model, thinking):
    """Claude Code's shape: Anthropic Messages, closed schemas, thinking on or off; greedy (the
    tiny model, left free, calls its weather tool, which is not offered)."""
    tools = [{"name": t["function"]["name"], "description": "d", "input_schema": t["function"]["parameters"]}
             for t in (BASH, READ, PLACEHOLDER)]
    with calls_server(model) as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
        m = client.messages.create(model=MODEL, max_tokens=120, messages=WEATHER_Q, tools=tools,
                                   extra_body={"temperature": 0},
                                   thinking={"type": "enabled", "budget_tokens": 64} if thinking
                                   else {"type": "disabled"})
        assert metric(srv, "ds4_markup_dropped_total", kind="call") == 0
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and m.stop_reason == "tool_use", m.content
    declared = {"Bash": {"command", "timeout", "description"}, "Read": {"file_path"}, "DeferredToolPlaceholder": set()}
    assert uses[0].name in declared and set(uses[0].input) <= declared[uses[0].name]
    assert not any("｜DSML｜" in b.text for b in m.content if b.type == "text")


def constrained_calls(model, **config):
    """Three greedy weather questions in one batch, each offered other tools: (finish reason,
    content, calls) of each."""
    with calls_server(model, **config) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(tools):
            r = oai.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=tools, temperature=0,
                                            max_tokens=80)
            c = r.choices[0]
            return c.finish_reason, c.message.content, [(t.function.name, t.function.arguments)
                                                        for t in c.message.tool_calls or []]
        with concurrent.futures.ThreadPoolExecutor(3) as ex:  # one batch
            return list(ex.map(ask, [[BASH, READ], [READ], [PLACEHOLDER, BASH]]))


@pytest.fixture(scope="module")
def plain_constrained_calls(model):
    """`constrained_calls` without speculation: once for the module (every `n` compares with it)."""
    return constrained_calls(model)


@pytest.mark.parametrize("n", [1, 3])
def test_speculating_gives_the_same_constrained_calls(model, plain_constrained_calls, n):
    """The grammar starts at the block's opening token, inside a speculative step: the step's
    later tokens (not masked by it) go back, and the request goes on one masked token a step."""
    plain = plain_constrained_calls
    assert all(calls for _, _, calls in plain)  # the block opened in each: the grammar took part
    assert constrained_calls(model, speculative_tokens=n, speculative_policy="always") == plain


def test_speculating_a_grammar_that_starts_inside_a_step_gives_back_the_rest(model, tok, monkeypatch):
    """Engine level, where the trigger can be a token the MTP layer drafts well (a tool-call
    opener rarely is): the trigger is taken inside a speculative step, so the step's later tokens,
    which the grammar did not mask, must go back (`trim`) and the row's drafts start over. The
    tokens must equal plain decoding's under the same grammar, which differ from free decoding's.
    A checkpoint is due after every step (interval 1): the one of the step that took the trigger
    is taken once the rest went back, so each checkpoint's state is at its registered position."""
    from ds4_torch.structured import Triggered
    from serve.engine.loop import Engine, GenRequest

    prompts = ["ROMEO:\nWhat light through yonder window breaks? It is the east, and",
               "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n",
               "KING HENRY:\nOnce more unto the breach, dear friends, once more;", "To be, or not to be, that is"]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]

    def run(n, triggers=None):
        eng = Engine(model, tok, ctx=256, prefill_chunk=32, max_batch=4, speculative_tokens=n,
                     speculative_policy="always", checkpoint_interval=1, max_sessions=4)
        trims = []
        real_trim = eng.runner.trim
        monkeypatch.setattr(eng.runner, "trim", lambda used: (trims.append(list(used)), real_trim(used))[1])
        eng.start()
        try:
            so = eng.structured_outputs()
            grammar = so.lark(r'start: /[a-z \n]*/')  # after the trigger: lower case, spaces, newlines
            reqs = [GenRequest(i, 24, after_trigger=None if triggers is None else Triggered(t, grammar))
                    for i, t in zip(ids, triggers or ids)]
            eng.submit_all(reqs)
            wait_for(lambda: all(r.finished() for r in reqs), 120, "every request to finish")
            wait_for(eng.idle, 30, "the engine to be idle")
            checkpoints = [(ck.position, int(eng.replica.checkpoints[ck.id]["position"]))
                           for s in eng.sessions for ck in s.checkpoints.values()]
            assert len(checkpoints) > 4 and all(at == held for at, held in checkpoints), checkpoints
            return [list(r.generated) for r in reqs], trims
        finally:
            eng.stop()

    free, _ = run(0)
    triggers = [g[3] for g in free]  # each request's grammar starts at its fourth token
    plain, _ = run(0, triggers)
    assert plain != free and [p[:4] for p in plain] == [f[:4] for f in free]
    spec, trims = run(3, triggers)
    assert spec == plain
    assert any(u is not None for used in trims for u in used)  # a step's tokens went back


# --------------------------------------------------------------------------- parallel_tool_calls false
def test_parallel_tool_calls_false_allows_one_call_in_the_grammars(state, tok):
    from serve.http.chat import strict_tool_grammar

    two = rendered(("Bash", {"command": "ls"}), ("Read", {"file_path": "a.py"}))
    one = rendered(("Bash", {"command": "ls"}))
    assert block_matcher(state, tok, [BASH, READ])(two) == "stopped"  # parallel calls by default
    hf = getattr(tok, "hf", tok)
    triggered = offered_calls_grammar(state, ChatRequest(messages=[], tools=[BASH, READ], parallel_tool_calls=False))
    strict = strict_tool_grammar(state, ChatRequest(messages=[], parallel_tool_calls=False, tools=[
        {"type": "function", "function": {**BASH["function"], "strict": True}}, READ]))
    for reply, ok in ((one, True), (two, False)):
        ids = hf.encode(reply, add_special_tokens=False)
        m = triggered.grammar.constraint().matcher
        assert all(m.consume_token(t) for t in ids[ids.index(triggered.trigger) + 1:]) == ok
        m = strict.constraint().matcher
        assert all(m.consume_token(t) for t in ids) == ok


def test_parallel_tool_calls_false_keeps_only_the_first_call_without_a_grammar(model, tok):
    """Past the grammar's caps (or with --free-tool-calls) a second call is parsed, then dropped
    and counted: the client asked for one at most."""
    from ds4_torch.output_parser import ToolCall
    from ds4_torch.sampling import SamplingParams
    from serve.http.chat import Call, Generation
    from serve.metrics import Metrics

    state = SimpleNamespace(tokenizer=tok, metrics=Metrics())
    schemas = {"Bash": BASH["function"]["parameters"], "Read": READ["function"]["parameters"]}
    for parallel, kept in ((True, 2), (False, 1)):
        gen = Generation(state, [0], 8, sampling=SamplingParams(), stop=[], logprobs=None, ignore_eos=False,
                         parse=True, schemas=schemas, parallel_tool_calls=parallel)
        out = []
        gen._translate(ToolCall(0, "Bash", '{"command": "ls"}', "<raw>"), out)
        gen._translate(ToolCall(1, "Read", '{"file_path": "a.py"}', "<raw>"), out)
        assert [c.name for c in out if isinstance(c, Call)] == ["Bash", "Read"][:kept]
    assert state.metrics.value("ds4_markup_dropped_total", kind="call") == 1


@pytest.fixture
def calls_never_closed(monkeypatch, tok):
    """The model made to want more calls: every chat request's sampling bans the token that
    closes a tool-call block (a -100 `logit_bias`, which a grammar's mask still overrides). Left
    alone, the tiny model makes one call and closes the block."""
    import dataclasses

    import serve.http.chat as chat

    (closer,) = getattr(tok, "hf", tok).encode("</｜DSML｜tool_calls>", add_special_tokens=False)
    sampling = chat.no_calls_sampling

    def biased(state, creq):
        params, stops = sampling(state, creq)
        return dataclasses.replace(params, logit_bias={**dict(params.logit_bias), closer: -100.0}), stops

    monkeypatch.setattr(chat, "no_calls_sampling", biased)


def test_each_api_takes_parallel_tool_calls(model, calls_never_closed):
    """Each API's way of asking for one call at most (chat's and Responses' `parallel_tool_calls:
    false`, Anthropic's `disable_parallel_tool_use`), greedy, from a model that keeps calling:
    without it the reply makes several calls, with it exactly the first of them."""
    with calls_server(model) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)

        def chat(**flag):
            r = oai.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[BASH, READ], max_tokens=60,
                                            temperature=0, **flag)
            return [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []]

        def responses(**flag):
            r = oai.responses.create(model=MODEL, input="What is the weather in Paris?", max_output_tokens=60,
                                     temperature=0, tools=[{"type": "function", **BASH["function"]}], **flag)
            assert r.parallel_tool_calls is flag.get("parallel_tool_calls", True)
            return [(o.name, o.arguments) for o in r.output if o.type == "function_call"]

        def messages(**flag):
            m = client.messages.create(model=MODEL, max_tokens=60, messages=WEATHER_Q, extra_body={"temperature": 0},
                                       tools=[{"name": "Bash", "input_schema": BASH["function"]["parameters"]}],
                                       tool_choice={"type": "auto", **flag})
            return [(b.name, b.input) for b in m.content if b.type == "tool_use"]

        for ask, one in ((chat, {"parallel_tool_calls": False}), (responses, {"parallel_tool_calls": False}),
                         (messages, {"disable_parallel_tool_use": True})):
            several = ask()
            assert len(several) > 1, (ask.__name__, several)
            assert ask(**one) == several[:1], ask.__name__
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[BASH], max_tokens=4,
                                        extra_body={"parallel_tool_calls": "no"})
        assert e.value.response.json()["error"]["param"] == "parallel_tool_calls"
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=MODEL, max_tokens=4, messages=WEATHER_Q, tools=[
                {"name": "Bash", "input_schema": BASH["function"]["parameters"]}],
                tool_choice={"type": "auto", "disable_parallel_tool_use": "yes"})
