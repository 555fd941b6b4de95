"""Synthetic coding-agent conversations for the embedded model, seeded and reproducible.

What a coding agent sends: a long system prompt (made-up agent instructions and environment
notes, ``system_prompt``), a tools section naming its tools the way common agents do (Claude
Code's ``Bash``/``Read``/``Glob``/``Grep``/``Edit``/``Write``/``LS``, Codex's ``shell``/
``exec_command``/``apply_patch``, MCP tools under a namespace, or made-up names), then requests
such as "list the files", "show main.py" or "what is the weather in X?". The assistant calls the
offered tool that fits (a dedicated one when offered, else the shell tool with the matching
command), the tool result comes back, and the assistant answers from it. A request no offered
tool serves gets a plain answer: a tool that is not offered is never called.

Tool names and their order change with every conversation, so the model has to copy the name
from the tools section of the prompt it is given instead of recalling one agent's list. The
held-out split (``split="held_out"``) uses tool names, file names and cities training never
shows; ``long_range_probe`` builds the issue's probes: a tools section at the start, tens of
thousands of tokens of filler, and a request at the end.

    from agent_corpus import agent_conversation
    conv = agent_conversation(random.Random(0), system_tokens=10_000)   # {"messages", "tools", "thinking"}
"""
from __future__ import annotations

import json
import random

import tool_corpus
from tool_corpus import _assistant

# ---------------------------------------------------------------- tool families
# A purpose, the names agents give a tool for it, and the argument it takes.
SHELL_TOOLS = [("Bash", "command"), ("shell", "command"), ("exec_command", "cmd"), ("run_command", "command"),
               ("run_terminal_cmd", "command"), ("execute", "command"), ("terminal", "command")]
LIST_TOOLS = [("LS", "path"), ("list_dir", "path"), ("list_files", "path"), ("Glob", "pattern"),
              ("list_directory", "path")]
READ_TOOLS = [("Read", "file_path"), ("read_file", "path"), ("view_file", "path"), ("open_file", "path")]
SEARCH_TOOLS = [("Grep", "pattern"), ("search_files", "query"), ("grep_search", "query"), ("find_text", "query")]
WRITE_TOOLS = [("Write", "file_path"), ("write_file", "path"), ("create_file", "path")]
# Offered beside the others, never the one that fits a request here.
OTHER_TOOLS = ["Edit", "apply_patch", "NotebookEdit", "TodoWrite", "WebFetch", "Agent", "Skill", "ToolSearch",
               "ScheduleWakeup", "write_stdin", "view_image", "update_plan", "request_user_input", "Workflow",
               "list_mcp_resources", "read_mcp_resource", "ListAgents", "ReportFindings", "str_replace"]
SERVICE_TOOLS = {"weather": ("get_weather", "city"), "time": ("get_time", "city"),
                 "stock": ("get_stock_price", "symbol")}
MCP_SERVERS = {"weather": ["weather", "forecast", "meteo"], "time": ["clock", "worldtime"],
               "stock": ["market", "finance"]}

DESCRIPTIONS = {
    "shell": ["Run a shell command and return its output.", "Executes a bash command in the workspace.",
              "Runs a command in a terminal and returns stdout and stderr."],
    "list": ["List the files in a directory.", "Lists the entries of a folder.",
             "Find files whose paths match a glob pattern."],
    "read": ["Read a file from the local filesystem.", "Returns the contents of a file.",
             "Reads a text file and returns its lines."],
    "search": ["Search file contents for a pattern.", "Searches the code for text.",
               "Find lines matching a regular expression."],
    "write": ["Write a file to the local filesystem.", "Creates a file with the given content."],
    "weather": ["Get the current weather in a city.", "Returns the weather for a city."],
    "time": ["Get the local time in a city.", "Returns the current time in a city."],
    "stock": ["Get the latest price of a stock.", "Returns a stock's price."],
    "other": ["Performs an action in the workspace.", "A tool for a task this request does not need.",
              "Manages the agent's plan.", "Talks to another agent.", "Edits a file by replacing text."],
}

KNOWN_NAMES = {n.lower() for family in (SHELL_TOOLS, LIST_TOOLS, READ_TOOLS, SEARCH_TOOLS, WRITE_TOOLS)
               for n, _ in family} | {n.lower() for n in OTHER_TOOLS} | {n for n, _ in SERVICE_TOOLS.values()}

