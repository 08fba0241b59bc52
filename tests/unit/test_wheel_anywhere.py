"""A wheel built from a clean copy of the checkout carries the top-level conf/ and recipes/, and an install of it
lists and launches the shipped recipes from an empty folder.

The install is `pip install --target` into a folder outside the checkout, put alone on PYTHONPATH for this
interpreter (whose site-packages give torch, hydra, ...): every trainctl module and config comes from the wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.wheel_build import build_wheel, clean_copy, shipped_in_wheel

pytestmark = pytest.mark.cli


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The wheel, installed without dependencies into a folder of its own."""
    base = tmp_path_factory.mktemp("wheel")
    source = clean_copy(base / "source")
    wheel = build_wheel(source, base / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = shipped_in_wheel(source)
    assert "trainctl/conf/config.yaml" in expected and "trainctl/recipes/tiny_cpu.yaml" in expected
    assert expected <= names, f"the wheel lacks shipped configs: {sorted(expected - names)[:5]}"
    target = base / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--disable-pip-version-check",
                           "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return target


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRAINCTL_CONFIG_PATH", "TRAINCTL_RUNS_DIR")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def empty(tmp_path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def test_the_installed_package_reads_its_own_copy_of_the_configs(site, empty):
    code = ("import trainctl.config.sources as s; "
            "print(s.__file__); print(s.shipped_dir()); print(s.shipped_recipes_dir())")
    done = run_installed(site, empty, "-c", code)
    assert done.returncode == 0, done.stderr
    module, conf, recipes = (Path(line) for line in done.stdout.splitlines())
    assert module.is_relative_to(site) and not module.is_relative_to(REPO)
    assert (conf, recipes) == (site / "trainctl" / "conf", site / "trainctl" / "recipes")


def test_recipes_lists_every_shipped_recipe_from_an_empty_folder(site, empty):
    done = run_installed(site, empty, "-m", "trainctl.cli", "recipes")
    assert done.returncode == 0, done.stderr
    listed = {line.split("\t")[0] for line in done.stdout.splitlines() if line.strip()}
    assert listed == {p.stem for p in (REPO / "recipes").glob("*.yaml")}
    groups = run_installed(site, empty, "-m", "trainctl.cli", "config", "groups")
    assert groups.returncode == 0, groups.stderr
    assert "llama2_7b" in groups.stdout and "fsdp" in groups.stdout


def test_a_dry_run_launch_of_a_shipped_recipe_from_an_empty_folder(site, empty):
    done = run_installed(site, empty, "-m", "trainctl.cli", "launch", "recipe=tiny_cpu", "--dry-run", "--name", "w")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run_dir = empty / "runs" / "w"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "launch.sh").is_file()
    assert "tiny" in (run_dir / "config.yaml").read_text()
