"""The pages run as written: every fenced `python` and `sh` block of README.md, docs/*.md and
examples/README.md is run, as a newcomer would run it, on this machine's CPU with the embedded model.

The conventions (docs/contributing.md, "Code blocks the tests run"):

- A comment right above a block's fence says what the tests do with it:
  `<!-- test: needs REASON[, REASON] -->` leaves it unrun (REASON one of `NEEDS`; the text before
  the block, its section's heading or the block's own comments must say so in words);
  `<!-- test: smaller ARGS -->` runs each command of the block with ARGS appended (a long benchmark,
  shortened; the page must say that the tests run smaller arguments);
  `<!-- test: numbers vary -->` above an output block: its numbers and the machine's description
  may differ from what the command prints (the page must say that its numbers vary).
- A block with no language right after a block that runs (blank lines between at most) is that
  block's output, compared with what it prints on stdout (progress and what a command will do go
  to stderr; a server's output: its log up to its first /health),
  whitespace runs counted as one space. Run as written, the lines must be the same; run with
  smaller arguments, every line it prints must be one the page shows. A `...` line in the page
  elides: the other lines it shows must then be printed, in order.
- A `ds4-torch serve` (or `python -m serve`) command starts a server on a free port instead of its
  `--port`; once its /health answers, its log is compared with the page's, and Ctrl-C must stop it
  with status 0. `http://127.0.0.1:8000` in a block is the server the page started (the first
  one), or a plain `ds4-torch serve` the test starts. `.venv/bin/X` is this environment's X.
- The commands run from a scratch directory holding links to the repository's folders, with HOME
  there too (so `~/...` is scratch), one torch thread (`OMP_NUM_THREADS=1`), and no network:
  every proxy variable points at a closed port and the hub is offline. The `ds4-torch` commands,
  scripts and Python blocks run one after the other in one process (a fresh namespace each),
  which saves starting Python and torch for each; identical commands run once.

Besides running the blocks, the checks of the markers themselves are tested on text written here
(`test_the_markers_are_checked`).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = {"python", "sh", "shell", "bash"}
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*test:\s*(.*?)\s*-->\s*$")
LOCAL_URL = "http://127.0.0.1:8000"
# reason -> what the text around the block must say, in words (a regular expression)
NEEDS = {
    "gpu": r"\bGPUs?\b",
    "checkpoint": r"checkpoint",
    "torchrun": r"torchrun|processes",
    "agent": r"Claude Code|Codex|\bclaude\b|\bcodex\b",
    "network": r"install|network|PyPI",
    "suite": r"pytest|test suite|the tests",
    "big": r"GiB|minutes",
    "past-request": r"request_id|request id|\bid=",  # names a request of another run (its id is new each run)
}
SMALLER_SAID = re.compile(r"smaller arguments", re.I)
NUMBERS_SAID = re.compile(r"numbers[^.]*\bvary\b", re.I)


# --------------------------------------------------------------------------- the pages' blocks
@dataclass
class Output:
    line: int
    text: str
    numbers_vary: bool = False


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    code: str
    needs: list[str] = field(default_factory=list)
    smaller: list[str] = field(default_factory=list)
    output: Output | None = None
    before: str = ""  # the visible text the reader sees before it: its section's heading and what follows
    problems: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT) if self.page.is_absolute() else self.page}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]


def parse_page(text: str, page: Path) -> list[Block]:
    """The runnable blocks of a page, with their markers and outputs, and the marker problems found."""
    lines = text.splitlines()
    blocks: list[Block] = []
    fences: list[tuple[int, int, str]] = []  # (opening line index, closing line index, language)
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        close = next((k for k in range(i + 1, len(lines)) if lines[k].strip().startswith(m.group(1))), len(lines))
        fences.append((i, close, m.group(2).lower()))
        i = close + 1
    taken_as_output: set[int] = set()
    for n, (start, close, lang) in enumerate(fences):
        markers, k = [], start - 1
        while k >= 0 and MARKER.match(lines[k]):
            markers.insert(0, MARKER.match(lines[k]).group(1))
            k -= 1
        if start in taken_as_output:
            continue
        if lang not in RUNNABLE:
            if markers:
                problems = [f"{page}:{start + 1}: a test marker above a block that is not run "
                            f"({lang or 'no language'})"]
                blocks.append(Block(page, start + 1, lang, "", problems=problems))
            continue
        block = Block(page, start + 1, lang, "\n".join(lines[start + 1:close]))
        heading_at = max((j for j in range(k + 1) if lines[j].startswith("#")), default=-1)
        previous_fence = max((c for _, c, _ in fences if c < start), default=-1)
        visible = lines[max(heading_at, previous_fence + 1, 0):k + 1]
        if heading_at >= 0 and heading_at <= previous_fence:
            visible.insert(0, lines[heading_at])
        block.before = re.sub(r"<!--.*?-->", "", "\n".join(visible), flags=re.S)
        for marker in markers:
            parse_marker(marker, block)
        # its output: the next fence, if it has no language and only blank lines and markers lie between
        if n + 1 < len(fences):
            nxt, nxt_close, nxt_lang = fences[n + 1]
            between = lines[close + 1:nxt]
            if not nxt_lang and all(not line.strip() or MARKER.match(line) for line in between):
                out = Output(nxt + 1, "\n".join(lines[nxt + 1:nxt_close]))
                for line in between:
                    m = MARKER.match(line)
                    if m and m.group(1) == "numbers vary":
                        out.numbers_vary = True
                    elif m:
                        block.problems.append(f"{page}:{nxt + 1}: unknown marker above an output: {m.group(1)!r}")
                block.output = out
                taken_as_output.add(nxt)
        blocks.append(block)
    check_markers(text, blocks, page)
    return blocks


def parse_marker(marker: str, block: Block) -> None:
    word, _, rest = marker.partition(" ")
    if word == "needs":
        block.needs += [r.strip() for r in rest.split(",") if r.strip()]
    elif word == "smaller":
        block.smaller += shlex.split(rest)
    else:
        block.problems.append(f"{block.where}: unknown marker {marker!r} (needs REASON, smaller ARGS; "
                              f"numbers vary above an output)")


def check_markers(text: str, blocks: list[Block], page) -> None:
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)  # what a reader sees
    for block in blocks:
        comments = [line.lstrip() if line.lstrip().startswith("#") else line.split("  # ", 1)[1]
                    for line in block.code.splitlines() if line.lstrip().startswith("#") or "  # " in line]
        said = "\n".join([block.before, *comments])
        for reason in block.needs:
            if reason not in NEEDS:
                block.problems.append(f"{block.where}: unknown reason {reason!r} (known: {', '.join(NEEDS)})")
            elif not re.search(NEEDS[reason], said):
                block.problems.append(f"{block.where}: needs {reason}, but the text before it does not say so "
                                      f"(it must match {NEEDS[reason]!r})")
        if block.smaller and not SMALLER_SAID.search(text):
            block.problems.append(f"{block.where}: runs with smaller arguments in the tests; the page must say so "
                                  f"('smaller arguments')")
        if block.output and block.output.numbers_vary and not NUMBERS_SAID.search(text):
            block.problems.append(f"{page}:{block.output.line}: numbers vary; the page must say so "
                                  f"('numbers ... vary')")


@lru_cache(maxsize=None)
def all_blocks() -> tuple[Block, ...]:
    return tuple(b for page in doc_files() for b in parse_page(page.read_text(), page))


# --------------------------------------------------------------------------- commands
@dataclass(frozen=True)
class Job:
    """One thing to run: `kind` is "cli" (ds4-torch's argv), "script" (a path and its argv), "python"
    (code), "serve" (serve's argv) or "shell" (a command line)."""
    kind: str
    args: tuple
    needs_server: bool = False


def commands(code: str) -> list[str]:
    """An sh block's command lines: continuations joined, comments and blank lines dropped."""
    out = []
    for line in re.sub(r"\\\n", " ", code).splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(line)
    return out


def job_of(line: str, extra: list[str]) -> Job:
    words = shlex.split(line, comments=True)
    needs_server = any(LOCAL_URL in w for w in words)
    head = re.sub(r"^\.venv/bin/", "", words[0])
    if head == "ds4-torch" or (re.fullmatch(r"python3?", head) and words[1:3] == ["-m", "ds4_torch"]):
        argv = words[1:] if head == "ds4-torch" else words[3:]
        if argv[:1] == ["serve"]:
            return Job("serve", tuple(argv[1:] + extra))
        return Job("cli", tuple(argv + extra), needs_server)
    if re.fullmatch(r"python3?", head) and words[1:3] == ["-m", "serve"]:
        return Job("serve", tuple(words[3:] + extra))
    if re.fullmatch(r"python3?", head) and len(words) > 1 and words[1].endswith(".py"):
        return Job("script", (words[1], *words[2:], *extra), needs_server)
    return Job("shell", (line + (" " + shlex.join(extra) if extra else ""),), needs_server)


def jobs_of(block: Block) -> list[Job]:
    if block.lang == "python":
        return [Job("python", (block.code,), LOCAL_URL in block.code)]
    return [job_of(line, block.smaller) for line in commands(block.code)]


def same_cli(a: Job, b: Job) -> bool:
    """Two ds4-torch commands that parse to the same arguments run once."""
    from ds4_torch.cli import build_parser

    if a.kind != b.kind:
        return False
    if a.kind != "cli":
        return a.args == b.args

    def parsed(job):
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                return {k: v for k, v in vars(build_parser().parse_args(list(job.args))).items() if k != "func"}
            except SystemExit:
                return job.args
    return parsed(a) == parsed(b)


def without_port(args: tuple) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--port":
            skip = True
        elif not a.startswith("--port="):
            out.append(a)
    return out


# --------------------------------------------------------------------------- comparing output
NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
MACHINE = re.compile(r"[^;,]+, \d+ cores, \w+")  # bench.report.machine(): "AMD EPYC, 2 cores, AVX512"
ALWAYS = [  # what differs between any two runs: log timestamps, process ids, ports, scratch paths
    (re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ "), ""),
    (re.compile(r"(process |\[)\d+"), r"\1PID"),
    (re.compile(r"(127\.0\.0\.1|localhost):\d+"), r"\1:PORT"),
    (re.compile(r"/tmp/[\w./-]+"), "/tmp/PATH"),
]


PROGRESS = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\|\s*\d+/\d+ \[")  # a tqdm bar: "desc: 40%|####  | 2/5 [00:01<..."


def terminal_lines(text: str) -> list[str]:
    """The lines a terminal shows at the end: a carriage return rewrites its line; progress bars
    are not compared."""
    lines = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]
    return [line for line in lines if line.strip() and not PROGRESS.search(line)]


def normalize(line: str, numbers_vary: bool) -> str:
    for pattern, repl in ALWAYS:
        line = pattern.sub(repl, line)
    if numbers_vary:
        line = MACHINE.sub(" MACHINE", line)
        line = NUMBER.sub("N", line)
    return " ".join(line.split())


def compare_output(shown: str, printed: str, *, numbers_vary: bool, smaller: bool) -> list[str]:
    """What is wrong with the page's output `shown` against what the command `printed` (empty: nothing)."""
    def lines(text):  # a run of lines the same but for their numbers counts once
        out = [normalize(line, numbers_vary) for line in terminal_lines(text)]
        return [line for i, line in enumerate(out) if i == 0 or line != out[i - 1]]
    page, got = lines(shown), lines(printed)
    if "..." in page:
        at, missing = 0, []
        for line in (x for x in page if x != "..."):
            try:
                at = got.index(line, at) + 1
            except ValueError:
                missing.append(line)
        return [f"shown but not printed (in this order): {line!r}" for line in missing]
    if smaller:
        return [f"printed but not shown: {line!r}" for line in dict.fromkeys(got) if line not in page]
    if page != got:
        return [f"the page shows:\n{shown}\nit printed:\n{printed}"]
    return []


# --------------------------------------------------------------------------- running
def child_env(home: Path) -> dict:
    """The environment the pages' commands run in: scratch HOME, one thread, no network."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DS4_TORCH_FAULT")}
    dead = "http://127.0.0.1:9"
    env.update({"HOME": str(home), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "DS4_TORCH_CACHE": os.environ.get("DS4_TORCH_CACHE", str(Path.home() / ".cache" / "ds4_torch")),
                "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        env[name] = env[name.upper()] = dead
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def scratch(tmp: Path) -> Path:
    """A directory with links to the repository's folders: the pages' relative paths resolve, and
    what the commands write stays out of the repository."""
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "tests", "ds4_torch", "serve", "docs", "README.md", "pyproject.toml"):
        if not (tmp / name).exists():
            (tmp / name).symlink_to(ROOT / name)
    return tmp


def run_jobs(jobs: list[dict]) -> list[dict]:
    """In the runner process: each job with its stdout and stderr captured."""
    results = []
    for job in jobs:
        out, err = io.StringIO(), io.StringIO()
        start, rc, error = time.perf_counter(), 0, ""
        argv0 = sys.argv
        if job.get("server"):  # the plain server the test started: up before the job runs
            import httpx

            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(job["server"] + "/health", timeout=5).status_code == 200:
                        break
                time.sleep(0.2)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    if job["kind"] == "cli":
                        from ds4_torch.cli import main

                        rc = main(list(job["args"]))
                    elif job["kind"] == "script":
                        import runpy

                        sys.argv = list(job["args"])
                        runpy.run_path(job["args"][0], run_name="__main__")
                    elif job["kind"] == "python":
                        exec(compile(job["args"][0], job["where"], "exec"), {"__name__": "__main__"})
                    else:
                        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", job["args"][0]], capture_output=True,
                                              text=True, timeout=600)
                        rc = proc.returncode
                        print(proc.stdout, end="")
                        print(proc.stderr, end="", file=sys.stderr)
                except SystemExit as e:
                    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if not isinstance(e.code, int) and e.code is not None:
                        print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - the block failed: its traceback is the report
            rc, error = 1, traceback.format_exc()
        finally:
            sys.argv = argv0
        results.append({"rc": rc or 0, "out": out.getvalue(), "err": err.getvalue() + error,
                        "seconds": time.perf_counter() - start})
    return results


@dataclass
class Ran:
    rc: int
    out: str
    err: str
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `ds4-torch serve` command of a page, on a free port; `stop()` is Ctrl-C."""

    def __init__(self, args: list[str], env: dict, cwd: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start = time.perf_counter()
        self.log = cwd / f"serve-{self.port}.log"
        args = [str(cwd) + a[1:] if a.startswith("~/") else a for a in args]  # (HOME is cwd, as a shell expands it)
        self.proc = subprocess.Popen([sys.executable, "-m", "serve", *args, "--port", str(self.port)], cwd=cwd,
                                     env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT, text=True)
        self.healthy_log = None

    def wait_healthy(self, timeout: float = 300) -> bool:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    self.healthy_log = self.log.read_text()
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def stop(self) -> Ran:
        import signal

        healthy = self.healthy_log is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        log = self.log.read_text()
        if not healthy:
            rc = rc or 1
            log += "\n(it never answered /health)"
        return Ran(rc, self.healthy_log or "", log, time.perf_counter() - self.start)


@lru_cache(maxsize=None)
def run_everything(tmp: Path) -> tuple[dict, float]:
    """Every runnable block's results: {(page, line): [Ran per command]}, and the wall seconds."""
    start = time.perf_counter()
    home = scratch(tmp)
    env = child_env(home)
    blocks = [b for b in all_blocks() if not b.needs and not b.problems]
    plan: list[tuple[Block, Job]] = [(b, j) for b in blocks for j in jobs_of(b)]
    # One plain server for blocks naming http://127.0.0.1:8000 (the first plain `ds4-torch serve` of the pages).
    unique: list[Job] = []
    for _, job in plan:
        if job.kind not in ("serve",) and not any(same_cli(job, u) for u in unique):
            unique.append(job)
    servers = {}
    plain = Server([], env, home)
    servers[()] = plain
    jobs_file, results_file = home / "jobs.json", home / "results.json"
    jobs_file.write_text(json.dumps([
        {"kind": j.kind, "where": next(b.where for b, k in plan if k is j),
         "server": plain.url if j.needs_server else None,
         "args": [a.replace(LOCAL_URL, plain.url) for a in j.args]} for j in unique]))
    runner = subprocess.Popen([sys.executable, __file__, "--run", str(jobs_file), str(results_file)], cwd=home,
                              env=env, stdout=(home / "runner.log").open("w"), stderr=subprocess.STDOUT)
    served: dict[tuple, Ran] = {}
    for _, job in plan:  # the pages' servers, while the runner runs
        if job.kind == "serve" and tuple(without_port(job.args)) not in served:
            key = tuple(without_port(job.args))
            srv = servers.get(key) or Server(list(key), env, home)
            servers[key] = srv
            if srv is not plain:
                srv.wait_healthy()
                served[key] = srv.stop()
    runner.wait()
    plain.wait_healthy(timeout=1)
    served[()] = plain.stop()
    try:
        raw = json.loads(results_file.read_text())
    except (OSError, ValueError):
        died = {"rc": 1, "out": "", "err": "the runner died:\n" + (home / "runner.log").read_text(), "seconds": 0}
        raw = [died] * len(unique)
    ran = {id(u): Ran(**r) for u, r in zip(unique, raw)}
    results: dict[tuple, list[Ran]] = {}
    for block, job in plan:
        if job.kind == "serve":
            r = served[tuple(without_port(job.args))]
        else:
            r = ran[id(next(u for u in unique if same_cli(job, u)))]
        results.setdefault((str(block.page), block.line), []).append(r)
    return results, time.perf_counter() - start


# --------------------------------------------------------------------------- tests
def runnable() -> list[Block]:
    return [b for b in all_blocks() if not b.needs and not b.problems and b.lang in RUNNABLE]


def test_the_markers_name_known_reasons_and_the_pages_say_them():
    problems = [p for b in all_blocks() for p in b.problems]
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def everything(tmp_path_factory):
    return run_everything(tmp_path_factory.mktemp("docs"))


@pytest.mark.parametrize("block", runnable(), ids=lambda b: b.where)
def test_the_block_runs_and_prints_what_the_page_shows(block, everything):
    results, _ = everything
    problems = []
    for job, r in zip(jobs_of(block), results[(str(block.page), block.line)]):
        what = shlex.join(job.args) if job.kind != "python" else "the Python block"
        if r.rc != 0:
            problems.append(f"{block.where}: {job.kind} {what} exited with {r.rc}:\n{r.err[-3000:]}\n{r.out[-2000:]}")
    if not problems and block.output is not None:
        printed = "".join(r.out for r in results[(str(block.page), block.line)])
        problems += [f"{block.where}: {p}" for p in compare_output(
            block.output.text, printed, numbers_vary=block.output.numbers_vary, smaller=bool(block.smaller))]
    assert not problems, "\n".join(problems)


def test_the_readme_python_prints_text_in_a_fresh_process_offline(everything):
    """README's Python block, as written: the first thing the runner process runs (so it starts as
    a fresh interpreter would, from a scratch directory, with no network), it prints the reply."""
    results, _ = everything
    readme = next(b for b in runnable() if b.page.name == "README.md" and b.lang == "python")
    (r,) = results[(str(readme.page), readme.line)]
    first = next(b for b in runnable() if any(j.kind not in ("serve",) for j in jobs_of(b)))
    assert first is readme, f"{first.where} runs before README's Python block"
    assert r.rc == 0 and r.out.strip() and r.out.endswith("\n"), (r.out, r.err[-2000:])


def test_the_markers_are_checked():
    """On text written here: an unknown reason, a reason the page does not say, a block with
    smaller arguments on a page that does not say so, and outputs compared as the docstring says."""
    page = Path("page.md")
    text = ("# Title\n\nRun it on a GPU:\n\n<!-- test: needs gpu -->\n```sh\nds4-torch generate -p x\n```\n\n"
            "Another one:\n\n<!-- test: needs checkpoint -->\n```sh\nds4-torch generate -p x\n```\n\n"
            "<!-- test: needs wifi -->\n```python\nprint(1)\n```\n\n"
            "<!-- test: smaller --repeats 1 -->\n```sh\nds4-torch bench model\n```\n<!-- test: numbers vary -->\n"
            "```\nbench model: 5 runs\n```\n")
    blocks = parse_page(text, page)
    assert [b.needs for b in blocks] == [["gpu"], ["checkpoint"], ["wifi"], []]
    problems = [p for b in blocks for p in b.problems]
    assert any("needs checkpoint, but the text before it does not say so" in p for p in problems), problems
    assert any("unknown reason 'wifi'" in p for p in problems), problems
    assert any("smaller arguments" in p for p in problems) and any("numbers vary" in p for p in problems), problems
    assert not blocks[0].problems
    assert blocks[3].smaller == ["--repeats", "1"] and blocks[3].output.numbers_vary
    assert job_of(".venv/bin/ds4-torch serve --port 8000 --ctx 9", []) == Job("serve", ("--port", "8000", "--ctx", "9"))
    assert without_port(("--port", "8000", "--ctx", "9")) == ["--ctx", "9"]
    assert job_of("python examples/x.py --url http://127.0.0.1:8000", []).needs_server
    # outputs
    assert compare_output("a 1.5x\nb", "a 2.0x\nb", numbers_vary=True, smaller=False) == []
    assert compare_output("a 1.5x\nb", "a 2.0x\nb", numbers_vary=False, smaller=False)
    assert compare_output("x; AMD EPYC, 2 cores, AVX512", "x; Intel(R) Xeon(R), 16 cores, AVX2", numbers_vary=True,
                          smaller=False) == []
    assert compare_output("h\n1 CSA\n2 HCA\n3 CSA", "h\n9 CSA", numbers_vary=True, smaller=True) == []
    assert compare_output("h\n1 CSA", "h\n9 MLA", numbers_vary=True, smaller=True)
    assert compare_output("...\nlast line", "first\nlast line", numbers_vary=False, smaller=False) == []
    assert compare_output("...\nlast line", "first\nother", numbers_vary=False, smaller=False)
    bar = "run: 40%|####  | 2/5 [00:01<00:02]\rrun: 100%|#####| 5/5 [00:03<00:00]"
    assert terminal_lines(f"a\rb\n{bar}\nc") == ["b", "c"]
    assert normalize("2026-11-28 12:16:52,769 INFO ds4.serve: engine core: process 24211", False) == \
        "INFO ds4.serve: engine core: process PID"


if __name__ == "__main__" and sys.argv[1:2] == ["--run"]:
    jobs = json.loads(Path(sys.argv[2]).read_text())
    Path(sys.argv[3]).write_text(json.dumps(run_jobs(jobs)))


# --------------------------------------------------------------------------- sentences the pages must keep true
def section(page: str, heading: str) -> str:
    """The text of a page's section, from its heading to the next heading of the same or a higher level."""
    text = (ROOT / page).read_text()
    m = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert m, f"{page} has no section {heading!r}"
    end = re.compile(rf"^#{{1,{len(m.group(1))}}} ", re.M).search(text, m.end())
    return text[m.end():end.start() if end else len(text)]


def test_the_responses_stream_sends_only_the_events_the_serving_page_lists():
    """A text reply streamed through /v1/responses and cut by max_output_tokens: every event type
    it sends is one the serving page's Responses section names."""
    import httpx

    from helpers import MODEL, server

    listed = set(re.findall(r"`(response\.[\w.]+)`", section("docs/serving.md", "Responses")))
    listed |= {name.removesuffix(".delta") + ".done" for name in listed if name.endswith(".delta")}  # "and their .done"
    with server(ctx=256) as srv, httpx.stream("POST", srv.url + "/v1/responses", json={
            "model": MODEL, "input": "To be, or not to be", "max_output_tokens": 2, "temperature": 0,
            "stream": True}) as r:
        sent = [json.loads(line[5:])["type"] for line in r.iter_lines() if line.startswith("data:")]
    assert sent[-1] == "response.incomplete" and "response.output_text.delta" in sent, sent
    assert set(sent) <= listed, f"sent but not listed: {sorted(set(sent) - listed)}"


def test_every_benchmark_the_pages_run_says_what_it_will_do_then_shows_progress(everything):
    """Each `ds4-torch bench` command the pages run names itself and its settings on stderr before
    it measures anything, and shows a progress bar there (tqdm): nothing is silent for minutes."""
    results, _ = everything
    problems = []
    for block in runnable():
        for job, r in zip(jobs_of(block), results[(str(block.page), block.line)]):
            if job.kind == "cli" and job.args[0] == "bench":
                first = (terminal_lines(r.err) or [""])[0]
                if not first.startswith(f"ds4-torch bench {job.args[1]}: "):
                    problems.append(f"{block.where}: its first line on stderr is {first!r}")
                if not PROGRESS.search(r.err):
                    problems.append(f"{block.where}: no progress bar on stderr:\n{r.err[-1000:]}")
    assert not problems, "\n".join(problems)


def units(text: str) -> list[str]:
    """A page's paragraphs and table rows (list items count as paragraphs): what a sentence belongs to."""
    out, para = [], []
    for line in text.splitlines() + [""]:
        if line.lstrip().startswith("|") or not line.strip() or re.match(r"\s*[-*] ", line):
            if para:
                out.append(" ".join(para))
                para = []
            if line.lstrip().startswith("|"):
                out.append(line)
            elif line.strip():
                para.append(line)
        else:
            para.append(line)
    return out


def test_the_pages_give_ctx_its_default_as_serve_does():
    """`--ctx`'s default is the model's maximum, at most what the KV pool holds for one request
    (the flag's --help; the serving page shows the start-up log that says so): every paragraph or
    table row of the pages that gives that default says it the same way."""
    from serve.cli import build_parser

    pool = r"what the (KV )?pool holds for one request"
    help_text = next(a.help for a in build_parser()._actions if "--ctx" in a.option_strings)
    assert re.search(pool, help_text), help_text
    gives_default = r"`--ctx( N)?`[^.|]{0,60}(\| )?[^.|]{0,40}\bdefault"
    wrong = [f"{page.relative_to(ROOT)}: {unit.strip()[:200]}" for page in doc_files()
             for unit in units(page.read_text()) if re.search(gives_default, unit) and not re.search(pool, unit)]
    assert not wrong, "these give --ctx's default otherwise:\n" + "\n".join(wrong)


def test_the_kv_cache_page_names_the_flag_that_sets_the_servers_row_format():
    """The section on row formats says which `ds4-torch serve` flag chooses the pool's format,
    and its choices are the library's formats."""
    from ds4_torch.kv_format import KV_ROW_FORMATS
    from serve.cli import build_parser

    flag = next(a for a in build_parser()._actions if "--kv-dtype" in a.option_strings)
    assert tuple(flag.choices) == tuple(KV_ROW_FORMATS)
    text = section("docs/kv-cache.md", "Bytes per token and fp8 rows")
    assert "`--kv-dtype`" in text and all(f"`{name}`" in text for name in KV_ROW_FORMATS)


def test_every_page_naming_a_long_command_says_how_long_it_takes():
    """The commands that take minutes as written: wherever a page names one (a paragraph, a table
    row or the text around its block), it says so."""
    long = ["bench serve --scenario agents"]
    silent = []
    for page in doc_files():
        text = page.read_text()
        for unit in units(text):
            for command in long:
                if command in unit and "```" not in unit and not re.search(r"\bminutes?\b", unit):
                    silent.append(f"{page.relative_to(ROOT)}: {unit.strip()[:160]}")
    assert not silent, "these name a command that takes minutes and do not say so:\n" + "\n".join(silent)
