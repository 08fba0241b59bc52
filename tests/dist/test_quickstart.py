"""scripts/quickstart.sh, the README's first command, end to end: recipes, plan, a 100-step run on 2 CPU workers,
and its own promise (the final validation loss at most half the step-0 one). About a minute on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.dist


def test_quickstart_trains_and_keeps_its_promise(tmp_path):
    env = {**os.environ, "TRAINCTL_RUNS_DIR": str(tmp_path / "runs"), "WANDB_SILENT": "true"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "quickstart.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == 100 and result["final_val_loss"] <= 0.5 * result["initial_val_loss"]
    assert "val loss" in proc.stdout and "tiny_cpu" in proc.stdout
