"""The documentation stays true: README.md, docs/*.md and examples/README.md.

- every relative link resolves, and every `#anchor` names a heading of its page (GitHub's slugs);
- every `--flag` a page names exists: on a command line (`ds4-torch ...`, `python -m serve`,
  `torchrun ... -m ds4_torch ...`, `python examples/x.py ...`) in that command or script, anywhere
  else in one of them;
- a flag table (a markdown table right after `<!-- flags: COMMAND -->`) lists exactly the
  command's flags, from its argparse parser, with their defaults and choices;
- no page refers to the project's tracker (`#12`, "issue") or to how the work was organised.

Nothing is run: the parsers are built (argparse only) and scripts are read with `ast`.
"""
from __future__ import annotations

import argparse
import ast
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
FENCE = re.compile(r"^(```|~~~)")
MARKER = re.compile(r"^\s*<!--\s*flags:\s*(.+?)\s*-->\s*$")
# lm-evaluation-harness's CLI, named on the serving page; not a dependency, so not importable here.
LM_EVAL_FLAGS = {"--model", "--model_args", "--tasks", "--include_path"}
# vllm-router's (0.1.17), named on the scaling-out page: those it is run with there (its CLI is a
# Rust binary's, not importable; `vllm-router --help` lists them all).
VLLM_ROUTER_FLAGS = {"--host", "--port", "--worker-urls", "--policy", "--api-key", "--health-check-interval-secs",
                     "--health-failure-threshold", "--kv-aware-session-affinity-ttl-secs", "--kv-event-source",
                     "--kv-event-block-size", "--kv-event-model"}
