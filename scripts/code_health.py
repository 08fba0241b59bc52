#!/usr/bin/env python3
"""Code-shape figures of the package, for issue notes and reviews: no imports of the package, only its text.

    python scripts/code_health.py [ROOT] [--json]

Prints the longest functions, `train_loop`'s length, lines over 120 columns, package-level import
cycles (and imports against the layer order), test hooks left in the product, and modules over 400 lines.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

PACKAGE = "trainctl"
WIDTH = 120
MODULE_LINES = 400
# The launcher side's layer order: a package may import only packages to its right.
LAYERS = ("cli", "runs", "launch", "plan", "config", "core")
HOOK_PATTERN = re.compile(r"TRAINCTL_TEST_|def inject_|^\s+inject_\w+: ")  # test env vars, injectors, config keys


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts)


# The torch-free part of models/ (the family registry and each family's spec.py) is a layer of its own, "specs",
# below config; the rest of models/ is the worker's (as tests/unit/test_layering.py draws the layers).
SPEC_MODULES = re.compile(r"^models\.(registry|[a-z0-9_]+\.spec)$")


def layer_of(parts: tuple[str, ...]) -> str:
    """The package a module (its parts below trainctl) counts as: plan.memory -> plan, models.llama.spec -> specs."""
    return "specs" if SPEC_MODULES.match(".".join(parts)) else parts[0]


def package_of(path: Path, root: Path) -> str:
    """The first-level package (or top-level module) a file belongs to: trainctl/plan/x.py -> plan."""
    parts = path.relative_to(root / PACKAGE).with_suffix("").parts
    return layer_of(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def functions(tree: ast.AST, where: str) -> list[tuple[int, str]]:
    return [(node.end_lineno - node.lineno + 1, f"{where}:{node.name}")
            for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def imported_packages(tree: ast.AST, own: str, module_parts: tuple[str, ...], root: Path | None = None) -> set[str]:
    """First-level packages of trainctl this module imports (absolute or relative), other than its own.

    `from trainctl.models import registry` imports the module trainctl.models.registry (where `root` shows that
    trainctl/models is a package), not the package trainctl.models."""
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join((PACKAGE, *module_parts[: len(module_parts) - node.level], *filter(None, [base])))
            names = [f"{base}.{alias.name}" for alias in node.names] if _is_package(root, base) else [base]
        for name in names:
            parts = tuple(name.split("."))
            if parts[0] == PACKAGE and len(parts) > 1 and layer_of(parts[1:]) != own:
                found.add(layer_of(parts[1:]))
    return found


def _is_package(root: Path | None, module: str) -> bool:
    return root is not None and (root / module.replace(".", "/") / "__init__.py").is_file()


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every package that can reach itself, as one path back to it (deduplicated by member set)."""
    seen, found = set(), []
    for start in sorted(edges):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    key = frozenset(path)
                    if key not in seen:
                        seen.add(key)
                        found.append([*path, start])
                elif nxt not in path:
                    stack.append((nxt, [*path, nxt]))
    return found


def against_layers(edges: dict[str, set[str]]) -> list[str]:
    order = {name: index for index, name in enumerate(LAYERS)}
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if a in order and b in order and order[b] < order[a])


def measure(root: Path) -> dict:
    funcs, edges, wide, hooks, big = [], {}, 0, [], []
    for path in python_files(root):
        text = path.read_text()
        rel = path.relative_to(root)
        tree = ast.parse(text)
        funcs += functions(tree, str(rel))
        module_parts = path.relative_to(root / PACKAGE).with_suffix("").parts[:-1] + ("_",)
        own = package_of(path, root)
        edges.setdefault(own, set()).update(imported_packages(tree, own, module_parts, root))
        lines = text.splitlines()
        wide += sum(len(line) > WIDTH for line in lines)
        hooks += [f"{rel}:{number}" for number, line in enumerate(lines, 1) if HOOK_PATTERN.search(line)]
        if len(lines) > MODULE_LINES:
            big.append(f"{rel} ({len(lines)})")
    funcs.sort(key=lambda item: (-item[0], item[1]))
    return {
        "files": len(python_files(root)),
        "functions": len(funcs),
        "longest_functions": [f"{name} ({length})" for length, name in funcs[:5]],
        "train_loop_lines": next((length for length, name in funcs if name.endswith(":train_loop")), None),
        "lines_over_120": wide,
        "package_cycles": [" -> ".join(cycle) for cycle in cycles(edges)],
        "imports_against_layers": against_layers(edges),
        "test_hooks": hooks,
        "modules_over_400_lines": big,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    figures = measure(Path(args.root))
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for key, value in figures.items():
            print(f"{key}: {', '.join(map(str, value)) if isinstance(value, list) else value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
