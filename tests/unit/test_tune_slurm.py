"""`trainctl tune` on Slurm (api/tuning_queued.py through the Slurm backend): the probes as one job array with a
stub sbatch, then `--collect` reading what they measured (the Slurm states faked)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.helpers import write_exe
from trainctl import api
from trainctl.api import tuning, tuning_queued
from trainctl.plan import tune as planner
from trainctl.runs import registry as run_states_module

pytestmark = pytest.mark.cli  # a stub sbatch runs as a subprocess

BASE = ["recipe=tiny_cpu", "cluster=slurm"]


@pytest.fixture
def submitted(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_exe(bin_dir / "sbatch", f'printf "%s\\n" "$@" >> {tmp_path}/sbatch_args\necho "555"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    result = tuning.tune([*BASE, f"runs_dir={tmp_path / 'runs'}"], top=3, probe_steps=6, probe_timeout_s=90,
                         name="s")
    return tmp_path, result


def test_the_probes_are_one_job_array_of_short_time_limited_runs(submitted):
    tmp_path, result = submitted
    assert result.job_id == "555" and "trainctl tune --collect s" in result.message
    assert [p.status for p in result.probes] == ["submitted"] * 3 and result.recipe_file is None
    array = Path((tmp_path / "sbatch_args").read_text().split()[-1])
    assert "#SBATCH --array=0-2" in array.read_text()
    for probe in result.probes:
        cfg = yaml.safe_load((Path(probe.run_dir) / "config.yaml").read_text())
        assert cfg["train"]["steps"] == 6 and cfg["cluster"]["time_limit"] == "2"  # 90 s: 2 minutes
        assert Path(probe.run_dir).parent == result.folder
    assert json.loads((result.folder / tuning.TUNE_JSON).read_text())["job_id"] == "555"


def finished(run_dir: Path, speed: float, peak: int) -> None:
    records = [{"kind": "train", "step": s, "tokens_per_s": speed} for s in range(1, 7)]
    records.append({"kind": "memory", "step": 3, "peak_bytes": peak})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "result.json").write_text(json.dumps({"steps": 6}))


def test_collect_ranks_what_ended_and_pins_the_winner(submitted, monkeypatch):
    tmp_path, result = submitted
    first, second, third = (Path(p.run_dir) for p in result.probes)
    finished(first, 100.0, 1000)
    finished(second, 300.0, 2000)

    def states(run_dirs):
        return [run_states_module.RunState(d.name, d, "slurm", "COMPLETED" if d != third else "FAILED",
                                           detail="" if d != third else "exit 1") for d in run_dirs]

    monkeypatch.setattr(run_states_module, "run_states", states)
    collected = tuning_queued.collect("s", tmp_path / "runs")
    assert [p.status for p in collected.probes] == ["ok", "ok", "failed: FAILED (exit 1)"]
    assert [p.measured_tokens_per_s for p in collected.probes[:2]] == [300.0, 100.0]
    pinned = api.resolved([f"recipe={collected.recipe_file}"])
    winner = planner.rank(api.resolved([*BASE, f"runs_dir={tmp_path / 'runs'}"]))[1]
    assert planner.layout_key(pinned) == planner.layout_key(winner.cfg)
    assert pinned.cluster.launcher == "slurm" and pinned.train.steps == 100  # the user's run, not the probe's
