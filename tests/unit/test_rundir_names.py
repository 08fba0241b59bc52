"""core/rundir is the only code that names a run-directory file: everything else uses its constants.

A file name restated elsewhere drifts (one side renames it, the other still reads the old name: a run that
looks unfinished, a lock nobody holds). Read from the source with ast: every string literal outside core/rundir,
f-string parts included, docstrings excluded.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from trainctl.core import rundir

ROOT = Path(__file__).resolve().parents[2] / "trainctl"
# Literals that are the same text but not a run-directory file, and restatements in another slice's files that
# its owner routes through rundir (issue 25: cli.py is the api slice's, config/schema.py the opt slice's).
ALLOWED = {
    ("trainctl/config/sources.py", "config.yaml"),  # the primary file of a config folder (conf/), not a run's
}


def run_dir_names() -> set[str]:
    """The file names rundir declares (those with an extension: "wandb_id" is also a checkpoint field)."""
    values = [v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str)]
    return {Path(v).name for v in values if re.fullmatch(r"[\w./-]+\.[a-z]+", v)}


def docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def restated(path: Path, names: set[str]) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    skip = docstrings(tree)
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, sorted(names))) + r")(?![\w-])")
    return [(node.lineno, m.group(1)) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            for m in pattern.finditer(node.value)]


def test_rundir_declares_the_files_it_documents():
    assert {"config.yaml", "plan.json", "launch.sh", "launch.json", "trainer.lock", "metrics.jsonl", "result.json",
            "progress.json", "stopped.json", "error.json"} <= run_dir_names()


def test_no_module_outside_core_rundir_names_a_run_directory_file():
    names = run_dir_names()
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT.parent))
        if rel == "trainctl/core/rundir.py":
            continue
        found += [f"{rel}:{line}: {name!r}" for line, name in restated(path, names) if (rel, name) not in ALLOWED]
    assert found == [], "use the constant of trainctl.core.rundir instead:\n" + "\n".join(found)
