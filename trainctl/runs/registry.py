"""Runs after launch: find them, tell their state, pick and follow their logs, cancel them.

A run's state comes from its own records (read through trainctl.core.rundir, which never raises) and from the
backend its launch.json's `launcher` names (trainctl.launch.backends): each backend answers for its own runs
(state, log, cancel), all of them in one query where it can. A run directory with no launch record was written
by `launch --dry-run` and never started (the default backend tells).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from trainctl.core import rundir
from trainctl.launch import backends
from trainctl.launch.errors import LaunchError


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
    maybe_active: bool = False  # its backend could not be asked (e.g. the scheduler did not answer): it may still run


def find_run(ref: str, runs_dir: Path) -> Path:
    """A run directory given as a path or as a name under runs_dir."""
    for candidate in (Path(ref), runs_dir / ref):
        if rundir.is_run_dir(candidate):
            return candidate.resolve()
    raise LaunchError(f"no run {ref!r}: neither {ref} nor {runs_dir / ref} is a run directory (with {rundir.CONFIG}); "
                      "see `trainctl runs`")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def list_runs(runs_dir: Path) -> list[Path]:
    """Run directories under runs_dir, oldest first; none when it does not exist yet (no run was launched).

    A runs_dir that is a file or cannot be read is said in one line: an empty table would claim there are no runs.
    """
    try:
        entries = list(runs_dir.iterdir())
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise LaunchError(f"runs_dir {runs_dir}: a file, not a folder of runs; point --runs-dir (or "
                          "$TRAINCTL_RUNS_DIR, runs_dir=) at the folder the runs were launched into") from None
    except OSError as exc:
        raise LaunchError(f"runs_dir {runs_dir}: cannot be read ({exc.strerror or exc}); fix its permissions or "
                          "point --runs-dir at another folder") from None
    found = [p for p in entries if not p.name.startswith(".") and rundir.is_run_dir(p)]
    return sorted(found, key=lambda p: (_mtime(p), p.name))


def last_step(run_dir: Path) -> int | None:
    """The latest finished step: progress.json (every step) when it is ahead of the last training record
    in metrics.jsonl (every log_every steps; each step once, after resumes too)."""
    logged = rundir.as_int(rundir.last_train_record(run_dir).get("step"))
    live = rundir.progress_step(run_dir)
    if live is None or (logged is not None and live < logged):
        return logged
    return live


def configured_steps(run_dir: Path) -> int | None:
    return rundir.configured_steps(run_dir)


def run_states(run_dirs: list[Path]) -> list[RunState]:
    """The state of each run; each backend answers for its own runs at once (one squeue call for all on Slurm)."""
    records = {d: rundir.launch_record(d) for d in run_dirs}
    by_backend: dict[str, dict[Path, dict]] = {}
    for run_dir, record in records.items():
        by_backend.setdefault(backends.for_record(record).name, {})[run_dir] = record
    answers: dict[Path, backends.State] = {}
    for name, group in by_backend.items():
        answers.update({d: backends.State(*answer) for d, answer in backends.named(name).states(group).items()})
    states = []
    for run_dir, record in records.items():
        state, active, detail, maybe_active = answers[run_dir]
        launcher = rundir.as_str(record.get("launcher")) or (
            backends.for_record(record).name if state != "NOT_STARTED" else "")
        states.append(RunState(run_dir.name, run_dir, launcher, state, active, str(record.get("job_id", "")), detail,
                               last_step(run_dir), configured_steps(run_dir), maybe_active))
    return states


def run_state(run_dir: Path) -> RunState:
    return run_states([run_dir])[0]


def log_path(run_dir: Path, rank: int | None) -> Path:
    """The log to show: a rank's own log, else the one the run's backend names (its newest output)."""
    if rank is not None:
        return run_dir / "logs" / f"rank{rank}.log"
    record = rundir.launch_record(run_dir)
    return backends.for_record(record).log_path(run_dir, record)


FOLLOW_CHUNK = 1 << 20  # bytes copied per read: a huge log streams, it is never held whole


def follow(path_of: Callable[[], Path], still_active: Callable[[], bool], out: BinaryIO, poll_s: float = 0.5) -> bool:
    """Copy a growing log to `out` until the run ends; switches files when a new attempt starts.

    Returns whether a log was found at all. Only regular files are read (a FIFO there would block).
    """
    current, offset, quiet_polls = None, 0, 0
    while True:
        path = path_of()
        if path != current and path.is_file():
            if current is not None:
                out.write(f"\n==> {path} <==\n".encode())
            current, offset = path, 0
        grew = False
        f = rundir.open_regular(current) if current is not None else None
        if f is not None:
            with f:
                f.seek(offset)
                while chunk := f.read(FOLLOW_CHUNK):
                    out.write(chunk)
                    offset += len(chunk)
                    grew = True
            out.flush()
        quiet_polls = 0 if grew else quiet_polls + 1
        # The state query costs a squeue call: ask only after a few quiet polls.
        if quiet_polls >= 4 and not still_active():
            return current is not None
        time.sleep(poll_s)


def cancel(run_dir: Path) -> RunState:
    """Stop an active run through its backend (scancel on Slurm, SIGTERM to a local trainer); the state before."""
    state = run_state(run_dir)
    if not state.active:
        detail = f": {state.detail}" if state.detail else ""
        raise LaunchError(f"run {state.name} is not active ({state.state}{detail}); nothing to cancel")
    backends.for_record(rundir.launch_record(run_dir)).cancel(run_dir, state.job_id)
    return state
