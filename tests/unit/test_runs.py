"""Runs after launch: state from launch.json, squeue/sacct (stubbed) and the job's attempt records; logs; cancel."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import make_run, run_cli, wait_for, write_exe
from trainctl.launch.backends.slurm import jobs as slurm_jobs
from trainctl.launch.errors import LaunchError
from trainctl.launch.rundir import check_name
from trainctl.runs import registry as runs


def test_state_of_a_queued_and_a_running_job_comes_from_squeue(tmp_path, slurm_bin):
    write_exe(slurm_bin / "squeue",
              f'echo "$@" > {tmp_path}/squeue_args\necho "11|PENDING|Resources|"\necho "12|RUNNING|None|node[1-2]"\n')
    a = make_run(tmp_path / "runs", "a", launch={"launcher": "slurm", "job_id": "11"})
    b = make_run(tmp_path / "runs", "b", launch={"launcher": "slurm", "job_id": "12"})
    (b / "metrics.jsonl").write_text('{"kind": "train", "step": 3}\n{"kind": "eval", "step": 3}\n{"kind": "train", "st')
    states = runs.run_states([a, b])
    assert [(s.state, s.active, s.detail) for s in states] == [
        ("PENDING", True, "Resources"), ("RUNNING", True, "node[1-2]")]
    assert (states[1].step, states[1].steps) == (3, 10)
    assert "--jobs=11,12" in (tmp_path / "squeue_args").read_text()  # one query for all runs


def test_sacct_answers_for_jobs_squeue_forgot(tmp_path, slurm_bin):
    write_exe(slurm_bin / "sacct", 'echo "21|CANCELLED by 0|node1|0:15"\n')
    state = runs.run_state(make_run(tmp_path / "runs", "a", launch={"launcher": "slurm", "job_id": "21"}))
    assert (state.state, state.active) == ("CANCELLED", False)
    assert "exit 0:15" in state.detail


@pytest.mark.parametrize(
    ("records", "state"),
    [
        ([("start", None), ("end", 0)], "COMPLETED"),
        ([("start", None), ("end", 1)], "FAILED"),
        ([("start", None)], "UNKNOWN"),  # cancelled or killed: the batch shell died before recording
        ([], "UNKNOWN"),
    ],
)
def test_jobs_slurm_no_longer_knows_are_judged_by_their_records(tmp_path, slurm_bin, records, state):
    run_dir = make_run(tmp_path / "runs", "a", launch={"launcher": "slurm", "job_id": "31"})
    lines = [{"event": e, "job_id": "31", "attempt": 0, "exit_code": code} for e, code in records]
    lines.append({"event": "end", "job_id": "30", "attempt": 0, "exit_code": 0})  # another job of the same run
    (run_dir / "slurm-attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = runs.run_state(run_dir)
    assert (got.state, got.active) == (state, False)
    if state == "UNKNOWN":
        assert "Slurm no longer knows job 31" in got.detail


def test_without_slurm_clients_the_records_still_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    run_dir = make_run(tmp_path / "runs", "a", launch={"launcher": "slurm", "job_id": "41"})
    (run_dir / "result.json").write_text("{}")
    assert runs.run_state(run_dir).state == "COMPLETED"
    assert slurm_jobs.job_infos(["41"]) == {}


def test_local_states_come_from_the_runs_own_records(tmp_path):
    assert runs.run_state(make_run(tmp_path / "runs", "dry")).state == "NOT_STARTED"
    done = make_run(tmp_path / "runs", "ok", launch={"launcher": "local", "pid": 1, "host": "h", "exit_code": 1})
    (done / "result.json").write_text("{}")
    assert runs.run_state(done).state == "COMPLETED"  # torchrun's exit code does not decide
    failure = {"rank": 0, "local_rank": 0, "exit_code": 2, "log": "", "message": "data.train_path: not found\nmore"}
    record = {"launcher": "local", "exit_code": 2, "state": "FAILED", "failure": failure}
    failed = runs.run_state(make_run(tmp_path / "runs", "bad", launch=record))
    assert (failed.state, failed.detail) == ("FAILED", "exit code 2, rank 0 failed first: data.train_path: not found")
    stopped = make_run(tmp_path / "runs", "int", launch={"launcher": "local", "pid": 1, "host": "h", "exit_code": 1})
    (stopped / "stopped.json").write_text(json.dumps({"step": 20, "signal": "SIGINT", "checkpoint": "step-00000020"}))
    got = runs.run_state(stopped)
    assert (got.state, got.active) == ("CANCELLED", False) and "SIGINT at step 20" in got.detail
    # pid 1 is alive but nobody holds the run's lock: the record is stale, not running
    import socket

    stale = runs.run_state(make_run(tmp_path / "runs", "stale",
                                    launch={"launcher": "local", "pid": 1, "host": socket.gethostname()}))
    assert (stale.state, stale.active) == ("UNKNOWN", False)


def test_a_copied_run_is_not_the_original(tmp_path):
    original = make_run(tmp_path / "runs", "a",
                        launch={"launcher": "local", "pid": 1, "host": "h", "run_dir": "/elsewhere/a"})
    got = runs.run_state(original)
    assert (got.state, got.active) == ("UNKNOWN", False) and "copied or moved from /elsewhere/a" in got.detail


def hold_lock(run_dir: Path, start: str | None = None) -> subprocess.Popen:
    """A process that holds the run's trainer lock as launch.sh does (and records itself as the holder)."""
    script = (f'exec 9>>"{run_dir}/trainer.lock"; flock -n 9; '
              f'"{sys.executable}" -m trainctl.core.rundir hold "{run_dir}" $$; sleep 60; true')
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    holder = run_dir / "trainer.json"
    wait_for(lambda: holder.is_file() and json.loads(holder.read_text() or "{}").get("pid") == proc.pid,
             "the holder to record itself", timeout=10, proc=proc)
    if start is not None:
        holder.write_text(json.dumps({**json.loads(holder.read_text()), "pid_start": start}))
    return proc


