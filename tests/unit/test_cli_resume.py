"""Resume, dry runs and launch scripts as a user meets them: the CLI and `bash RUN/launch.sh` in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import PROBE, run_cli

pytestmark = pytest.mark.cli

TINY = ["recipe=tiny_cpu", "train.steps=4", "train.eval_every=2", "schedule.warmup_steps=1"]


def dry_run(tmp_path: Path, *extra: str, name: str = "r") -> Path:
    proc = run_cli("launch", *TINY, *extra, "--dry-run", "--name", name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return tmp_path / "runs" / name


def test_resume_of_a_hand_edited_config_is_refused_in_one_line_naming_the_file(tmp_path):
    run_dir = dry_run(tmp_path)
    text = (run_dir / "config.yaml").read_text().replace("n_kv_heads: 4", "n_kv_heads: 3")
    (run_dir / "config.yaml").write_text(text)
    proc = run_cli("resume", "r", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {run_dir / 'config.yaml'}: model.n_kv_heads=3: must divide model.n_heads=8 (grouped-query "
        "attention); use a divisor such as 1, 2, 4, 8"]
    assert not (run_dir / "launch.json").exists() and not (run_dir / "logs" / "torchrun").exists()


def test_launch_script_of_a_finished_run_does_not_train_or_rewrite_its_result(tmp_path):
    run_dir = dry_run(tmp_path)
    result = json.dumps({"steps": 4, "final_train_loss": 1.5})
    (run_dir / "result.json").write_text(result)
    proc = subprocess.run(["bash", str(run_dir / "launch.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr
    assert "already finished" in proc.stderr and "trainctl resume r train.steps=N" in proc.stderr
    assert (run_dir / "result.json").read_text() == result
    assert not (run_dir / "logs" / "torchrun").exists()  # torchrun never started


def test_a_slurm_sweep_dry_run_writes_its_array_script_and_says_how_to_submit_it(tmp_path):
    proc = run_cli("launch", "-m", *TINY, "cluster=slurm", "optim.lr=1e-3,2e-3", "--dry-run", "--name", "sw",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "runs" / "sweeps" / "sw" / "array.sh"
    assert f"submit the job array with sbatch {script}" in proc.stdout
    text = script.read_text()
    assert "#SBATCH --array=0-1" in text and str(tmp_path / "runs" / "sw-01") in text


def test_a_deleted_working_directory_is_one_line(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    # The child starts in the folder, which is removed before it looks at it (the shell holds it as its cwd).
    script = f'cd "{gone}" && rmdir "{gone}" && exec "$0" -c "$1" plan recipe=tiny_cpu'
    proc = subprocess.run(["bash", "-c", script, sys.executable, PROBE], capture_output=True, text=True, timeout=60)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("__PROBE__")]
    assert proc.returncode == 2 and len(lines) == 1 and "working directory" in lines[0], proc.stderr
