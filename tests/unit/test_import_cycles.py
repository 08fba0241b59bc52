"""No file-level import circles in trainctl: module A imports B (at the top or lazily inside a function) and B,
directly or through others, imports A.

A package-level check (tests/unit/test_layering.py) cannot see a circle between two files of one package, nor one
hidden in a lazy import; this reads every file with ast (nothing is imported) and names each circle it finds.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "trainctl"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts}


def _imported(tree: ast.AST, module: str, is_init: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in one file, lazy ones included; `from a import b` gives `a.b`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts[: len(parts) - node.level + (1 if is_init else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def file_edges(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {module of trainctl it imports: first line}; `from pkg import name` counts as importing the module
    pkg.name when that is a file, else pkg itself."""
    known = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        for name, line in _imported(tree, module, path.name == "__init__.py"):
            target = resolve(name)
            if target is not None and target != module:
                edges.setdefault(module, {}).setdefault(target, line)
    return edges


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each as one circle through all of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, {})):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(_circle_through(sorted(group), edges))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _circle_through(group: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """A shortest circle from the group's first module back to itself, inside the group (what to read first)."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(edges.get(node, {})):
                if nxt == start:
                    return paths[node] + [start]
                if nxt in members and nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return group + [start]


def describe(circle: list[str], edges: dict[str, dict[str, int]]) -> str:
    """`a (a.py:12) -> b (b.py:3) -> a`: each step with the line that makes it."""
    steps = [f"{a} (line {edges[a][b]})" for a, b in zip(circle, circle[1:], strict=False)]
    return " -> ".join(steps + [circle[-1]])


def test_the_finder_sees_lazy_and_relative_imports_and_names_the_circle(tmp_path):
    pkg = tmp_path / "trainctl"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from trainctl.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import c\n")  # lazy and relative
    (pkg / "sub" / "c.py").write_text("import trainctl.a\n")
    (pkg / "d.py").write_text("from trainctl import a\n")  # into the circle, not part of it
    edges = file_edges(pkg)
    assert edges["trainctl.sub.b"] == {"trainctl.sub.c": 2}
    found = circles(edges)
    assert found == [["trainctl.a", "trainctl.sub.b", "trainctl.sub.c", "trainctl.a"]]
    assert describe(found[0], edges) == ("trainctl.a (line 1) -> trainctl.sub.b (line 2) -> trainctl.sub.c (line 1)"
                                         " -> trainctl.a")
    (pkg / "sub" / "c.py").write_text("")
    assert circles(file_edges(pkg)) == []


@functools.cache
def _tree_edges() -> dict[str, dict[str, int]]:
    return file_edges()


def test_the_finder_reads_the_real_tree():
    edges = _tree_edges()
    # Known one-way imports: if these vanish the parser is broken, and the check below would pass vacuously.
    assert "trainctl.launch.backends.base" in edges["trainctl.launch.backends"]
    assert "trainctl.api.tuning_queued" in edges["trainctl.api.tuning"]


def test_no_file_level_import_circles():
    edges = _tree_edges()
    found = [describe(c, edges) for c in circles(edges)]
    assert found == []