@pytest.fixture
def local_launch(tmp_path):
    run_dir = make_run(tmp_path / "runs", "live", launch={})
    proc = hold_lock(run_dir)
    yield run_dir, proc
    end_group(proc)


def end_group(proc: subprocess.Popen) -> None:
    """The holder and its `sleep` (a cancel ends only the holder, whose pid the run recorded)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.cli
def test_running_local_launch_is_seen_and_cancelled(local_launch):
    run_dir, proc = local_launch
    state = runs.run_state(run_dir)
    assert (state.state, state.active, state.launcher) == ("RUNNING", True, "local")
    assert f"pid {proc.pid}" in state.detail
    assert runs.cancel(run_dir).state == "RUNNING"
    assert proc.wait(timeout=10) == -15  # SIGTERM to the holder


@pytest.mark.cli
def test_cancel_never_signals_a_reused_pid(tmp_path):
    run_dir = make_run(tmp_path / "runs", "live", launch={})
    proc = hold_lock(run_dir, start="another-boot:12345")  # the recorded process is not the one alive under that pid
    try:
        with pytest.raises(LaunchError, match="not a process on this machine"):
            runs.cancel(run_dir)
        assert proc.poll() is None
    finally:
        end_group(proc)


def test_slurm_cancel_calls_scancel_and_refuses_finished_runs(tmp_path, slurm_bin):
    write_exe(slurm_bin / "squeue", 'echo "51|RUNNING|None|node1"\n')
    runs.cancel(make_run(tmp_path / "runs", "a", launch={"launcher": "slurm", "job_id": "51"}))
    assert (tmp_path / "scancel_args").read_text().split() == ["51"]
    write_exe(slurm_bin / "squeue", 'echo "52|COMPLETED|None|node1"\n')
    with pytest.raises(LaunchError, match="not active \\(COMPLETED"):
        runs.cancel(make_run(tmp_path / "runs", "b", launch={"launcher": "slurm", "job_id": "52"}))


def test_scancel_refusal_is_reported(tmp_path, slurm_bin):
    write_exe(slurm_bin / "squeue", 'echo "61|RUNNING|None|node1"\n')
    write_exe(slurm_bin / "scancel",
              'echo "scancel: error: Kill job error on job id 61: Access/permission denied" >&2; exit 1\n')
    with pytest.raises(LaunchError, match="Access/permission denied"):
        runs.cancel(make_run(tmp_path / "runs", "a", launch={"launcher": "slurm", "job_id": "61"}))


def test_log_path_picks_the_newest_attempt_of_a_slurm_run(tmp_path):
    run_dir = make_run(tmp_path / "runs", "a", launch={"launcher": "slurm", "job_id": "71"})
    logs = run_dir / "logs"
    assert runs.log_path(run_dir, None) == logs / "slurm-71.0.out"  # not there yet: what will come
    (logs / "slurm-71.out").write_text("batch\n")
    assert runs.log_path(run_dir, None) == logs / "slurm-71.out"  # the script's own output until srun starts
    (run_dir / "slurm-attempts.jsonl").write_text(
        '{"event": "start", "job_id": "71", "attempt": 0}\n{"event": "start", "job_id": "71", "attempt": 1}\n')
    (logs / "slurm-71.1.out").write_text("attempt 1\n")
    assert runs.log_path(run_dir, None) == logs / "slurm-71.1.out"
    assert runs.log_path(run_dir, 3) == logs / "rank3.log"
    local_run = make_run(tmp_path / "runs", "b", launch={"launcher": "local"})
    assert runs.log_path(local_run, None) == tmp_path / "runs" / "b" / "logs" / "rank0.log"


def test_follow_copies_a_growing_log_and_stops_when_the_run_ends(tmp_path):
    log = tmp_path / "x.log"
    ended = threading.Event()

    def writer():
        for i in range(5):
            with log.open("a") as f:
                f.write(f"line {i}\n")
            time.sleep(0.05)
        ended.set()

    sink = io.BytesIO()
    thread = threading.Thread(target=writer)
    thread.start()
    runs.follow(lambda: log, lambda: not ended.is_set(), sink, poll_s=0.02)
    thread.join()
    assert sink.getvalue().decode().splitlines() == [f"line {i}" for i in range(5)]


def test_find_and_list_runs(tmp_path):
    a, b = make_run(tmp_path / "runs", "a"), make_run(tmp_path / "runs", "b")
    (tmp_path / "runs" / ".a.tmp").mkdir()
    assert runs.find_run("a", tmp_path / "runs") == a.resolve()
    assert runs.find_run(str(b), tmp_path / "elsewhere") == b.resolve()
    assert [p.name for p in runs.list_runs(tmp_path / "runs")] == ["a", "b"]
    with pytest.raises(LaunchError, match="no run 'c'"):
        runs.find_run("c", tmp_path / "runs")


@pytest.mark.parametrize("name", ["a b", "a\nb", "tab\there", "x\x1b[2J"])
def test_run_names_refuse_whitespace_and_control_characters(name):
    with pytest.raises(LaunchError):
        check_name(name)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter (tests.helpers.run_cli); its report on torch and wandb as a last stderr line."""
    proc = run_cli(*args, cwd=cwd, timeout=60)
    heavy = proc.probe["heavy"] if proc.probe else "(no report: the CLI crashed)"
    proc.stderr += f"\nheavy: {heavy}\n"
    return proc


