"""A local run's state from its own records, and stopping the trainer that holds its lock.

The trainer lock says whether something trains there now (and trainer.json who); result.json that it finished;
stopped.json that it stopped on request with a checkpoint; launch.json the launcher's outcome otherwise (exit
code, first failing rank). A run directory with none of these was written by `launch --dry-run`, never started.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from trainctl.core import rundir, trainer_lock
from trainctl.launch import backends
from trainctl.launch.errors import LaunchError


def stopped_detail(stop: dict) -> str:
    step = rundir.as_int(stop.get("step"))
    at = f" at step {step}" if step is not None else ""
    signal_name = rundir.as_str(stop.get("signal"), "a signal")
    return f"stopped by {signal_name}{at}, checkpoint saved; `trainctl resume` continues"


def failure_detail(record: dict) -> str:
    code = rundir.as_int(record.get("exit_code"))
    failure = record.get("failure") if isinstance(record.get("failure"), dict) else {}
    rank, message = rundir.as_int(failure.get("rank")), rundir.as_str(failure.get("message"))
    parts = [f"exit code {code}" if code is not None else "no exit code recorded"]
    if rundir.as_str(failure.get("reason")) == "hang":  # the message names the ranks and their stack files
        parts.append(f"hung: {message[:300]}")
    elif rank is not None:
        parts.append(f"rank {rank} failed first" + (f": {message.splitlines()[0][:200]}" if message.strip() else ""))
    return ", ".join(parts)


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError, ValueError):
        return False


def local_state(run_dir: Path, record: dict) -> tuple[str, bool, str]:
    """(state, active, detail) of a run on this machine, from its lock and records (never from a pid alone)."""
    holder = trainer_lock.lock_holder(run_dir)
    if holder is not None:
        return "RUNNING", True, trainer_lock.describe_holder(holder)
    if rundir.result(run_dir) is not None:
        return "COMPLETED", False, ""
    stop = rundir.stop_record(run_dir)
    if stop:
        return "CANCELLED", False, stopped_detail(stop)
    recorded_dir = rundir.as_str(record.get("run_dir"))
    if recorded_dir and not _same_dir(Path(recorded_dir), run_dir):
        return "UNKNOWN", False, f"copied or moved from {recorded_dir}; `trainctl resume` trains it here"
    code = rundir.as_int(record.get("exit_code"))
    if code == 0:
        return "COMPLETED", False, ""  # the launcher records 0 only for a run that wrote its result
    if code is not None or rundir.as_str(record.get("state")) == "FAILED":
        return "FAILED", False, failure_detail(record)
    if record:
        return "UNKNOWN", False, "the launcher ended without recording an outcome (killed?)"
    if rundir.metrics(run_dir, 4096):
        return "UNKNOWN", False, f"started (bash {rundir.SCRIPT}?) and ended without a result"
    return "NOT_STARTED", False, "written by --dry-run"


def cancel_holder(run_dir: Path) -> None:
    """SIGTERM the trainer that holds the run's lock, known by the pid, start time and host it recorded.

    Never by a pid alone (pids are reused) or by its command line. A holder that recorded a job of another
    backend (e.g. a Slurm script of a dry run submitted by hand) is cancelled through that backend.
    """
    holder = trainer_lock.lock_holder(run_dir) or {}
    for backend in backends.every():
        job = backend.holder_job(holder)
        if job:
            backend.cancel(run_dir, job)
            return
    if not trainer_lock.same_process(holder.get("pid"), holder.get("pid_start"), holder.get("host")):
        where = rundir.as_str(holder.get("host"), "another machine")
        raise LaunchError(f"run {run_dir.name} is trained by {trainer_lock.describe_holder(holder)}, which is not a "
                          f"process on this machine ({where} or not recorded); stop it there")
    try:
        # The trainer finishes its step, saves, and records the stop (a launcher forwards the signal to torchrun).
        os.kill(rundir.as_int(holder.get("pid")), signal.SIGTERM)
    except ProcessLookupError:
        pass  # ended between the check and the signal
