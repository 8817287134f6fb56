"""lmcache_mp/bench's shape: its modules import each other one way (no cycle), and none is
over 600 lines or has a function over 60."""

from __future__ import annotations

import ast
from pathlib import Path

import lmcache_mp.bench

BENCH = Path(lmcache_mp.bench.__file__).parent


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in BENCH.rglob("*.py"):
        parts = path.relative_to(BENCH.parent.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The bench modules `name` imports, at any depth of its code."""
    package = name if name in known and any(k.startswith(name + ".") for k in known) \
        else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = (f"{base}.{node.module}" if node.module else base) if node.level \
                else node.module or ""
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known
                          else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & known - {name}


def test_no_import_cycle():
    trees = modules()
    known = set(trees)
    graph = {name: imports(name, tree, known) for name, tree in trees.items()}
    # Packages import nothing of their own here: their modules are the nodes.
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            assert state.get(other) != 1, " -> ".join([*path, name, other])
            if other not in state:
                visit(other, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_modules_and_functions_stay_readable():
    for name, tree in modules().items():
        lines = (tree.body[-1].end_lineno or 0) if tree.body else 0
        assert lines <= 600, f"{name}: {lines} lines"
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                assert length <= 60, f"{name}.{node.name}: {length} lines"