# Building llama.cpp, `bench quant`'s optional peer (performance page): pip's and cmake's flags it
# is built with, and llama-bench's `--repack` (which the benchmark passes where it must).
LLAMA_CPP_BUILD_FLAGS = {"--no-deps", "--no-binary", "--build", "--target", "--repack"}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --------------------------------------------------------------------------- markdown
def split_fences(text: str) -> tuple[str, list[tuple[int, str]]]:
    """(the text with fenced code blanked, line numbers kept; [(first line number, code)])."""
    prose, blocks, inside, start, code = [], [], False, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            if inside:
                blocks.append((start, "\n".join(code)))
            inside, start, code = not inside, n + 1, []
            prose.append("")
        elif inside:
            code.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def inline_code(prose: str) -> list[tuple[int, str]]:
    return [(line_of(prose, m.start()), m.group(1)) for m in re.finditer(r"`([^`]+)`", prose)]


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation but `-` and `_`
    removed, spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split_fences(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(out)


def links(path: Path) -> list[tuple[int, str]]:
    prose, _ = split_fences(path.read_text())
    prose = re.sub(r"`[^`]*`", lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)  # code spans hold no links
    return [(line_of(prose, m.start()), m.group(1))
            for m in re.finditer(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)]


# --------------------------------------------------------------------------- the commands
def _parsers_under(prefix: str, parser: argparse.ArgumentParser, out: dict) -> None:
    out[prefix] = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                _parsers_under(f"{prefix} {name}", sub, out)


@lru_cache(maxsize=None)
def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command the pages may name, by its spelling there: `ds4-torch serve`, `ds4-torch bench
    model`, `python -m serve`, `torchrun`."""
    from torch.distributed.run import get_args_parser

    from ds4_torch.cli import build_parser
    from serve.cli import build_parser as build_serve_parser

    out: dict[str, argparse.ArgumentParser] = {}
    _parsers_under("ds4-torch", build_parser(), out)
    out["python -m serve"] = build_serve_parser()
    out["torchrun"] = get_args_parser()
    return out


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


@lru_cache(maxsize=None)
def script_flags(path: Path) -> frozenset[str]:
    """A script's flags: the options of its `add_argument` calls, and the `--flag` literals it
    compares its arguments with (`argv[:1] == ["--write"]`: parsed by hand). Flags it only passes
    on (to a server it starts) are not its own."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = [arg for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "add_argument"
             for arg in n.args]
    nodes += [c for n in ast.walk(tree) if isinstance(n, ast.Compare) for c in ast.walk(n)]
    own = frozenset(n.value for n in nodes
                    if isinstance(n, ast.Constant) and isinstance(n.value, str) and FLAG.fullmatch(n.value))
    # A sibling script it imports may add its shared arguments (train_names.py: train_long.run_arguments).
    siblings = {path.parent / f"{n.module}.py" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return own.union(*(script_flags(s) for s in siblings if s.is_file() and s != path))


@lru_cache(maxsize=None)
def known_flags() -> frozenset[str]:
    """Every flag of every command and script: what a flag named outside a command line must be."""
    flags = LM_EVAL_FLAGS | VLLM_ROUTER_FLAGS | LLAMA_CPP_BUILD_FLAGS
    for parser in parsers().values():
        flags |= options(parser)
    for script in [*ROOT.glob("examples/*.py"), *ROOT.glob("tests/clients/*.py"), *ROOT.glob("ds4_torch/**/*.py"),
                   *ROOT.glob("serve/*.py")]:
        flags |= script_flags(script)
    return frozenset(flags)


def _module_path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.exists():
            return candidate
    return None


def _words(segment: str) -> list[str]:
    try:
        words = shlex.split(segment, comments=True)
    except ValueError:  # an unbalanced quote in prose-like code
        words = segment.split()
    return [w.strip("[](),") for w in words]


def _ds4_command(words: list[str], i: int, base: str) -> tuple[str, int]:
    """The longest `ds4-torch sub sub` spelled from words[i:], and where its arguments start."""
    name, table = base, parsers()
    while i < len(words) and f"{name} {words[i]}" in table:
        name, i = f"{name} {words[i]}", i + 1
    return name, i


def invocations(text: str) -> list[tuple[str, set[str], list[str]]]:
    """(command, its flags, the flags given to it) for each command line in `text`."""
    text = re.sub(r"\\\n", " ", text)
    found = []
    for line in text.splitlines():
        for segment in re.split(r"&&|;|\s\|\s", line):
            words = _words(segment)
            i, current = 0, None  # current: (name, allowed flags, given flags)
            while i < len(words):
                word, nxt = words[i], words[i + 1] if i + 1 < len(words) else ""
                start = None
                if word.rsplit("/", 1)[-1] == "ds4-torch":
                    name, i = _ds4_command(words, i + 1, "ds4-torch")
                    start = (name, options(parsers()[name]))
                elif re.fullmatch(r"(.*/)?python3?", word) and nxt == "-m" and i + 2 < len(words):
                    module, i = words[i + 2], i + 3
                    if module == "ds4_torch":
                        name, i = _ds4_command(words, i, "ds4-torch")
                        start = (name, options(parsers()[name]))
                    elif module == "serve":
                        start = ("python -m serve", options(parsers()["python -m serve"]))
                    elif _module_path(module) is not None:
                        start = (f"python -m {module}", set(script_flags(_module_path(module))))
                    else:
                        start = (f"python -m {module}", None)  # pytest, pip, ...: not checked
                elif re.fullmatch(r"(.*/)?python3?", word) and nxt.endswith(".py"):
                    script = ROOT / nxt
                    if not script.is_file():
                        raise ValueError(f"a command runs {nxt}, which does not exist")
                    start, i = (f"python {nxt}", set(script_flags(script))), i + 2
                elif word == "torchrun":
                    start, i = ("torchrun", options(parsers()["torchrun"])), i + 1
                elif word == "-m" and current and current[0] == "torchrun" and nxt == "ds4_torch":
                    name, i = _ds4_command(words, i + 2, "ds4-torch")
                    start = (name, options(parsers()[name]))
                elif word == "lm_eval":
                    start, i = ("lm_eval", set(LM_EVAL_FLAGS)), i + 1
                elif word == "vllm-router":
                    start, i = ("vllm-router", set(VLLM_ROUTER_FLAGS)), i + 1
                if start is not None:
                    current = (*start, [])
                    found.append(current)
                    continue
                if current is not None and FLAG.fullmatch(word.split("=", 1)[0]):
                    current[2].append(word.split("=", 1)[0])
                i += 1
    return [(name, allowed, given) for name, allowed, given in found if allowed is not None]


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("path", doc_files(), ids=rel)
def test_links_and_anchors_resolve(path):
    broken = []
    for n, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{rel(path)}:{n}: {target}: no file {file_part}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{rel(path)}:{n}: {target}: {rel(dest)} has no heading with anchor #{anchor} "
                          f"(it has: {', '.join(sorted(anchors(dest)))})")
        elif anchor and dest.suffix != ".md":
            broken.append(f"{rel(path)}:{n}: {target}: an anchor into a file that is not markdown")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("path", doc_files(), ids=rel)
def test_every_flag_named_exists(path):
    text = path.read_text()
    prose, blocks = split_fences(text)
    stale = []
    for n, line in enumerate(text.splitlines(), 1):
        for flag in FLAG.findall(line):
            if flag not in known_flags():
                stale.append(f"{rel(path)}:{n}: {flag} is a flag of no command or script here")
    for n, code in [*inline_code(prose), *blocks]:
        try:
            commands = invocations(code)
        except ValueError as e:
            stale.append(f"{rel(path)}:{n}: {e}")
            continue
        for name, allowed, given in commands:
            for flag in given:
                if flag not in allowed:
                    stale.append(f"{rel(path)}:{n}: `{name}` has no flag {flag}")
    assert not stale, "stale flags:\n" + "\n".join(stale)


ISSUE_WORDS = re.compile(r"(?<![\w&/])#\d+\b|\bissues?\b|\bthis session\b|\bpull request\b|\bPR\b", re.I)


def tracker_references(text: str) -> list[tuple[int, str]]:
    text = re.sub(r"\]\([^)]*\)", "]()", text)  # link targets may hold #anchors
    return [(line_of(text, m.start()), m.group(0)) for m in ISSUE_WORDS.finditer(text)]


@pytest.mark.parametrize("path", doc_files(), ids=rel)
def test_no_references_to_the_tracker(path):
    hits = [f"{rel(path)}:{n}: {word!r}" for n, word in tracker_references(path.read_text())]
    assert not hits, ("pages say what is true now; issue numbers and how the work went belong in commit "
                      "messages:\n" + "\n".join(hits))


