"""The worker's exit path: an error's exit code comes from the error itself (one base class, WorkerError), and
the error file the worker writes is the one the launcher reads (one key, core/rundir)."""

from __future__ import annotations

import logging
import os

import pytest

from trainctl.core import rundir
from trainctl.launch.backends.local.failure import first_failure
from trainctl.train import __main__ as worker_main
from trainctl.train.checkpoint.store import CheckpointError
from trainctl.train.errors import EXIT_CONFIG, EXIT_FAILURE, WorkerConfigError, WorkerError
from trainctl.train.loop.guards import NonFiniteError
from trainctl.train.loop.sources import DataError


class _MadeUpError(WorkerError):
    """A worker error nothing in trainctl knows by name: its own code must be what the worker exits with."""

    exit_code = 7


@pytest.mark.parametrize(("err", "code"), [
    (WorkerConfigError("model.dim: odd; use an even dim"), EXIT_CONFIG),
    (DataError("data.train_path='/x': missing; point it at a file"), EXIT_CONFIG),
    (NonFiniteError(3, float("nan"), 1.0, "the loss is NaN"), EXIT_FAILURE),
    (CheckpointError("checkpoint step-3: disk full; free space"), EXIT_FAILURE),
    (_MadeUpError("a new kind of failure; do this"), 7),
])
def test_a_worker_error_exits_with_its_own_code_and_one_line(err, code, caplog):
    caplog.set_level(logging.ERROR, logger="trainctl.train")
    assert worker_main.failed(err) == (code, worker_main.one_line(err, True))
    assert [r.exc_info for r in caplog.records] == [None]  # one line, no traceback


def test_an_unexpected_error_exits_1_with_its_type_and_traceback(caplog):
    caplog.set_level(logging.ERROR, logger="trainctl.train")
    assert worker_main.failed(ValueError("boom")) == (EXIT_FAILURE, "ValueError: boom")
    assert caplog.records[0].exc_info is not None


def test_the_error_file_the_worker_writes_is_the_one_the_launcher_reads(tmp_path, monkeypatch):
    path = tmp_path / rundir.TORCHRUN_LOGS / "r1_x" / "attempt_0" / "1" / rundir.ERROR_FILE
    path.parent.mkdir(parents=True)
    monkeypatch.setenv(worker_main.ERROR_FILE_ENV, str(path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    worker_main.write_error_file("data.x: wrong; do y", EXIT_CONFIG, tmp_path / "logs" / "rank3.log")
    assert rundir.ERROR_FILE_KEY in rundir.read_json(path)
    failure = first_failure(tmp_path)
    assert (failure.rank, failure.local_rank, failure.exit_code, failure.message) == (3, 1, 2, "data.x: wrong; do y")
    assert os.path.basename(failure.log) == "rank3.log" or failure.log == ""
