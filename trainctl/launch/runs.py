"""Runs after launch: find them, tell their state, pick and follow their logs, cancel them.

A run's state comes from what launched it:
  local  RUN_DIR/launch.json holds the launcher's pid and host while it runs, the exit code after;
  slurm  launch.json holds the job id; squeue/sacct say what Slurm knows, and the job's own
         RUN_DIR/slurm-attempts.jsonl (one line per attempt start and end) covers jobs Slurm forgot.
A run directory without launch.json was written by `launch --dry-run` and never started here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from omegaconf import OmegaConf

from trainctl.launch import slurm_jobs
from trainctl.launch.errors import LaunchError
from trainctl.launch.slurm import ATTEMPTS_FILE, attempt_log_name

TAIL_BYTES = 64 * 1024  # the end of metrics.jsonl that holds the last step
SIGNAL_EXIT_CODES = {128 + signal.SIGINT: "SIGINT", 128 + signal.SIGTERM: "SIGTERM"}


@dataclass(frozen=True)
class RunState:
    """One run as `trainctl runs` and `status` show it."""

    name: str
    path: Path
    launcher: str  # local | slurm | "" (never launched)
    state: str  # NOT_STARTED, PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ... (Slurm's names), UNKNOWN
    active: bool = False
    job_id: str = ""
    detail: str = ""  # nodes, pending reason, exit code, or why the state is unknown
    step: int | None = None  # last logged training step
    steps: int | None = None  # train.steps of the config


def find_run(ref: str, runs_dir: Path) -> Path:
    """A run directory given as a path or as a name under runs_dir."""
    for candidate in (Path(ref), runs_dir / ref):
        if (candidate / "config.yaml").is_file():
            return candidate.resolve()
    raise LaunchError(f"no run {ref!r}: neither {ref} nor {runs_dir / ref} is a run directory (with config.yaml); see `trainctl runs`")


def list_runs(runs_dir: Path) -> list[Path]:
    """Run directories under runs_dir, oldest first."""
    if not runs_dir.is_dir():
        return []
    found = [p for p in runs_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / "config.yaml").is_file()]
    return sorted(found, key=lambda p: (p.stat().st_mtime, p.name))


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def last_step(run_dir: Path) -> int | None:
    """The step of the last training record in metrics.jsonl (its tail only: the file can be long)."""
    path = run_dir / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # the first line of the tail may be cut, the last one half-written
        if record.get("kind") == "train" and "step" in record:
            return int(record["step"])
    return None


def configured_steps(run_dir: Path) -> int | None:
    try:
        return int(OmegaConf.load(run_dir / "config.yaml").train.steps)
    except Exception:  # a damaged config must not break listing the other runs
        return None


def pid_runs(pid: int, host: str, run_dir: Path) -> bool:
    """Whether `pid` on `host` is still this run's launch (bash, then torchrun, with RUN_DIR on its command line)."""
    if host != socket.gethostname():
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return str(run_dir) in cmdline


def local_state(run_dir: Path, record: dict) -> tuple[str, bool, str]:
    """(state, active, detail) of a local run from its launch.json."""
    if "exit_code" in record:
        code = int(record["exit_code"])
        if code == 0:
            return "COMPLETED", False, ""
        if code in SIGNAL_EXIT_CODES:
            return "CANCELLED", False, f"stopped by {SIGNAL_EXIT_CODES[code]}"
        return "FAILED", False, f"exit code {code}"
    pid, host = int(record.get("pid", 0)), str(record.get("host", ""))
    if pid and pid_runs(pid, host, run_dir):
        return "RUNNING", True, f"pid {pid}"
    if host and host != socket.gethostname():
        return "UNKNOWN", False, f"launched on {host}; ask there"
    return "UNKNOWN", False, "the launcher ended without recording an exit code (killed?)"


def attempt_records(run_dir: Path, job_id: str) -> list[dict]:
    try:
        lines = (run_dir / ATTEMPTS_FILE).read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if str(record.get("job_id")) == job_id:
            records.append(record)
    return records


def state_from_records(run_dir: Path, job_id: str, why: str) -> tuple[str, bool, str]:
    """A Slurm run's final state from what the job wrote, for jobs Slurm no longer reports."""
    records = attempt_records(run_dir, job_id)
    if records and records[-1].get("event") == "end":
        code = records[-1].get("exit_code")
        return ("COMPLETED", False, "") if code == 0 else ("FAILED", False, f"exit code {code}")
    if records:
        return "UNKNOWN", False, f"{why}; attempt {records[-1].get('attempt')} started but never recorded its end (cancelled or killed)"
    if (run_dir / "result.json").is_file():
        return "COMPLETED", False, ""
    return "UNKNOWN", False, why


