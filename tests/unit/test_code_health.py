"""Smoke test of scripts/code_health.py: its figures on a small made-up package, and that it runs on ours."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("code_health", ROOT / "scripts" / "code_health.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(root: Path, rel: str, text: str) -> None:
    path = root / "trainctl" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_figures_of_a_made_up_package(tmp_path):
    health = load_script()
    write(tmp_path, "config/a.py", "from trainctl.plan import b\n\ndef f():\n    x = 1\n    return x\n")
    write(tmp_path, "plan/b.py", "from ..config import a\n# " + "x" * 130 + "\nHOOK = 'TRAINCTL_TEST_X'\n")
    write(tmp_path, "train/loop/trainer.py", "def train_loop():\n" + "    pass\n" * 9)
    figures = health.measure(tmp_path)
    assert figures["train_loop_lines"] == 10
    assert figures["longest_functions"][0] == "trainctl/train/loop/trainer.py:train_loop (10)"
    assert figures["lines_over_120"] == 1
    assert figures["package_cycles"] == ["config -> plan -> config"]
    assert figures["imports_against_layers"] == ["config -> plan"]
    assert figures["test_hooks"] == ["trainctl/plan/b.py:3"]


def test_it_judges_by_the_layering_tests_map(tmp_path):
    """One map of the layers: the worker importing the planner, or core importing data, is against it here too."""
    health = load_script()
    write(tmp_path, "train/x.py", "from trainctl.plan import flops\n")
    write(tmp_path, "core/y.py", "from trainctl.data import format\n")
    write(tmp_path, "data/z.py", "from trainctl.core import y\n")
    assert health.measure(tmp_path)["imports_against_layers"] == ["core -> data", "train -> plan"]
    assert "specs" in health.LAYERING.LAUNCHER and "train" in health.LAYERING.WORKER


def test_runs_on_this_repository(capsys):
    health = load_script()
    assert health.main([str(ROOT), "--json"]) == 0
    out = capsys.readouterr().out
    assert '"functions"' in out and '"package_cycles"' in out


def test_the_model_specs_are_a_layer_of_their_own_as_the_layering_test_draws_them(tmp_path):
    health = load_script()
    write(tmp_path, "__init__.py", "")
    write(tmp_path, "models/__init__.py", "")
    write(tmp_path, "models/registry.py", "from trainctl.models.llama import spec\n")
    write(tmp_path, "models/llama/__init__.py", "")
    write(tmp_path, "models/llama/spec.py", "X = 1\n")
    write(tmp_path, "models/llama/model.py", "from trainctl.config import a\n")  # the worker's side reads config
    write(tmp_path, "config/__init__.py", "")
    write(tmp_path, "config/a.py", "from trainctl.models import registry\nfrom ..models.llama import spec\n")
    assert health.measure(tmp_path)["package_cycles"] == []
    write(tmp_path, "config/b.py", "from trainctl.models.llama import model\n")  # config reaching the worker's models
    assert health.measure(tmp_path)["package_cycles"] == ["config -> models -> config"]
