"""The local backend's failure.py: the first failing rank from torchelastic's error files, tolerant of damage;
the summary fallback."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from trainctl.launch.backends.local.failure import find_failure, first_failure

T0 = 1_800_000_000.0


def error_file(run_dir: Path, local_rank: int, *, torchrun_dir: str = "abc_x1", attempt: int = 0,
               rank: int | None = None, time: float = T0, message: str = "boom", exit_code: int = 1,
               ours: bool = True, **fields) -> Path:
    """An error.json as the worker (ours=True) or torchelastic's ErrorHandler (ours=False) writes it."""
    path = run_dir / "logs" / "torchrun" / torchrun_dir / f"attempt_{attempt}" / str(local_rank) / "error.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time))}}}
    if ours:
        data["trainctl"] = {"rank": local_rank if rank is None else rank, "local_rank": local_rank,
                            "exit_code": exit_code,
                            "time": time, "run_id": torchrun_dir.rsplit("_", 1)[0], "restart": str(attempt), **fields}
    path.write_text(json.dumps(data))
    os.utime(path, (time, time))
    return path


def test_the_earliest_error_names_the_rank_and_its_own_message(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank0.log").write_text("log of rank 0\n")
    # Rank 1 dies of the broken connection 0.3 s after rank 0's real error, in the same second.
    error_file(tmp_path, 1, time=T0 + 0.5, message="RuntimeError: Connection closed by peer [127.0.0.1]:1234")
    message = "data.train_path='/x': file not found; point it at a file"
    error_file(tmp_path, 0, time=T0 + 0.2, exit_code=2, message=message)
    failure = first_failure(tmp_path)
    assert failure is not None
    assert (failure.rank, failure.exit_code) == (0, 2)
    assert failure.message == message
    assert failure.log == str(tmp_path / "logs" / "rank0.log")
    assert failure.to_dict()["message"] == failure.message


def test_only_the_newest_attempt_counts(tmp_path):
    # Attempt 0 failed on rank 1 first; the restart (attempt 1) failed on rank 0 first.
    error_file(tmp_path, 1, attempt=0, time=T0, message="first attempt")
    error_file(tmp_path, 0, attempt=1, time=T0 + 60, message="second attempt, rank 0")
    error_file(tmp_path, 1, attempt=1, time=T0 + 61, message="second attempt, rank 1")
    assert first_failure(tmp_path).message == "second attempt, rank 0"


def test_nodes_of_one_attempt_are_compared_across_their_torchrun_dirs(tmp_path):
    # Two nodes (one torchrun directory each, one run id): global rank 3 on node 1 failed first.
    error_file(tmp_path, 0, torchrun_dir="job7_aaaa", rank=0, time=T0 + 2, message="rank 0 saw it second")
    error_file(tmp_path, 1, torchrun_dir="job7_bbbb", rank=3, time=T0 + 1, message="rank 3's own error")
    failure = first_failure(tmp_path)
    assert (failure.rank, failure.local_rank, failure.message) == (3, 1, "rank 3's own error")


def test_a_slurm_requeue_is_a_newer_attempt_under_the_same_run_id(tmp_path):
    error_file(tmp_path, 0, torchrun_dir="job7_aaaa", time=T0, message="before the requeue", slurm_restart="0")
    error_file(tmp_path, 1, torchrun_dir="job7_cccc", time=T0 + 100, message="after", slurm_restart="1")
    error_file(tmp_path, 0, torchrun_dir="job7_cccc", time=T0 + 101, message="after, later", slurm_restart="1")
    assert first_failure(tmp_path).message == "after"


def test_since_ignores_an_earlier_launch(tmp_path):
    error_file(tmp_path, 0, time=T0, message="old")
    assert first_failure(tmp_path, since=T0 + 10) is None
    assert first_failure(tmp_path, since=T0 - 10).message == "old"


def test_torchelastics_own_error_file_is_read_too(tmp_path):
    error_file(tmp_path, 1, ours=False, time=T0, message="ValueError: from @record")
    failure = first_failure(tmp_path)
    got = (failure.rank, failure.local_rank, failure.exit_code, failure.message)
    assert got == (1, 1, None, "ValueError: from @record")


def test_exit_code_of_a_torchelastic_file_comes_from_the_summary(tmp_path):
    error_file(tmp_path, 1, ours=False, time=T0, message="ValueError: x")
    summary = "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 7 (pid: 1)\n"
    assert find_failure(summary, tmp_path).exit_code == 7


def test_summary_is_the_fallback_without_error_files(tmp_path):
    summary = "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 1)\n"
    failure = find_failure(summary, tmp_path)
    assert (failure.rank, failure.exit_code, failure.message) == (1, -9, "")
    assert find_failure("no summary here", tmp_path) is None


def test_a_rank_killed_by_a_signal_is_named_before_the_peer_whose_connection_it_broke(tmp_path):
    # Rank 1 was killed (kill -9, the OOM killer): no error file; rank 0 then wrote the broken connection.
    error_file(tmp_path, 0, time=T0 + 0.5, message="RuntimeError: Read error: Connection reset by peer")
    summary = "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 1)\n"
    failure = find_failure(summary, tmp_path)
    assert (failure.rank, failure.local_rank, failure.exit_code) == (1, 1, -9)
    assert failure.message.startswith("killed by SIGKILL") and "Connection reset by peer" in failure.message
    # A positive exit code, or the error file's own rank, leaves the error files' answer.
    for code, rank in ((3, 1), (-9, 0)):
        other = summary.replace("exitcode  : -9", f"exitcode  : {code}").replace(": 1 (local_rank: 1)",
                                                                                 f": {rank} (local_rank: {rank})")
        assert find_failure(other, tmp_path).message == "RuntimeError: Read error: Connection reset by peer"


DAMAGE = [b"", b"{", b"[]", b"null", b'"text"', b'{"message": 3}', b'{"message": {"extraInfo": "x"}}',
          b'{"message": {"message": ["a"], "extraInfo": {"timestamp": "soon"}},'
          b' "trainctl": {"rank": "x", "time": "t"}}',
          b'{"trainctl": []}', b"\xff\xfe\x00garbage"]


@pytest.mark.parametrize("content", DAMAGE)
def test_a_damaged_error_file_never_raises(tmp_path, content):
    good = error_file(tmp_path, 0, time=T0 + 5, message="the real one")
    bad = good.parent.parent / "1" / "error.json"
    bad.parent.mkdir()
    bad.write_bytes(content)
    os.utime(bad, (T0 + 9, T0 + 9))  # newer than the good one: it is read, whatever it holds
    failure = first_failure(tmp_path)
    assert failure is not None and failure.message in ("the real one", "")
    find_failure("", tmp_path)


def test_random_bytes_and_json_values_never_raise(tmp_path):
    rng = random.Random(3)
    values = [None, True, -1, 2.5, "s", [], {}, {"a": 1}, [1, "x"], 10**30]
    for case in range(200):
        path = tmp_path / f"case{case}" / "logs" / "torchrun" / "r_x" / "attempt_0" / "0" / "error.json"
        path.parent.mkdir(parents=True)
        if case % 2:
            path.write_bytes(rng.randbytes(rng.randrange(40)))
        else:
            data = {"message": {"message": rng.choice(values), "extraInfo": {"timestamp": rng.choice(values)}},
                    "trainctl": {key: rng.choice(values) for key in ("rank", "time", "exit_code", "run_id", "log")}}
            path.write_text(json.dumps(data))
        first_failure(tmp_path / f"case{case}")


def test_no_torchrun_logs_at_all(tmp_path):
    assert first_failure(tmp_path) is None
    assert first_failure(tmp_path / "missing") is None
