"""Packages depend one way: core <- data <- specs <- config <- plan <- launch <- api <- render <- cli_tools <- cli;
the worker (train, models) on the left.

`specs` is the torch-free part of models/ that the launcher side may import: the family registry
(models/registry.py), the shared decoder's shape (models/common/shape.py, moe_shape.py) and each family's
models/<family>/spec.py;
the rest of models/ is the worker's. docs/design.md draws these tuples (a test below keeps it equal).

Read from the source with ast (nothing is imported), lazy imports inside functions included: a package-level
import cycle, or an import against the direction, fails with the module and the line that makes it.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "trainctl"
# The launcher side, lowest first: a package imports only its own layer and those before it.
LAUNCHER = ("core", "data", "specs", "config", "plan", "launch", "runs", "api", "render", "cli_tools", "cli")
# The worker side imports these launcher packages (their torch-free parts), never launch, render or cli.
WORKER = {"train": ("core", "data", "specs", "config", "models", "train"),
          "models": ("core", "data", "specs", "config", "models")}
SPEC_MODULES = re.compile(r"^trainctl\.models\.(registry|common\.shape|common\.moe_shape|[a-z0-9_]+\.spec)$")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str | None:
    """`trainctl.plan.memory` -> plan, `trainctl.cli` -> cli, `trainctl.models.llama.spec` -> specs; None for the
    root package."""
    if SPEC_MODULES.match(module):
        return "specs"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "trainctl" else None


@functools.cache  # the tree does not change during a session; each module is parsed once, not once per test
def imported_modules(path: Path) -> tuple[tuple[str, int], ...]:
    """(absolute module name, line) of every import in one file, relative ones resolved."""
    module, in_init = module_name(path), path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if in_init else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from trainctl import plan` and `from trainctl.models import registry` name modules of a package;
            # `from trainctl.plan.memory import x` names a module.
            names_a_package = (ROOT.parent / base.replace(".", "/") / "__init__.py").is_file()
            names = [f"{base}.{alias.name}" for alias in node.names] if names_a_package else [base]
            found += [(name, node.lineno) for name in names]
    return tuple(found)


@functools.cache
def _package_edges() -> dict[tuple[str, str], tuple[str, ...]]:
    edges = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = package_of(module_name(path))
        for name, line in imported_modules(path):
            target = package_of(name)
            if source and target and target != source:
                edges.setdefault((source, target), []).append(f"{path.relative_to(ROOT.parent)}:{line}")
    return {edge: tuple(where) for edge, where in edges.items()}


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> 'file:line' of each import that makes the edge (a fresh dict)."""
    return {edge: list(where) for edge, where in _package_edges().items()}


