"""`trainctl tune` on the local Slurm cluster: the probes are one job array; `tune --collect NAME` reads what they
measured once they ended, writes the table (fastest measured first) and pins the winner as a recipe."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from test_slurm_cluster import FAST, JOB_TIMEOUT_S, SLURM_CPU, failure_report, trainctl, wait_done

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

TOP, PROBE_STEPS = 3, 3


def test_the_probes_are_one_job_array_and_collect_pins_the_fastest(tmp_path):
    done = trainctl("tune", *FAST, *SLURM_CPU, "cluster.procs_per_node=2", "train.steps=20", "--top", str(TOP),
                    "--probe-steps", str(PROBE_STEPS), "--name", "t", cwd=tmp_path, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    submitted = re.search(r"submitted Slurm job array (\d+) \((\d+) probes\)", done.stdout)
    assert submitted and int(submitted.group(2)) == TOP, done.stdout
    array_id = submitted.group(1)
    assert "trainctl tune --collect t" in done.stdout
    folder = tmp_path / "runs" / "tune" / "t"
    (script,) = folder.rglob("array.sh")
    assert f"#SBATCH --array=0-{TOP - 1}" in script.read_text()

    rows = json.loads((folder / "tune.json").read_text())["rows"]
    run_dirs = [Path(r["run_dir"]) for r in rows]
    assert len(run_dirs) == TOP and all(r["status"] == "submitted" for r in rows), rows
    assert len({tuple(r["overrides"]) for r in rows}) == TOP  # three different layouts
    job_ids = {json.loads((d / "launch.json").read_text())["job_id"] for d in run_dirs}
    assert job_ids == {f"{array_id}_{i}" for i in range(TOP)}
    states = [wait_done(d) for d in run_dirs]
    assert [s.state for s in states] == ["COMPLETED"] * TOP, "\n".join(map(failure_report, run_dirs))

    collected = trainctl("tune", "--collect", "t", "--json", cwd=tmp_path, timeout=JOB_TIMEOUT_S)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    data = json.loads(collected.stdout)
    assert [r["status"] for r in data["rows"]] == ["ok"] * TOP, data["rows"]
    speeds = [r["measured_tokens_per_s"] for r in data["rows"]]
    assert all(s > 0 for s in speeds) and speeds == sorted(speeds, reverse=True)
    assert data["winner"] == data["rows"][0]["label"]
    assert json.loads((folder / "tune.json").read_text()) == data

    # The pinned recipe is the winner's layout, with the user's run length.
    recipe = Path(data["recipe_file"])
    assert recipe.is_file() and recipe.parent == folder
    pinned = yaml.safe_load(recipe.read_text())
    probed = yaml.safe_load((Path(data["rows"][0]["run_dir"]) / "config.yaml").read_text())
    assert pinned["sharding"] == probed["sharding"]
    for key in ("micro_batch", "grad_accum", "activation_checkpointing"):
        assert pinned["train"][key] == probed["train"][key], key
    assert pinned["train"]["steps"] == 20 and probed["train"]["steps"] == PROBE_STEPS
    assert pinned["cluster"]["launcher"] == "slurm"  # the user's cluster, to launch the pinned recipe on
    printed = trainctl("tune", "--collect", "t", cwd=tmp_path, timeout=JOB_TIMEOUT_S)
    assert printed.returncode == 0 and f"launch it with: trainctl launch recipe={recipe}" in printed.stdout
