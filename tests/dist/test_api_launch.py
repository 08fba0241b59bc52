"""A notebook's loop: launch a tiny run through trainctl.api without waiting, poll api.status until it ends (with
a deadline), then read it back with api.runs(); the run's output is the handle's, not this process's stdout."""

from __future__ import annotations

import time

import pytest
from worker_runs import TINY_OVERRIDES

from trainctl import api

pytestmark = pytest.mark.dist

DEADLINE_S = 300


def test_launch_without_waiting_then_poll_status_until_done(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    overrides = ["recipe=tiny_cpu", *TINY_OVERRIDES, "train.steps=6", "train.eval_every=0", "schedule.warmup_steps=1",
                 "logging.log_every=1", f"runs_dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}"]
    handle = api.launch(overrides, wait=False, name="nb")
    assert api.status(handle.name, tmp_path / "runs").state.state == "RUNNING"  # the lock is taken before return
    deadline = time.monotonic() + DEADLINE_S
    while not (info := api.status(handle.name, tmp_path / "runs")).done:
        assert time.monotonic() < deadline, f"run still {info.state.state} after {DEADLINE_S} s"
        time.sleep(0.5)
    assert handle.wait(timeout=60) == 0 and handle.done
    assert info.state.state == "COMPLETED" and info.state.step == 6 and info.figures.loss is not None
    assert [(i.name, i.state.state) for i in api.runs(tmp_path / "runs")] == [("nb", "COMPLETED")]
    assert "step" in handle.output.text()  # rank 0's console lines came to the handle
    assert capsys.readouterr() == ("", "")