def cycles(edges) -> list[list[str]]:
    """Every elementary cycle's nodes found by depth-first search (one per back edge)."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def allowed(source: str, target: str) -> bool:
    if target == "cli":
        return False
    if source in WORKER:
        return target in WORKER[source]
    if source in LAUNCHER:
        return target in LAUNCHER and LAUNCHER.index(target) <= LAUNCHER.index(source)
    return False  # a new package: place it in LAUNCHER or WORKER first


def test_the_parser_sees_the_imports_it_must_judge():
    edges = package_edges()
    # Known one-way edges: if these vanish the parser is broken, and the checks below would pass vacuously.
    assert ("plan", "config") in edges and ("train", "core") in edges and ("cli", "api") in edges
    assert ("api", "launch") in edges
    assert ("plan", "specs") in edges and ("config", "specs") in edges and ("models", "specs") in edges


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({("a", "b"): [], ("b", "c"): [], ("c", "a"): []}) == [["a", "b", "c", "a"]]
    assert cycles({("a", "b"): [], ("a", "c"): [], ("b", "c"): []}) == []


def test_no_package_level_import_cycles():
    assert cycles(package_edges()) == []


@pytest.mark.parametrize("source", LAUNCHER + tuple(WORKER))
def test_imports_go_one_way(source):
    wrong = {f"{s} -> {t}": where for (s, t), where in package_edges().items() if s == source and not allowed(s, t)}
    assert wrong == {}


def test_the_worker_does_not_import_the_planner():
    """Math both halves need (lr_at, LoRA's count) sits in core; a family's shape (FLOPs per token) in its spec."""
    assert ("plan", "config") in package_edges()  # the finder sees plan's own imports
    assert {f"{s} -> plan": where for (s, t), where in package_edges().items() if t == "plan" and s in WORKER} == {}


DESIGN_PAGE = ROOT.parent / "docs" / "design.md"


def drawn_layers(text: str) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """The launcher layers and the worker's imports as the design page lists them (its two layer lines)."""
    launcher = next(line for line in text.splitlines() if line.startswith("Launcher layers, lowest first:"))
    worker = next(line for line in text.splitlines() if line.startswith("Worker packages and what they import:"))
    parts = worker.split(":", 1)[1].split(";")
    return (tuple(re.findall(r"`(\w+)`", launcher)),
            {re.findall(r"`(\w+)`", p)[0]: tuple(re.findall(r"`(\w+)`", p)[1:]) for p in parts})


def test_the_design_page_draws_the_layers_this_test_enforces():
    assert drawn_layers("Launcher layers, lowest first: `a`, `b`\nWorker packages and what they import: `w`: `a`, "
                        "`w`; `m`: `a`") == (("a", "b"), {"w": ("a", "w"), "m": ("a",)})
    assert drawn_layers(DESIGN_PAGE.read_text()) == (LAUNCHER, WORKER)


def test_every_package_has_a_place():
    packages = {package_of(module_name(p)) for p in ROOT.rglob("*.py")} - {None}
    assert packages <= set(LAUNCHER) | set(WORKER)


def importers_of(family: str, imports: dict[str, list[str]]) -> dict[str, list[str]]:
    """Modules outside trainctl/models/<family>/ that import one of its modules: module -> what they import."""
    found: dict[str, list[str]] = {}
    prefix = f"trainctl.models.{family}."
    for source, names in imports.items():
        if source.startswith(prefix) or source == prefix[:-1]:
            continue
        hits = sorted({name for name in names if name.startswith(prefix) or name == prefix[:-1]})
        if hits:
            found[source] = hits
    return found


def test_nothing_outside_a_family_imports_its_modules():
    """A family is reached through the registry (specs, torch-free) and models/build.py (module, plan) by name,
    never imported by the plan, the config, the worker or another family: what families share lives in
    models/common/, so adding one touches its folder and a model YAML."""
    from trainctl.models import registry

    families = registry.names()
    assert {"llama", "qwen2", "qwen3", "mistral"} <= set(families) and "common" not in families
    imports = {module_name(p): [name for name, _ in imported_modules(p)] for p in sorted(ROOT.rglob("*.py"))}
    # The finder sees such an import: one family's module reaching into another's.
    probe = {"trainctl.models.qwen2.model": ["trainctl.models.llama.model"], "trainctl.models.llama.spec": ["x"]}
    assert importers_of("llama", probe) == {"trainctl.models.qwen2.model": ["trainctl.models.llama.model"]}
    assert {family: importers_of(family, imports) for family in families} == {family: {} for family in families}


def test_every_family_is_a_complete_folder_with_a_model_config():
    from trainctl.models import registry

    conf = ROOT.parent / "conf" / "model"  # the shipped configs, at the top level
    declared = {line.split(":", 1)[1].strip() for path in conf.glob("*.yaml")
                for line in path.read_text().splitlines() if line.startswith("family:")}
    for family in registry.names():
        folder = ROOT / "models" / family
        assert {"spec.py", "model.py", "parallel.py"} <= {p.name for p in folder.glob("*.py")}, family
        assert registry.spec(family).family == family
        assert family in declared, f"no conf/model/*.yaml sets family: {family}"


# ---------------------------------------------------------------- launcher backends

# A backend's own modules: the only places that may know a backend by its name.
BACKEND_MODULES = {  # each backend's folder, and its typed config (the config layer sits below launch)
    kind: (f"trainctl/config/{kind}.py",) + tuple(
        str(p.relative_to(ROOT.parent)) for p in sorted((ROOT / "launch" / "backends" / kind).glob("*.py")))
    for kind in ("slurm", "local")
}
# `== "slurm"`, `"slurm" !=`, `in ("slurm", ...)`, `launcher == ...`: deciding by a backend's name.
NAME_TESTS = re.compile(
    r"""(==|!=)\s*[{(\[]?\s*["'](slurm|local)["']|["'](slurm|local)["']\s*(==|!=)|\bin\s*[(\[{]\s*["'](slurm|local)["']"""
    r"""|\blauncher\s*(==|!=)|(==|!=)\s*\S*\.launcher\b"""
)


def name_tests(path: Path) -> list[str]:
    """'file:line: text' of each comparison with a backend's name (or with `launcher`) in one file."""
    rel = str(path.relative_to(ROOT.parent))
    return [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if is_name_test(line)]


def is_name_test(line: str) -> bool:
    # A config class checking its own launcher against its own NAME asks nothing about the backend in use.
    return bool(NAME_TESTS.search(line)) and not line.lstrip().startswith("#") and ".NAME" not in line


def test_the_name_test_finder_finds_them(tmp_path):
    probe = tmp_path / "trainctl" / "x.py"
    probe.parent.mkdir()
    lines = ['if c.launcher == "slurm":', "if 'slurm' != k:", 'if name in ("slurm", "x"):', "if launcher != y:",
             "if x == cfg.cluster.launcher:", 'name = "slurm"', "# cluster.launcher == 'slurm' in a comment",
             "if self.launcher != self.NAME:", 'slurm = names == {"slurm"}']
    probe.write_text("\n".join(lines) + "\n")
    rel = str(probe.relative_to(tmp_path))
    found = [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(lines, 1) if is_name_test(line)]
    assert [f.split(":")[1] for f in found] == ["1", "2", "3", "4", "5", "9"]


def test_no_module_outside_a_backend_asks_which_backend_it_is():
    """Each such question is one the backend (launch/backends) or its typed config (config.schema) answers."""
    own = {p for paths in BACKEND_MODULES.values() for p in paths}
    found = [hit for path in sorted(ROOT.rglob("*.py")) if str(path.relative_to(ROOT.parent)) not in own
             for hit in name_tests(path)]
    assert found == []


def test_only_the_registry_imports_a_backend():
    """Everything else goes through `backends.for_cluster` / `for_record` / `named`: a new backend changes no caller."""
    implementations = {"trainctl.launch.backends.local", "trainctl.launch.backends.slurm"}
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        if module_name(path).startswith("trainctl.launch.backends"):
            continue
        wrong += [f"{path.relative_to(ROOT.parent)}:{line}: {name}" for name, line in imported_modules(path)
                  if name in implementations]
    assert wrong == []


def test_the_backend_interface_is_torch_free_and_below_render_and_cli():
    for path in sorted((ROOT / "launch" / "backends").glob("*.py")):
        names = [name for name, _ in imported_modules(path)]
        assert not [n for n in names if n.split(".")[0] == "torch" or package_of(n) in ("render", "cli", "train")]


# ---------------------------------------------------------------- the Python API

def third_party_imports(paths) -> dict[str, list[str]]:
    """Top-level third-party modules these files import (lazy ones included): name -> 'file:line'."""
    found: dict[str, list[str]] = {}
    for path in sorted(paths):
        for name, line in imported_modules(path):
            top = name.split(".")[0]
            if top not in ("trainctl", "__future__"):
                found.setdefault(top, []).append(f"{path.relative_to(ROOT.parent)}:{line}")
    return found


def test_the_api_imports_no_torch_and_renders_nothing():
    """api returns values and prints nothing: no rich, typer or torch (a notebook imports it on a login node)."""
    assert {"rich", "typer"} <= set(third_party_imports([ROOT / "cli.py"]))  # the finder sees such imports
    found = third_party_imports((ROOT / "api").rglob("*.py"))
    assert {name: where for name, where in found.items() if name in ("torch", "rich", "typer", "wandb")} == {}


def test_nothing_imports_the_cli():
    """The CLI is the top: nothing in trainctl (api, render, the worker) imports trainctl.cli."""
    wrong = [f"{path.relative_to(ROOT.parent)}:{line}: {name}" for path in sorted(ROOT.rglob("*.py"))
             if module_name(path) != "trainctl.cli"
             for name, line in imported_modules(path) if name == "trainctl.cli" or name.startswith("trainctl.cli.")]
    assert wrong == []
    assert any(name == "trainctl.api" for name, _ in imported_modules(ROOT / "cli.py"))  # the parser sees cli's