# Made-up tool names: training draws from these words, the held-out split from others.
NAME_WORDS = {
    "train": ["fetch", "run", "get", "show", "list", "read", "scan", "find", "call", "look", "query", "load", "peek",
              "probe", "dump", "view", "cast", "pull", "seek", "trace", "file", "dir", "text", "data", "node", "shell",
              "cmd", "info", "item", "page", "zorb", "quix", "dral", "mirth", "vex", "plon", "krat", "bex", "tund"],
    "held_out": ["gather", "survey", "inspect", "glean", "harvest", "ember", "quill", "lumen", "atlas", "orbit",
                 "prism", "ridge", "sable", "tonic", "vortex", "willow", "yarrow", "zephyr", "cobalt", "delta"],
}


def novel_tool_name(rng: random.Random, split: str = "train") -> str:
    """A made-up tool name ("zorb_fetch", "LumenAtlas", "quix"): thousands of them, never the
    name of a listed tool ("Read" would teach that a weather tool may be called Read)."""
    words = NAME_WORDS[split]
    while True:
        parts = [rng.choice(words) for _ in range(rng.randint(1, 3))]
        style = rng.random()
        if style < 0.5:
            name = "_".join(parts)
        elif style < 0.8:
            name = "".join(p.capitalize() for p in parts)
        else:
            name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 10)))
        if name.lower() not in KNOWN_NAMES:
            return name


# ---------------------------------------------------------------- files and filler
FILES = {
    "train": ["main.py", "README.md", "setup.py", "app.js", "index.html", "Makefile", "config.json", "utils.py",
              "server.go", "lib.rs", "notes.txt", "requirements.txt", "Cargo.toml", "package.json", "test_app.py",
              "LICENSE", "Dockerfile", "run.sh", "style.css", "data.csv", ".gitignore", "pyproject.toml"],
    "held_out": ["model.py", "CHANGELOG.md", "build.gradle", "main.c", "schema.sql", "routes.ts", "todo.txt"],
}
DIRS = {"train": ["src", "tests", "docs", "lib", "scripts", "app", "bin", "assets"],
        "held_out": ["examples", "tools", "web"]}
CODE_LINES = ["import os", "import sys", "def main():", "    return 0", "print('hello')", "x = 1", "for i in range(3):",
              "    total += i", "class App:", "    pass", "if __name__ == '__main__':", "    main()", "# TODO: tidy",
              "name = 'demo'", "const port = 8080;", "fn main() {}", "let items = [];", "return items"]
SEARCH_WORDS = ["TODO", "main", "import", "port", "error", "config", "test", "FIXME", "load", "user"]


def novel_file(rng: random.Random) -> str:
    stem = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
    return stem + rng.choice([".py", ".md", ".txt", ".js", ".json", ".sh", ".go", ".rs", ""])


def a_file(rng: random.Random, split: str) -> str:
    return novel_file(rng) if split == "train" and rng.random() < 0.5 else rng.choice(FILES[split])


SUBJECTS = ["the repository", "the user's files", "tests", "commits", "pull requests", "the build", "comments",
            "dependencies", "secrets", "the terminal", "long outputs", "the working tree", "code style", "errors",
            "the plan", "sub-agents", "network access", "the sandbox", "file edits", "git history", "formatting"]
RULES = ["Always {v} {s} before you {v2} {s2}.", "Never {v} {s} unless the user asks.", "Prefer to {v} {s} over {s2}.",
         "When you {v} {s}, keep it short.", "Do not {v} {s} without a reason.", "If {s} fails, {v2} {s2} and retry.",
         "You may {v} {s} at any time.", "Ask before you {v} {s}.", "Keep {s} and {s2} apart.",
         "Report {s} to the user in one line."]
VERBS = ["read", "check", "edit", "run", "list", "commit", "explain", "summarise", "update", "verify", "clean",
         "describe", "search", "format", "review", "test", "open", "close", "mention", "protect"]
ENV_NOTES = ["Working directory: /home/user/{d}", "Platform: linux", "Shell: bash", "Is a git repository: {g}",
             "Today's date: 2026-0{m}-1{m}", "OS version: Linux 6.{m}", "Model: the default one",
             "Sandbox: workspace-write", "Network access: {g}"]


def system_prompt(rng: random.Random, tokens: int, tok=None, chars_per_token: float = 2.6) -> str:
    """Made-up agent instructions and environment notes of about `tokens` tokens (measured with
    `tok` when given, else estimated from characters)."""
    lines = ["You are a coding agent. You help the user with software tasks in their workspace."]
    target_chars = int(tokens * chars_per_token)
    size = len(lines[0])
    while size < target_chars:
        r = rng.random()
        if r < 0.08:
            line = "\n# " + rng.choice(SUBJECTS).capitalize() + "\n"
        elif r < 0.16:
            line = "- " + rng.choice(ENV_NOTES).format(d=rng.choice(DIRS["train"]), g=rng.choice(["yes", "no"]),
                                                          m=rng.randint(1, 9))
        else:
            line = "- " + rng.choice(RULES).format(v=rng.choice(VERBS), v2=rng.choice(VERBS), s=rng.choice(SUBJECTS),
                                                   s2=rng.choice(SUBJECTS))
        lines.append(line)
        size += len(line) + 1
    text = "\n".join(lines)
    if tok is not None:  # trim to the budget in tokens
        enc = tok.encode(text, add_special_tokens=False)
        if len(enc.ids) > tokens:
            text = text[:enc.offsets[tokens - 1][1]]
    return text


