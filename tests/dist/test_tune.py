"""`trainctl tune` end to end on CPU: rank the layouts, probe 4 of them with short torchrun runs, pin the winner,
and launch the pinned recipe as is. The table as a terminal shows it is checked on docs/tune.md's own tune
(tests/dist/test_docs_blocks.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from worker_runs import TINY_OVERRIDES

from tests.helpers import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.slow]

BASE = ["recipe=tiny_cpu", *TINY_OVERRIDES, "train.steps=12", "train.eval_every=6", "train.eval_batches=2",
        "schedule.warmup_steps=2", "logging.log_every=4"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("tune")
    proc = run_cli("tune", *BASE, f"data.cache_dir={tmp_path / 'cache'}", "--top", "4", "--probe-steps", "6",
                   "--repeats", "1", "--name", "t", "--json", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path, json.loads(proc.stdout)


def test_four_layouts_are_probed_and_measured(tuned):
    tmp_path, data = tuned
    rows = data["rows"]
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows), rows
    assert len({tuple(r["overrides"]) for r in rows}) == 4
    for r in rows:
        run_dir = Path(r["run_dir"])
        assert run_dir.parent == tmp_path / "runs" / "tune" / "t"
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"] == 6
        assert r["measured_tokens_per_s"] > 0 and r["measured_peak_bytes"] > 0
        # the plan's peak is a prediction of what the worker measures: within a third on these tiny models
        assert abs(r["peak_error"]) < 0.33, r


def test_the_table_is_sorted_by_measured_tokens_per_s(tuned):
    _, data = tuned
    speeds = [r["measured_tokens_per_s"] for r in data["rows"]]
    assert speeds == sorted(speeds, reverse=True)
    assert sorted(r["predicted_rank"] for r in data["rows"]) == [1, 2, 3, 4]
    assert data["winner"] == data["rows"][0]["label"]
    assert json.loads((Path(data["folder"]) / "tune.json").read_text()) == data


def test_the_pinned_recipe_launches_as_is_with_the_winners_layout(tuned):
    tmp_path, data = tuned
    recipe = Path(data["recipe_file"])
    proc = run_cli("launch", f"recipe={recipe}", "--name", "pinned", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    launched = yaml.safe_load((tmp_path / "runs" / "pinned" / "config.yaml").read_text())
    probed = yaml.safe_load((Path(data["rows"][0]["run_dir"]) / "config.yaml").read_text())
    assert launched["sharding"] == probed["sharding"]
    for key in ("micro_batch", "grad_accum", "activation_checkpointing", "global_batch", "seq_len"):
        assert launched["train"][key] == probed["train"][key], key
    assert launched["train"]["steps"] == 12  # the user's run, not the probe's
    result = json.loads((tmp_path / "runs" / "pinned" / "result.json").read_text())
    assert result["steps"] == 12
    # every run's result.json: predicted and measured speed and peak (a CPU has no predicted tokens/s)
    perf = result["performance"]
    assert perf["measured"]["tokens_per_s"] > 0 and perf["predicted"]["tokens_per_s"] is None
    assert perf["predicted"]["peak_bytes"] > 0 and abs(perf["error"]["peak_bytes"]) < 0.33


def test_a_bad_option_is_one_line_and_exit_2(tmp_path):
    proc: subprocess.CompletedProcess = run_cli("tune", "recipe=tiny_cpu", "--top", "0", cwd=tmp_path)
    assert proc.returncode == 2 and "--top 0" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_hung_probe_is_cancelled_recorded_and_the_tune_goes_on(tmp_path):
    """A probe that outlives --probe-timeout (here: too many steps for 4 s) is cancelled, not waited for."""
    from trainctl import api

    proc = run_cli("tune", *BASE, f"data.cache_dir={tmp_path / 'cache'}", "--top", "2", "--probe-steps", "5000",
                   "--probe-timeout", "4", "--name", "hung", "--json", cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # nothing to pin
    data = json.loads(proc.stdout)
    # the first of each probe's two repeats times out, and the second is not started
    assert [r["status"] for r in data["rows"]] == ["timed out after 4 s (repeat 1 of 2)"] * 2
    assert data["recipe_file"] is None and not list((tmp_path / "runs" / "tune" / "hung").glob("*.yaml"))
    for r in data["rows"]:
        assert not api.status(r["run_dir"]).state.active  # stopped, not left running
