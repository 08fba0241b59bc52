"""Extending a finished run: `trainctl resume NAME train.steps=N` continues it exactly where it ended."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from worker_runs import TINY_OVERRIDES

from tests.helpers import curve_rel, run_cli

pytestmark = pytest.mark.dist

# A constant rate after warmup: a run of 8 steps extended to 16 must train steps 9-16 exactly as one run of 16 does.
SMALL = [*TINY_OVERRIDES, "recipe=tiny_cpu", "schedule=constant", "schedule.warmup_steps=2", "train.eval_every=0",
         "logging.log_every=1", "cluster.procs_per_node=2"]


def trainctl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=tmp_path, timeout=300)


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def test_an_extended_run_continues_exactly_as_one_long_run(tmp_path, data_cache):
    cache = f"data.cache_dir={data_cache}"
    first = trainctl(tmp_path, "launch", *SMALL, cache, "train.steps=8", "--name", "short")
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "short"
    finished = (run_dir / "result.json").read_text()

    more = trainctl(tmp_path, "resume", "short", "train.steps=16")
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert "schedule: constant at 0.003" in more.stdout and "jumps" not in more.stderr
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == 16 and result["resumed_from_step"] == 8
    kept = [p for p in (run_dir / "history").iterdir() if p.name.endswith("-result.json")]
    assert len(kept) == 1 and kept[0].read_text() == finished

    whole = trainctl(tmp_path, "launch", *SMALL, cache, "train.steps=16", "--name", "long")
    assert whole.returncode == 0, whole.stderr[-3000:]
    extended, reference = losses(run_dir), losses(tmp_path / "runs" / "long")
    assert sorted(extended) == list(range(1, 17))
    for step in range(9, 17):
        assert extended[step] == pytest.approx(reference[step], rel=curve_rel(step, batch=16)), step