def long_description(rng: random.Random, base: str, sentences: int) -> str:
    """A tool description as long as agents write theirs (Claude Code's run to thousands of tokens)."""
    extra = [rng.choice(RULES).format(v=rng.choice(VERBS), v2=rng.choice(VERBS), s=rng.choice(SUBJECTS),
                                      s2=rng.choice(SUBJECTS)) for _ in range(sentences)]
    return " ".join([base] + extra)


# ---------------------------------------------------------------- tools offered
def _tool(name: str, description: str | None, params: dict[str, dict], required: list[str]) -> dict:
    fn = {"name": name}
    if description is not None:
        fn["description"] = description
    fn["parameters"] = {"type": "object", "properties": params, "required": required}
    return {"type": "function", "function": fn}


def _string(desc: str | None = None) -> dict:
    return {"type": "string", **({"description": desc} if desc else {})}


def offer_tools(rng: random.Random, split: str = "train", novel: float = 0.3, long_descriptions: float = 0.3
                ) -> tuple[list[dict], dict[str, tuple[str, str]]]:
    """A random agent's tool list: (tools, {purpose: (name, argument)}) for the purposes it covers."""
    tools, offered = [], {}
    used: set[str] = set()

    def name_for(family_names: list[str], purpose: str) -> str:
        if split == "held_out" or rng.random() < novel:
            while (name := novel_tool_name(rng, split)) in used:
                pass
            return name
        if purpose in MCP_SERVERS and rng.random() < 0.4:
            return f"mcp__{rng.choice(MCP_SERVERS[purpose])}__{family_names[0]}"
        return rng.choice(family_names)

    families = [("shell", SHELL_TOOLS), ("list", LIST_TOOLS), ("read", READ_TOOLS), ("search", SEARCH_TOOLS),
                ("write", WRITE_TOOLS)] + [(p, [SERVICE_TOOLS[p]]) for p in SERVICE_TOOLS]
    for purpose, family in families:
        if rng.random() < (0.75 if purpose == "shell" else 0.45):
            real_name, arg = rng.choice(family)
            name = name_for([n for n, _ in family if n == real_name] or [real_name], purpose)
            if name in used:
                continue
            used.add(name)
            offered[purpose] = (name, arg)
            desc = rng.choice(DESCRIPTIONS[purpose])
            if rng.random() < long_descriptions:
                desc = long_description(rng, desc, rng.randint(5, 60))
            params = {arg: _string(rng.choice([None, "The " + arg.replace("_", " ") + "."]))}
            required = [arg]
            if purpose == "write":
                params["content"] = _string("The text to write.")
                required.append("content")
            if purpose == "shell" and rng.random() < 0.5:
                params["description"] = _string("What the command does, in a few words.")
            tools.append(_tool(name, desc, params, required))
    for _ in range(rng.randint(0, 6)):
        name = rng.choice(OTHER_TOOLS) if rng.random() < 0.7 else novel_tool_name(rng, split)
        if name not in used:
            used.add(name)
            desc = rng.choice(DESCRIPTIONS["other"])
            if rng.random() < long_descriptions:
                desc = long_description(rng, desc, rng.randint(5, 40))
            tools.append(_tool(name, desc, {"input": _string()}, ["input"]))
    rng.shuffle(tools)
    return tools, offered


# ---------------------------------------------------------------- requests
LIST_ASKS = ["List the files in this directory.", "What files are in this folder?", "Show me the files here.",
             "Which files are in {dir}?", "List the files in {dir}.", "What is in this directory?",
             "list files", "Can you list the files in the current directory?"]
READ_ASKS = ["Show {file}.", "What is in {file}?", "Read {file}.", "Open {file} and show it to me.",
             "Print the contents of {file}.", "show me {file}"]
SEARCH_ASKS = ["Find {word} in the code.", "Where is {word} used?", "Search the files for {word}.",
               "grep for {word}"]
