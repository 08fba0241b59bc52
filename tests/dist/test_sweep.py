"""Sweeps run locally: `launch -m` with Hydra's sweep grammar trains every point; `runs --sweep` ranks them;
one bad point and nothing starts."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from tests.helpers import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.slow]
TINY = ["recipe=tiny_cpu", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=128", "model.max_seq_len=128", "train.steps=4", "train.global_batch=8", "train.micro_batch=4",
        "train.eval_every=2", "train.eval_batches=1", "schedule.warmup_steps=1", "logging.log_every=2",
        "logging.progress=false"]


# Training through the CLI: longer than run_cli's default limit.
trainctl = partial(run_cli, timeout=600)


def test_a_2x2_sweep_trains_four_runs_and_ranks_them(tmp_path):
    done = trainctl("launch", "-m", *TINY, "optim.lr=3e-3,1e-4", "train.seq_len=32,64", "--name", "grid",
                    cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "runs" / "sweeps" / "grid" / "sweep.json").read_text())
    assert [p["overrides"][-2:] for p in record["points"]] == [
        ["optim.lr=0.003", "train.seq_len=32"], ["optim.lr=0.003", "train.seq_len=64"],
        ["optim.lr=0.0001", "train.seq_len=32"], ["optim.lr=0.0001", "train.seq_len=64"]]
    for point in record["points"]:
        result = json.loads((Path(point["run_dir"]) / "result.json").read_text())
        assert result["steps"] == 4
    ranked = json.loads(trainctl("runs", "--sweep", "grid", "--json", cwd=tmp_path).stdout)
    losses = [row["loss"] for row in ranked]
    assert losses == sorted(losses) and len(losses) == 4 and all(row["state"] == "COMPLETED" for row in ranked)
    assert all(row["swept"] == row["overrides"][-2:] for row in ranked)
    # The high learning rate learns more in four steps: both of its points rank first.
    assert {row["swept"][0] for row in ranked[:2]} == {"optim.lr=0.003"}
    plotted = trainctl("plot", "--sweep", "grid", cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr
    assert (tmp_path / "runs" / "sweeps" / "grid" / "plot.png").stat().st_size > 20_000


def test_a_sweep_with_one_invalid_point_starts_nothing(tmp_path):
    done = trainctl("launch", "-m", *TINY, "optim.lr=3e-3,1e-3", "train.seq_len=64,4096", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert [line.split(" (")[0] for line in lines[:-1]] == ["error: point 1", "error: point 3"]
    assert all("train.seq_len=4096" in line for line in lines[:-1])
    assert lines[-1] == "error: nothing was started: 4 points, 2 with problems"
    assert not (tmp_path / "runs").exists()
