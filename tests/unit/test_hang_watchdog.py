"""The hang watchdog's key, files and reports (in-process; the watchdog firing for real: tests/dist/test_hang.py)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from trainctl.config.errors import ConfigError
from trainctl.config.schema import RunConfig
from trainctl.config.validate import resolve
from trainctl.core import hangs, rundir
from trainctl.launch.backends.local.failure import find_failure
from trainctl.launch.backends.local.launcher import report_failure
from trainctl.launch.backends.local.state import failure_detail
from trainctl.train.loop.watchdog import HangWatchdog, restart_record

T0 = 1_800_000_000.0


def with_timeout(value: float) -> RunConfig:
    cfg = RunConfig()
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, hang_timeout_s=value))


# --- the key ----------------------------------------------------------------------------------------

def test_the_watchdog_is_on_by_default_and_zero_turns_it_off():
    assert RunConfig().train.hang_timeout_s == 1800.0
    assert resolve(with_timeout(0.0)).train.hang_timeout_s == 0.0
    assert resolve(with_timeout(30.0)).train.hang_timeout_s == 30.0


@pytest.mark.parametrize(("value", "says"), [(-1.0, "must be 0 (no hang watchdog) or 1 to 2592000 seconds"),
                                             (0.5, "below 1 s"), (1e12, "or 1 to 2592000 seconds (30 days)")])
def test_a_timeout_below_zero_under_a_second_or_past_the_timer_is_one_line_naming_the_key(value, says):
    with pytest.raises(ConfigError) as err:
        resolve(with_timeout(value))
    (problem,) = [p for p in err.value.problems if "hang_timeout_s" in p]
    assert problem.startswith(f"train.hang_timeout_s={value}") and says in problem, problem


def test_the_largest_timeout_validation_allows_is_one_the_worker_timer_takes():
    """1e12 s passed validation and the worker died arming faulthandler (OverflowError); the bound must arm."""
    import faulthandler

    (high,) = [f.metadata["range"][1] for f in dataclasses.fields(RunConfig().train) if f.name == "hang_timeout_s"]
    assert resolve(with_timeout(high)).train.hang_timeout_s == high
    faulthandler.dump_traceback_later(high)
    faulthandler.cancel_dump_traceback_later()


# --- the worker's watchdog --------------------------------------------------------------------------

ENV = {"TORCHELASTIC_RUN_ID": "run/7", "TORCHELASTIC_RESTART_COUNT": "2", "SLURM_RESTART_COUNT": "1"}


def test_off_writes_nothing(tmp_path):
    watchdog = HangWatchdog.for_rank(0.0, tmp_path, 0, env=ENV)
    watchdog.arm()
    watchdog.close()
    assert not (tmp_path / rundir.HANGS).exists()


def test_a_rank_that_ends_normally_cancels_the_timer_and_removes_its_file(tmp_path):
    watchdog = HangWatchdog.for_rank(0.3, tmp_path, 3, env=ENV)
    assert watchdog.path == tmp_path / rundir.HANGS / "run_7.s1.a2.rank3.txt"  # the attempt is in the name
    assert hangs.read_hang(watchdog.path) is None  # a header, no dump: not a hang
    watchdog.arm()
    watchdog.close()
    time.sleep(0.6)  # past the timeout: had the timer survived, it would have ended this process
    assert not watchdog.path.exists()


def test_a_paused_watchdog_waits_for_the_next_arm(tmp_path):
    watchdog = HangWatchdog.for_rank(0.3, tmp_path, 0, env=ENV)
    watchdog.arm()
    watchdog.pause()  # the data build: long by nature
    time.sleep(0.6)  # past the timeout: had the timer survived, it would have ended this process
    assert hangs.read_hang(watchdog.path) is None  # still only the header
    watchdog.close()
    assert not watchdog.path.exists()


def write_hang(run_dir: Path, rank: int, restart: int = 0, run_id: str = "r1", at: float = T0,
               fired: bool = True, timeout_s: float = 10.0, host: str = "node1") -> Path:
    """A rank's hang file as the watchdog leaves it (fired: faulthandler's dump follows the header)."""
    attempt = hangs.Attempt(run_id, 0, restart)
    path = rundir.hang_file(run_dir, attempt.label, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    dump = 'Timeout (0:00:10)!\nThread 0x1 (most recent call first):\n  File "x.py", line 1 in stuck\n'
    path.write_text(hangs.header(rank, host, 100 + rank, attempt, timeout_s) + (dump if fired else ""))
    os.utime(path, (at, at))
    return path


def test_result_counts_restarts_and_says_which_ended_in_a_hang(tmp_path):
    write_hang(tmp_path, 1, restart=0)
    write_hang(tmp_path, 0, restart=0, at=T0 + 1)
    write_hang(tmp_path, 0, restart=1, fired=False)  # killed from outside (attempt 1 failed otherwise)
    write_hang(tmp_path, 1, restart=0, run_id="another-launch")
    env = {"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert restart_record(tmp_path, env) == {"restarts": 2, "restart_reasons": [
        {"attempt": 0, "reason": "hang", "ranks": [0, 1]}, {"attempt": 1, "reason": "failure"}],
        "requeues": 0, "requeue_reasons": []}
    assert restart_record(tmp_path, {}) == {"restarts": 0, "restart_reasons": [], "requeues": 0, "requeue_reasons": []}


def test_result_counts_slurm_requeues_and_names_the_node_that_hung_first(tmp_path):
    def hang(rank: int, slurm_restart: int, host: str, at: float) -> None:
        attempt = hangs.Attempt("4242", slurm_restart, 0)
        path = rundir.hang_file(tmp_path, attempt.label, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(hangs.header(rank, host, 100, attempt, 10.0) + "Timeout (0:00:10)!\n")
        os.utime(path, (at, at))

    hang(1, 0, "node2", T0)
    hang(0, 0, "node1", T0 + 1)  # waited on node2: not the node that hung
    hang(1, 2, "node1", T0 + 9)  # attempt 1 was requeued for another reason
    env = {"TORCHELASTIC_RUN_ID": "4242", "SLURM_RESTART_COUNT": "3"}
    record = restart_record(tmp_path, env)
    assert record["requeues"] == 3 and record["requeue_reasons"] == [
        {"attempt": 0, "reason": "hang", "hosts": ["node2"]}, {"attempt": 1, "reason": "requeue"},
        {"attempt": 2, "reason": "hang", "hosts": ["node1"]}]


def test_damaged_or_foreign_files_are_not_hangs(tmp_path):
    path = write_hang(tmp_path, 0)
    path.write_text("not json\nTimeout (0:00:10)!\n")
    (path.parent / "other.rank1.txt").write_bytes(b"\xff\xfe")
    assert hangs.hangs(tmp_path) == []


# --- the launcher's report --------------------------------------------------------------------------

def test_a_hang_is_reported_with_its_ranks_timeout_and_stacks(tmp_path):
    stacks = [write_hang(tmp_path, 1, at=T0), write_hang(tmp_path, 0, at=T0 + 0.2)]
    failure = find_failure("", tmp_path, since=T0 - 5)
    assert (failure.reason, failure.rank, failure.ranks) == ("hang", 1, (0, 1))
    assert failure.stacks == tuple(str(p) for p in sorted(stacks))
    line = report_failure(failure, 1, tmp_path)
    assert line.startswith("trainctl: the run hung: no progress for 10 s (train.hang_timeout_s) on ranks 0, 1")
    assert all(str(p) in line for p in stacks)
    assert "hung: no progress for 10 s" in failure_detail({"exit_code": 1, "failure": failure.to_dict()})


def test_an_older_launchs_hang_does_not_answer_for_this_one(tmp_path):
    write_hang(tmp_path, 1, at=T0)
    assert find_failure("", tmp_path, since=T0 + 60) is None


def test_an_error_of_a_later_attempt_wins_over_an_earlier_hang(tmp_path):
    write_hang(tmp_path, 1, restart=0, at=T0)
    path = tmp_path / "logs" / "torchrun" / "r1_x" / "attempt_1" / "0" / rundir.ERROR_FILE
    path.parent.mkdir(parents=True)
    rundir.write_json_atomic(path, {"message": {"message": "DataError: gone"}, rundir.ERROR_FILE_KEY: {
        "rank": 0, "local_rank": 0, "exit_code": 2, "time": T0 + 30, "run_id": "r1", "restart": "1"}})
    failure = find_failure("", tmp_path, since=T0 - 5)
    assert failure.reason == "" and failure.message == "DataError: gone" and failure.restart == 1