def flag_tables() -> list[tuple[Path, int, str, list[list[str]]]]:
    """(page, line, command, rows as lists of cells) for each table after a flags marker."""
    tables = []
    for path in doc_files():
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            m = MARKER.search(line)
            if not m:
                continue
            rows, k = [], n + 1
            while k < len(lines) and lines[k].lstrip().startswith("|"):
                cells = [c.strip() for c in lines[k].strip().strip("|").split("|")]
                if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                    rows.append(cells)
                k += 1
            tables.append((path, n + 1, m.group(1), rows[1:]))  # rows[0]: the header
    return tables


def test_the_flag_tables_exist():
    commands = {command for _, _, command, _ in flag_tables()}
    assert {"ds4-torch serve", "ds4-torch generate", "ds4-torch info"} <= commands, commands


def _shown(value) -> set[str]:
    """How a default may be written: 5.0 as 5 or 5.0."""
    shown = {str(value)}
    if isinstance(value, float) and value.is_integer():
        shown.add(str(int(value)))
    return shown


@pytest.mark.parametrize("table", flag_tables(), ids=lambda t: f"{rel(t[0])}:{t[2]}")
def test_flag_table_matches_the_parser(table):
    path, line, command, rows = table
    assert command in parsers(), f"{rel(path)}:{line}: unknown command {command!r} in the flags marker"
    parser = parsers()[command]
    where = f"{rel(path)}:{line} (the flags table of `{command}`)"
    actions = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    by_option = {o: a for a in actions for o in a.option_strings}
    problems, documented = [], {}
    for cells in rows:
        named = re.findall(r"(?<![\w-])-{1,2}[A-Za-z][\w-]*", cells[0])
        if not named:
            problems.append(f"{where}: a row names no flag: {cells[0]!r}")
        for option in named:
            if option not in by_option:
                problems.append(f"{where}: documents {option}, which `{command}` does not have: remove its row")
            else:
                documented[id(by_option[option])] = cells
    for action in actions:
        flag = max(action.option_strings, key=len)
        cells = documented.get(id(action))
        if cells is None:
            problems.append(f"{where}: no row for {flag}: add `| `{flag}` | default | what it does |` "
                            f"(its help: {action.help!r})")
            continue
        default = action.default
        if default not in (None, False, [], argparse.SUPPRESS) and not action.required:
            cell = cells[1].replace("`", "") if len(cells) > 1 else ""
            if not any(re.search(rf"(?<![\w.]){re.escape(s)}(?![\w.])", cell) for s in _shown(default)):
                problems.append(f"{where}: {flag}'s default is {default!r}, the row says {cell!r}")
        if action.choices is not None and not isinstance(action.choices, range):
            row = " ".join(cells)
            missing = [c for c in action.choices if f"`{c}`" not in row]
            if missing:
                problems.append(f"{where}: {flag} takes {list(action.choices)}; the row does not name {missing}")
    assert not problems, "\n".join(problems)


def test_readme_opens_with_the_two_ci_commands():
    """`.ci/run` runs the non-blank lines of the README's first code block and wants exactly two."""
    _, blocks = split_fences((ROOT / "README.md").read_text())
    commands = [line for line in blocks[0][1].splitlines() if line.strip()]
    assert len(commands) == 2, f"README.md's first code block must hold the 2 CI commands, it holds {commands}"
    assert all(c.startswith("python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && ") for c in commands)


def test_every_docs_page_is_linked_from_the_index_and_the_readme():
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    for index in (ROOT / "docs" / "README.md", ROOT / "README.md"):
        linked = {Path(target.partition("#")[0]).name for _, target in links(index)}
        assert pages <= linked, f"{rel(index)} does not link {sorted(pages - linked)}"


# --------------------------------------------------------------------------- the checks check
def test_the_checks_catch_what_they_should():
    """Each check fails on the kind of mistake it is for (on text written here, not the pages)."""
    assert "quantized-weights---quantized-keep" in {github_slug("Quantized weights (`--quantized keep`)")}
    assert github_slug("Agents: Claude Code, Codex, MCP and tools") == "agents-claude-code-codex-mcp-and-tools"
    (launcher, _, before), (name, allowed, given) = invocations(
        "torchrun --nproc-per-node 2 -m ds4_torch serve --tp 2 --no-such")
    assert launcher == "torchrun" and before == ["--nproc-per-node"]
    assert name == "ds4-torch serve" and "--no-such" in given and "--no-such" not in allowed
    (_, allowed, given), = invocations(".venv/bin/ds4-torch bench serve [--scenario agents] [--ctx N]")
    assert "--scenario" in allowed and "--ctx" in given and "--ctx" not in allowed  # bench serve has no --ctx
    (_, allowed, given), = invocations('python tests/clients/drive.py --runs 2 --serve-args "--ctx 9"')
    assert given == ["--runs", "--serve-args"] and set(given) <= allowed
    assert tracker_references("fixed in #22") and tracker_references("the issue's target")
    assert not tracker_references("see [x](#22-things) and &#8212;")
