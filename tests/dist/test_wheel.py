"""An installed wheel works from any directory: `recipes`, `plan` and a short CPU launch from an empty folder.

The wheel is built from a clean copy of the checkout (tests/wheel_build.py) and installed (without
dependencies) into a fresh virtual environment outside it. The environment sees this interpreter's
packages (torch, hydra, ...) through a plain path entry, which adds the folder to sys.path without
running its `.pth` files, so the checkout's editable install of trainctl stays invisible: every trainctl
module comes from the wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.wheel_build import build_wheel, clean_copy, shipped_in_wheel

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def run(cmd: list[str], cwd: Path, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A virtual environment holding only the trainctl wheel; returns its bin folder."""
    base = tmp_path_factory.mktemp("wheel")
    source = clean_copy(base / "source")
    wheel = build_wheel(source, base / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    assert shipped_in_wheel(source) <= set(names) and "trainctl/recipes/tiny_cpu.yaml" in names
    venv = base / "venv"
    assert run([sys.executable, "-m", "venv", str(venv)], cwd=base).returncode == 0
    py = venv / "bin" / "python"
    site = run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=base).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], cwd=base)
    assert done.returncode == 0, done.stderr
    return venv / "bin"


@pytest.fixture
def empty_dir(tmp_path) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    return folder


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRAINCTL_CONFIG_PATH")}
    return {**env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def test_the_wheel_imports_trainctl_from_itself(installed, empty_dir):
    where = run([str(installed / "python"), "-c", "import trainctl; print(trainctl.__file__)"], cwd=empty_dir,
                env=clean_env())
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed.parent)


def test_recipes_and_plan_from_an_empty_folder(installed, empty_dir):
    recipes = run([str(installed / "trainctl"), "recipes"], cwd=empty_dir, env=clean_env())
    assert recipes.returncode == 0, recipes.stderr
    assert "tiny_cpu" in recipes.stdout and "llama7b_fsdp" in recipes.stdout
    plan = run([str(installed / "trainctl"), "plan", "recipe=llama7b_fsdp", "--json"], cwd=empty_dir, env=clean_env())
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["world_size"] == 8


def test_a_short_launch_of_the_cpu_demo(installed, empty_dir):
    launch = run([str(installed / "trainctl"), "launch", "recipe=tiny_cpu", "train.steps=4", "train.eval_every=2",
                  "train.eval_batches=1", "schedule.warmup_steps=1", "logging.log_every=2", "logging.progress=false", "--name", "w"],
                 cwd=empty_dir, env=clean_env(), timeout=600)
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    result = json.loads((empty_dir / "runs" / "w" / "result.json").read_text())
    assert result["steps"] == 4 and result["final_train_loss"] > 0
    assert json.loads((empty_dir / "runs" / "w" / "progress.json").read_text()) == {"step": 4}
    # The CPU peak-memory probe (step 3) runs torch's profiler, whose Kineto start/stop lines are muted.
    assert "USDT" not in launch.stdout + launch.stderr and "memory step 3  step peak" in launch.stdout
