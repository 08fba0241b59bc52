"""Each launcher backend is one folder, trainctl/launch/backends/<kind>/, and nothing outside it knows it:
no module elsewhere imports the folder's modules, and none compares a value with a backend's name (or with
`cluster.launcher`) to decide what to do. Everything else asks the interface (launch/backends/base.py) through the
registry (`backends.for_cluster`, `for_record`, `named`, `every`). Read with ast, nothing imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_import_cycles import ROOT, file_edges, module_name, modules

BACKENDS = ROOT / "launch" / "backends"
PREFIX = "trainctl.launch.backends."


def kinds(backends_dir: Path = BACKENDS) -> list[str]:
    """The backends: every folder of launch/backends/ that is a package."""
    return sorted(p.parent.name for p in backends_dir.glob("*/__init__.py"))


def owner(module: str) -> str | None:
    """The backend whose folder holds `module`, None for a module outside every backend's folder."""
    return module[len(PREFIX):].split(".")[0] if module.startswith(PREFIX) else None


def foreign_imports(edges: dict[str, dict[str, int]], names: list[str]) -> list[str]:
    """'module:line -> imported' for each import of a backend's folder from outside it."""
    found = []
    for source, targets in sorted(edges.items()):
        for target, line in sorted(targets.items()):
            kind = owner(target)
            if kind in names and owner(source) != kind:
                found.append(f"{source}:{line} -> {target}")
    return found


def _strings(node: ast.AST) -> list[str]:
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def _is_launcher(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "launcher") or (
        isinstance(node, ast.Name) and node.id == "launcher")


def _is_own_name(node: ast.AST) -> bool:
    # A typed config checking its `launcher` against its own NAME asks nothing about the backend in use.
    return isinstance(node, ast.Attribute) and node.attr == "NAME"


def name_tests(source: str, names: list[str]) -> list[int]:
    """Lines comparing with a backend's name (`== "slurm"`, `in ("local", ...)`, a match case) or with `launcher`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(s in names for o in operands for s in _strings(o)):
                found.append(node.lineno)
            elif any(_is_launcher(o) for o in operands) and not any(_is_own_name(o) for o in operands):
                found.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and any(s in names for s in _strings(node.value)):
            found.append(node.lineno)
    return sorted(set(found))


def test_the_finders_find_what_they_must(tmp_path):
    names = ["local", "slurm"]
    source = "\n".join([
        'if c.launcher == "slurm": pass',
        "if 'local' != k: pass",
        'if name in ("slurm", "x"): pass',
        "if launcher != y: pass",
        "if x == cfg.cluster.launcher: pass",
        'name = "slurm"',  # naming is not deciding
        "if self.launcher != self.NAME: pass",
        'match k:\n    case "slurm": pass',
        'print("use cluster=slurm")',
    ])
    assert name_tests(source, names) == [1, 2, 3, 4, 5, 9]
    edges = {"trainctl.api.x": {"trainctl.launch.backends.slurm.jobs": 3, "trainctl.launch.backends": 4},
             "trainctl.launch.backends.slurm": {"trainctl.launch.backends.slurm.jobs": 1},
             "trainctl.launch.backends.local.state": {"trainctl.launch.backends.slurm": 7}}
    assert foreign_imports(edges, names) == ["trainctl.api.x:3 -> trainctl.launch.backends.slurm.jobs",
                                             "trainctl.launch.backends.local.state:7 -> trainctl.launch.backends.slurm"]
    (tmp_path / "k8s").mkdir()
    (tmp_path / "k8s" / "__init__.py").write_text("")
    (tmp_path / "base.py").write_text("")
    assert kinds(tmp_path) == ["k8s"]


def test_the_built_in_backends_are_folders_the_registry_finds():
    from trainctl.launch import backends

    assert {"local", "slurm"} <= set(kinds())
    assert {b.name for b in backends.every()} == set(kinds())
    assert not [p.name for p in BACKENDS.glob("*.py") if p.stem not in ("__init__", "base")]  # no loose backend files


def test_no_module_outside_a_backends_folder_imports_it():
    """Another backend's folder included: local never reaches into slurm's modules, nor slurm into local's."""
    assert foreign_imports(file_edges(), kinds()) == []


def test_no_module_outside_a_backends_folder_asks_which_backend_it_is():
    names = kinds()
    found = [f"{module_name(path)}:{line}" for module, path in modules().items() if owner(module) is None
             for line in name_tests(path.read_text(), names)]
    assert found == []


def called_methods(source: str) -> set[str]:
    """The names called as methods (`x.name(...)`) in `source`."""
    return {node.func.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}


def test_every_method_of_the_interface_has_a_caller():
    """A method no module calls is a promise nothing keeps (Backend.requeue was one: requeueing happens inside the
    job, by rank 0 and the batch script, never from the launcher)."""
    import inspect

    from trainctl.launch.backends.base import Backend

    assert called_methods("b.cancel(run_dir, job)\nb.name\nf(x)") == {"cancel"}
    interface = {name for name, member in inspect.getmembers(Backend, inspect.isfunction) if not name.startswith("_")}
    called = set().union(*(called_methods(path.read_text()) for path in modules().values()
                           if path != BACKENDS / "base.py"))
    assert sorted(interface - called) == []
