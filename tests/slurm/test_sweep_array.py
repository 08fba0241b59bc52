"""A sweep on the local Slurm cluster is one job array: task i trains point i, in its own run directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_slurm_cluster import FAST, JOB_TIMEOUT_S, SLURM_CPU, trainctl, wait_done

from trainctl.runs import registry as runs

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def test_a_sweep_is_one_job_array_whose_tasks_all_complete(tmp_path):
    done = trainctl("launch", "-m", *FAST, *SLURM_CPU, "train.steps=3", "optim.lr=3e-3,1e-3,3e-4",
                    "cluster.array_parallelism=2", "--name", "arr", cwd=tmp_path, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    array_id = re.search(r"submitted Slurm job array (\d+) \(3 tasks\)", done.stdout).group(1)
    folder = tmp_path / "runs" / "sweeps" / "arr"
    script = (folder / "array.sh").read_text()
    assert "#SBATCH --array=0-2%2" in script
    record = json.loads((folder / "sweep.json").read_text())
    run_dirs = [Path(p["run_dir"]) for p in record["points"]]
    assert [d.name for d in run_dirs] == ["arr-00", "arr-01", "arr-02"]
    for index, run_dir in enumerate(run_dirs):
        assert json.loads((run_dir / "launch.json").read_text())["job_id"] == f"{array_id}_{index}"
    states = [wait_done(run_dir) for run_dir in run_dirs]
    assert [s.state for s in states] == ["COMPLETED"] * 3, [runs.run_state(d) for d in run_dirs]
    for run_dir in run_dirs:
        assert json.loads((run_dir / "result.json").read_text())["steps"] == 3
        # The attempt records and logs are the task's own (ARRAY_TASK), as squeue and sacct name it.
        attempts = [json.loads(line) for line in (run_dir / "slurm-attempts.jsonl").read_text().splitlines()]
        assert {a["job_id"] for a in attempts} == {json.loads((run_dir / "launch.json").read_text())["job_id"]}
    ranked = json.loads(trainctl("runs", "--sweep", "arr", "--json", cwd=tmp_path).stdout)
    assert [r["state"] for r in ranked] == ["COMPLETED"] * 3
    assert [r["loss"] for r in ranked] == sorted(r["loss"] for r in ranked)