def slurm_state(run_dir: Path, job_id: str, info: slurm_jobs.JobInfo | None) -> tuple[str, bool, str]:
    if info is not None:
        detail = info.reason if info.state == "PENDING" else ", ".join(x for x in (info.nodes, info.reason) if x)
        if info.exit_code and info.exit_code != "0:0":
            detail = ", ".join(x for x in (detail, f"exit {info.exit_code}") if x)
        return info.state, info.active, detail
    why = f"Slurm no longer knows job {job_id}" if slurm_jobs.slurm_available() else "squeue not found on PATH"
    return state_from_records(run_dir, job_id, why)


def run_states(run_dirs: list[Path]) -> list[RunState]:
    """The state of each run; one squeue (and at most one sacct) call for all the Slurm runs."""
    records = {d: read_json(d / "launch.json") for d in run_dirs}
    job_ids = [str(r["job_id"]) for r in records.values() if r.get("launcher") == "slurm" and r.get("job_id")]
    infos = slurm_jobs.job_infos(job_ids) if job_ids else {}
    states = []
    for run_dir, record in records.items():
        launcher, job_id = record.get("launcher", ""), str(record.get("job_id", ""))
        if launcher == "slurm":
            state, active, detail = slurm_state(run_dir, job_id, infos.get(job_id))
        elif launcher == "local":
            state, active, detail = local_state(run_dir, record)
        else:
            state, active, detail = ("COMPLETED", False, "") if (run_dir / "result.json").is_file() else ("NOT_STARTED", False, "written by --dry-run")
        states.append(RunState(run_dir.name, run_dir, launcher, state, active, job_id, detail, last_step(run_dir), configured_steps(run_dir)))
    return states


def run_state(run_dir: Path) -> RunState:
    return run_states([run_dir])[0]


def log_path(run_dir: Path, rank: int | None) -> Path:
    """The log to show: a rank's own log, else a Slurm job's newest attempt (workers' output), else rank 0's log."""
    if rank is not None:
        return run_dir / "logs" / f"rank{rank}.log"
    record = read_json(run_dir / "launch.json")
    if record.get("launcher") != "slurm":
        return run_dir / "logs" / "rank0.log"
    job_id = str(record.get("job_id"))
    attempts = [int(r.get("attempt", 0)) for r in attempt_records(run_dir, job_id)]
    attempt_log = run_dir / "logs" / attempt_log_name(job_id, max(attempts, default=0))
    batch_log = run_dir / "logs" / f"slurm-{job_id}.out"
    # Before srun starts only the batch log exists (and holds any error of the script's own lines).
    return attempt_log if attempt_log.exists() or not batch_log.exists() else batch_log


def follow(path_of: Callable[[], Path], still_active: Callable[[], bool], out: BinaryIO, poll_s: float = 0.5) -> None:
    """Copy a growing log to `out` until the run ends; switches files when a new attempt starts."""
    current, offset, quiet_polls = None, 0, 0
    while True:
        path = path_of()
        if path != current and path.exists():
            if current is not None:
                out.write(f"\n==> {path} <==\n".encode())
            current, offset = path, 0
        grew = False
        if current is not None:
            with current.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            if chunk:
                out.write(chunk)
                out.flush()
                offset += len(chunk)
                grew = True
        quiet_polls = 0 if grew else quiet_polls + 1
        # The state query costs a squeue call: ask only after a few quiet polls.
        if quiet_polls >= 4 and not still_active():
            return
        time.sleep(poll_s)


def cancel(run_dir: Path) -> RunState:
    """Stop an active run: scancel its job, or SIGTERM the local launch's process group. Returns the state before."""
    state = run_state(run_dir)
    if not state.active:
        raise LaunchError(f"run {state.name} is not active ({state.state}{': ' + state.detail if state.detail else ''}); nothing to cancel")
    if state.launcher == "slurm":
        slurm_jobs.cancel_job(state.job_id)
        return state
    pid = int(read_json(run_dir / "launch.json")["pid"])
    try:
        # The launch runs in its own session: this reaches bash/torchrun and, through torchrun, every worker.
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # ended between the check and the signal
    return state
