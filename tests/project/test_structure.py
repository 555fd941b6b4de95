"""The shape of the code base: the library imports nothing above it, and no module imports
another that (directly or not) imports it back.

Read from the source with `ast` (imports inside functions count too: a lazy import is still a
dependency), so nothing is imported to check it.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ds4_torch", "serve")
# What sits on top of the library: the command line, the benchmarks, the server.
ABOVE_LIBRARY = ("ds4_torch.cli", "ds4_torch.__main__", "ds4_torch.bench", "serve")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports (absolute and relative, at any depth in the file)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            # `from pkg import sub` imports the submodule pkg.sub when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a non-module attribute path
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def is_above(name: str) -> bool:
    return any(name == a or name.startswith(a + ".") for a in ABOVE_LIBRARY)


def test_the_graph_sees_real_imports():
    g = graph()
    assert "ds4_torch.cache" in g["ds4_torch.model"]
    assert "ds4_torch.runtime" in g["serve.cli"]
    assert "serve.engine.sequence" in g["serve.engine.loop"]  # a relative import inside a room
    assert "ds4_torch.kernels.ops" in g["ds4_torch.kernels"]


def test_library_imports_nothing_above_it():
    bad = {(m, t) for m, targets in graph().items() if not is_above(m) for t in targets if is_above(t)}
    assert not bad, f"library modules importing the CLI, the benchmarks or the server: {sorted(bad)}"


def test_no_import_cycles():
    g = graph()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(g[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# The server's rooms, lowest first: a room imports only rooms below it (and the shared modules
# beside them); the entry points on top may import any room.
ROOMS = ("serve.kvstore", "serve.engine", "serve.http", "serve.core")
SHARED = ("serve.errors", "serve.metrics")  # import no room
ENTRY = ("serve", "serve.cli", "serve.__main__", "serve.background")


def room_of(name: str) -> str | None:
    return next((r for r in ROOMS if name == r or name.startswith(r + ".")), None)


def test_rooms_import_downwards():
    g = graph()
    bad = []
    for name, targets in g.items():
        if not name.startswith("serve"):
            continue
        for target in (t for t in targets if t.startswith("serve")):
            if target in SHARED or room_of(target) is None and target not in ENTRY:
                continue
            if name in SHARED:
                bad.append((name, target))
            elif name in ENTRY:
                continue
            elif target in ENTRY or ROOMS.index(room_of(target)) > ROOMS.index(room_of(name)):
                bad.append((name, target))
    assert not bad, f"imports pointing up (or from a shared module into a room): {sorted(bad)}"


def test_serve_top_level_is_small():
    """The tree says where things are: the top of serve/ holds the rooms and a few modules."""
    top = sorted(p.name for p in (ROOT / "serve").glob("*.py"))
    assert set(top) == {"__init__.py", "__main__.py", "cli.py", "background.py", "errors.py", "metrics.py"}, top
    assert {p.name for p in (ROOT / "serve").iterdir() if p.is_dir() and p.name != "__pycache__"} == \
        {r.removeprefix("serve.") for r in ROOMS}


# The engine's parts: each imports serve.engine.sequence (the one type they share) and lower modules,
# never another part or anything above them; the engine loop imports them all.
ENGINE_PARTS = tuple(f"serve.engine.{p}" for p in ("scheduler", "sessions", "runner", "output", "admission",
                                                    "decoding", "inflight", "recovery"))
SEQUENCE = "serve.engine.sequence"
LOOP = "serve.engine.loop"


def reaches(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in g[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_engine_parts_share_only_the_sequence():
    g = graph()
    above = {m for m in g if room_of(m) in ("serve.http", "serve.core") or m in ENTRY} | {LOOP}
    for part in ENGINE_PARTS:
        below = reaches(g, part)
        assert SEQUENCE in g[part], part
        others = ({p for p in ENGINE_PARTS if p != part} | above) & below
        assert not others, f"{part} imports {sorted(others)}"
    assert set(ENGINE_PARTS) <= g[LOOP]
    # The runner is the part that touches tensors: the scheduler, the output part and the sequence
    # do not import the model, the cache or the decoder.
    for part in ("serve.engine.scheduler", "serve.engine.output", SEQUENCE):
        assert not {"ds4_torch.model", "ds4_torch.cache", "ds4_torch.decode"} & reaches(g, part), part