RUN_ASKS = ["Run {cmd}.", "Please run `{cmd}`.", "Execute {cmd} and tell me what it prints.", "run {cmd}"]
COMMANDS = {"git status": "On branch main\nnothing to commit, working tree clean", "pwd": "/home/user/project",
            "date": "Tue Nov 24 10:00:00 UTC 2026", "make test": "All 12 tests passed.", "whoami": "user",
            "python --version": "Python 3.11.9", "git log --oneline -1": "a1b2c3d Initial commit",
            "uname -a": "Linux box 6.1.0 x86_64 GNU/Linux", "npm test": "5 passing", "echo hello": "hello"}
WRITE_ASKS = ["Create {file} with the text {words}.", "Write {words} into {file}.", "Make a file {file} saying {words}."]
ANSWERS = {
    "list": ["The directory holds {n} entries: {items}.", "Here are the files: {items}.", "I found {n} entries: {items}."],
    "read": ["{file} has {n} lines. It begins with: {first}", "Here is {file}:\n{body}", "{file} starts with `{first}`."],
    "search": ["{word} appears in {n} places, first in {where}.", "I found {n} matches for {word}; the first is in {where}."],
    "shell": ["The command printed: {output}", "It says: {output}", "Output: {output}"],
    "write": ["I wrote {file}.", "Done: {file} now holds the text.", "{file} is created."],
}
NO_TOOL = {"shell": "run commands", "list": "list files", "read": "read files", "search": "search the code", "write": "write files",
           "weather": "look up the weather", "time": "tell the time", "stock": "look up stock prices"}


def _request(rng, purpose: str, split: str, offered: dict, novel: float) -> tuple[str, str | None, dict, str, str]:
    """(user text, tool name or None, call arguments, tool result, answer) for one request."""
    if purpose in SERVICE_TOOLS:
        text, args, result, _ = tool_corpus.request(rng, SERVICE_TOOLS[purpose][0], split, novel, "mixed")
        answer = tool_corpus.answer(rng, SERVICE_TOOLS[purpose][0], args, result)
        if purpose not in offered:
            return text, None, {}, "", f"I cannot {NO_TOOL[purpose]} with the tools I have here."
        name, arg = offered[purpose]
        return text, name, {arg: next(iter(args.values()))}, json.dumps(result), answer
    if purpose == "shell":
        cmd = rng.choice(list(COMMANDS))
        text = rng.choice(RUN_ASKS).format(cmd=cmd)
        if "shell" not in offered:
            return text, None, {}, "", f"I cannot {NO_TOOL[purpose]} with the tools I have here."
        name, arg = offered["shell"]
        output = COMMANDS[cmd]
        return text, name, {arg: cmd}, output, rng.choice(ANSWERS["shell"]).format(output=output)
    directory = rng.choice(DIRS[split]) if rng.random() < 0.3 else None
    file, word = a_file(rng, split), rng.choice(SEARCH_WORDS)
    words = " ".join(rng.choice(VERBS) for _ in range(rng.randint(1, 3)))
    asks = {"list": LIST_ASKS, "read": READ_ASKS, "search": SEARCH_ASKS, "write": WRITE_ASKS}[purpose]
    ask = rng.choice([a for a in asks if ("{dir}" in a) == (directory is not None)] or asks)
    text = ask.format(dir=directory, file=file, word=word, words=words)
    entries = rng.sample(FILES[split] + DIRS[split], rng.randint(2, 6))
    body_lines = rng.sample(CODE_LINES, rng.randint(2, 5))
    where = f"{a_file(rng, split)}:{rng.randint(1, 90)}"
    n_matches = rng.randint(1, 5)
    result = {"list": "\n".join(entries), "read": "\n".join(body_lines),
              "search": "\n".join(f"{a_file(rng, split) if i else where.split(':')[0]}:{rng.randint(1, 90)}: {word}"
                                  for i in range(n_matches)),
              "write": ""}[purpose]
    if purpose == "search":
        where = result.split("\n")[0].rsplit(":", 1)[0]
    answer = rng.choice(ANSWERS[purpose]).format(n=len(entries) if purpose == "list" else
                                                 (len(body_lines) if purpose == "read" else n_matches),
                                                 items=", ".join(entries), file=file, first=body_lines[0],
                                                 body="\n".join(body_lines), word=word, where=where)
    target = directory or "."
    if purpose in offered:
        name, arg = offered[purpose]
        value = {"list": (f"{target}/*" if directory else "*") if arg == "pattern" else target,
                 "read": file, "search": word, "write": file}[purpose]
        args = {arg: value}
        if purpose == "write":
            args["content"] = words
        return text, name, args, result or f"Wrote {file}.", answer
    if "shell" in offered:
        name, arg = offered["shell"]
        command = {"list": f"ls {directory}" if directory else "ls", "read": f"cat {file}",
                   "search": f"grep -rn {word} .", "write": f"echo '{words}' > {file}"}[purpose]
        return text, name, {arg: command}, result, answer
    return text, None, {}, "", f"I cannot {NO_TOOL[purpose]} with the tools I have here."


