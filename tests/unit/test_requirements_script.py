"""scripts/_requirements.py: the requirements scripts/test_torch.sh installs into a release venv before trainctl
itself, read from pyproject.toml (a dependency added there reaches the release venv without another edit)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("trainctl_requirements", REPO / "scripts" / "_requirements.py")
script = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(script)

needs_tomllib = pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11's")


@needs_tomllib
def test_the_dependencies_and_the_named_extras_once_each():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = script.requirements(["dev", "fp8"])
    assert set(reqs) == set(project["dependencies"]) | set(project["optional-dependencies"]["dev"]) | {"torchao"}
    assert len(reqs) == len(set(reqs)) and reqs[: len(project["dependencies"])] == project["dependencies"]


@needs_tomllib
def test_an_extra_pyproject_lacks_is_one_line_naming_them(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["a"]\n[project.optional-dependencies]\ndev = ["b", "a"]\n')
    assert script.requirements(["dev"], pyproject) == ["a", "b"]
    with pytest.raises(SystemExit, match=r"no extra 'gpu' in .*; it has: dev$"):
        script.requirements(["gpu"], pyproject)
