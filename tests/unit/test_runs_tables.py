"""`runs` and `status` for scripts: --json, whole tab-separated values when piped, TRAINCTL_RUNS_DIR."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import make_run, run_cli
from trainctl.runs.figures import figures, sparkline

pytestmark = pytest.mark.cli
LONG = "a-rather-long-run-name-that-a-table-would-cut-20261124-120000"


def a_run(root: Path, name: str, losses: list[float], val: float | None, finished: bool) -> Path:
    records = [{"kind": "train", "step": i + 1, "loss": loss, "tokens_per_s": 1000.0 + i, "step_time_s": 0.5}
               for i, loss in enumerate(losses)]
    if val is not None:
        records.append({"kind": "eval", "step": len(losses), "val_loss": val})
    return make_run(root, name, launch={"launcher": "local", "exit_code": 0 if finished else None}, metrics=records,
                    result={"steps": 10} if finished else None)


@pytest.fixture
def runs_dir(tmp_path):
    root = tmp_path / "elsewhere"
    a_run(root, LONG, [4.0, 3.0, 2.5], 2.4, finished=True)
    a_run(root, "short", [5.0, 4.5], None, finished=True)
    return root


def env_with(runs_dir: Path) -> dict:
    return {**os.environ, "TRAINCTL_RUNS_DIR": str(runs_dir)}


def test_runs_json_matches_the_run_directories(runs_dir, tmp_path):
    proc = run_cli("runs", "--json", cwd=tmp_path, env=env_with(runs_dir))
    assert proc.returncode == 0, proc.stderr
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert set(rows) == {LONG, "short"}
    long = rows[LONG]
    assert (long["state"], long["step"], long["steps"], long["loss"], long["val_loss"]) == ("COMPLETED", 3, 10, 2.5,
                                                                                            2.4)
    assert long["tokens_per_s"] == 1001.0 and Path(long["path"]) == (runs_dir / LONG).resolve()
    assert rows["short"]["val_loss"] is None


def test_piped_runs_prints_whole_tab_separated_values(runs_dir, tmp_path):
    proc = run_cli("runs", "--runs-dir", str(runs_dir), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header, rows = lines[0].split("\t"), [line.split("\t") for line in lines[1:]]
    assert header[:8] == ["run", "launcher", "job", "state", "step", "loss", "eval", "tok/s"]
    assert sum(row[3] == "COMPLETED" for row in rows) == 2  # what `trainctl runs | grep -c COMPLETED` counts
    assert [LONG, "local", "-", "COMPLETED", "3/10", "2.5", "2.4", "1001"] == next(r for r in rows if r[0] == LONG)[:8]


def test_status_json_has_losses_and_the_log(runs_dir, tmp_path):
    proc = run_cli("status", LONG, "--json", cwd=tmp_path, env=env_with(runs_dir))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert (record["name"], record["loss"], record["val_loss"], record["step"]) == (LONG, 2.5, 2.4, 3)
    assert record["log"].endswith("rank0.log")
    text = run_cli("status", LONG, cwd=tmp_path, env=env_with(runs_dir)).stdout
    assert "2.5000" in text and "tokens/s" in text


def test_figures_give_an_eta_and_a_sparkline(runs_dir):
    f = figures(runs_dir / LONG)
    assert f.eta_s(3, 10) == pytest.approx(3.5)  # 7 steps left at 0.5 s
    assert f.losses == (4.0, 3.0, 2.5)
    assert sparkline(f.losses) == "█▃▁"
    assert sparkline((1.0,)) == "" and sparkline((float("nan"), 2.0, 1.0)) == "█▁"


@pytest.mark.component
def test_launches_follow_trainctl_runs_dir_too(monkeypatch):
    from trainctl.config.compose import compose

    monkeypatch.delenv("TRAINCTL_RUNS_DIR", raising=False)
    assert compose([]).runs_dir == "runs"
    monkeypatch.setenv("TRAINCTL_RUNS_DIR", "/scratch/me/runs")
    assert compose([]).runs_dir == "/scratch/me/runs"
    assert compose(["runs_dir=here"]).runs_dir == "here"  # the command line still wins


def test_runs_follows_the_runs_dir_a_config_sets(runs_dir, tmp_path):
    names = {r["name"] for r in json.loads(run_cli("runs", f"runs_dir={runs_dir}", "--json", cwd=tmp_path).stdout)}
    assert names == {LONG, "short"}
    mine = tmp_path / "conf" / "recipes"
    mine.mkdir(parents=True)
    (mine / "far.yaml").write_text(f"# @package _global_\nruns_dir: {runs_dir}\n")
    proc = run_cli("runs", "recipe=far", "--config-dir", str(tmp_path / "conf"), "--json", cwd=tmp_path)
    assert {r["name"] for r in json.loads(proc.stdout)} == {LONG, "short"}
    assert json.loads(run_cli("runs", "--json", cwd=tmp_path).stdout) == []  # runs/ here holds none