REASONING_CALL = "The user wants me to {what}. The tool for that is {tool}."
REASONING_NONE = "No offered tool can do this."
REASONING_ANSWER = "The tool answered; I can reply now."


def agent_conversation(rng: random.Random, split: str = "train", system_tokens: int = 0, tok=None,
                       rounds: int | tuple[int, int] = (1, 4), thinking: float = 0.4, novel: float = 0.3,
                       filler_rounds: float = 0.2, trailing: float = 0.0,
                       trailing_tokens: tuple[int, int] = (200, 4000)) -> dict:
    """One agent chat ending in an assistant turn: {"messages", "tools", "thinking"}. Each round
    is a request, the call of the fitting offered tool, its result and an answer (or a plain
    answer when no offered tool fits). `filler_rounds`: the chance that a round's request comes
    after a long pasted block, so later calls look far back for the tools section. `trailing`:
    the chance that a system message of `trailing_tokens` tokens (environment notes, rules)
    follows the request, as Claude Code sends one after the prompt, so the model has to look
    back past it for the request itself."""
    tools, offered = offer_tools(rng, split, novel)
    think = rng.random() < thinking and bool(tools)  # (without tools, thinking mode drops earlier reasoning)
    messages = []
    if system_tokens:
        messages.append({"role": "system", "content": system_prompt(rng, system_tokens, tok)})
    purposes = list(offered) + ["list", "read", "search", "weather"]  # sometimes a purpose nothing offers
    n_rounds = rng.randint(*rounds) if isinstance(rounds, tuple) else rounds
    for r in range(n_rounds):
        purpose = rng.choice(purposes)
        text, name, args, result, answer = _request(rng, purpose, split, offered, novel)
        if rng.random() < filler_rounds:
            text = system_prompt(rng, rng.randint(200, 2000), tok) + "\n\n" + text
        if rng.random() < 0.3:  # clients put context blocks before the request
            text = "<system-reminder>\n" + rng.choice(ENV_NOTES).format(
                d=rng.choice(DIRS["train"]), g="yes", m=rng.randint(1, 9)) + "\n</system-reminder>\n" + text
        messages.append({"role": "user", "content": text})
        if trailing and rng.random() < trailing:  # (no draw when off: seeded evaluations stay as they were)
            messages.append({"role": "system", "content": system_prompt(rng, rng.randint(*trailing_tokens), tok)})
        if name is None:
            messages.append(_assistant(answer, REASONING_NONE if think else None))
            continue
        call = {"id": f"call_{r}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        reasoning = REASONING_CALL.format(what=NO_TOOL.get(purpose, purpose), tool=name) if think else None
        messages.append({**_assistant("", reasoning), "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        messages.append(_assistant(answer, REASONING_ANSWER if think else None))
    return {"messages": messages, "tools": tools, "thinking": think}


def single_tool_chat(rng: random.Random, filler: str, split: str = "train") -> tuple[dict, str]:
    """One tool with a made-up name in the tools section, `filler` before the request in the
    user message, then the call, its result and the answer. Returns (conversation, tool name)."""
    purpose = rng.choice(["weather", "time", "stock", "list", "read"])
    name = novel_tool_name(rng, split)
    arg = SERVICE_TOOLS[purpose][1] if purpose in SERVICE_TOOLS else {"list": "path", "read": "file_path"}[purpose]
    offered = {purpose: (name, arg)}
    tools = [_tool(name, rng.choice(DESCRIPTIONS[purpose]), {arg: _string()}, [arg])]
    text, _, args, result, answer = _request(rng, purpose, split, offered, 0.0)
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    messages = [{"role": "user", "content": (filler + "\n\n" if filler else "") + text},
                {**_assistant("", None), "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": result},
                _assistant(answer, None)]
    return {"messages": messages, "tools": tools, "thinking": False}, name


def long_range_probe(rng: random.Random, filler: str, tok=None) -> tuple[dict, str]:
    """The issue's long-range probe: one tool with a held-out name in the tools section at the
    start, `filler` (tens of thousands of tokens) in the first user message, and a request for
    the tool at the end. Returns (conversation without the answer, the tool's name)."""
    conv, name = single_tool_chat(rng, filler, "held_out")
    return {**conv, "messages": conv["messages"][:1]}, name