@pytest.mark.cli
def test_cli_runs_status_logs_cancel_without_torch(tmp_path):
    run_dir = make_run(tmp_path / "runs", "done", launch={"launcher": "local", "pid": 1, "host": "h", "exit_code": 0})
    (run_dir / "logs" / "rank0.log").write_text("hello from rank 0\n")
    listing = cli("runs", cwd=tmp_path)
    assert listing.returncode == 0 and "done" in listing.stdout and "COMPLETED" in listing.stdout
    assert "heavy: []" in listing.stderr
    assert "COMPLETED" in cli("status", "done", cwd=tmp_path).stdout
    assert cli("logs", "done", cwd=tmp_path).stdout == "hello from rank 0\n"
    refusals = ((["cancel", "done"], "not active (COMPLETED"), (["status", "nope"], "no run 'nope'"),
                (["logs", "done", "--rank", "5"], "rank5.log does not exist"))
    for args, fragment in refusals:
        done = cli(*args, cwd=tmp_path)
        errors = [line for line in done.stderr.splitlines() if not line.startswith("heavy:")]
        assert done.returncode == 2 and len(errors) == 1 and fragment in errors[0], done.stderr


def test_an_unreachable_controller_is_said_not_a_forgotten_job(tmp_path, slurm_bin):
    write_exe(slurm_bin / "squeue",
              'echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2; exit 1\n')
    state = runs.run_state(make_run(tmp_path / "runs", "a", launch={"launcher": "slurm", "job_id": "71"}))
    assert state.state == "UNKNOWN" and "unreachable" in state.detail and "no longer knows" not in state.detail
