"""Asking Slurm about jobs, and cancelling them: squeue, sacct, scancel.

squeue knows pending and running jobs, and finished ones for the controller's
MinJobAge (5 minutes by default); sacct knows them for longer but only where
accounting is configured. Whatever neither knows, the caller decides from the run
directory (see `state_from_records` in this folder's __init__).

A controller (or accounting database) that does not answer is not a job Slurm forgot:
the queries raise `SlurmUnavailable` for it, after a short timeout, so that `trainctl runs`
says so at once instead of hanging and then calling every job gone.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass

from trainctl.launch.errors import LaunchError

# squeue answers in well under a second when slurmctld is up; its own retries take ~18 s when it is not.
QUERY_TIMEOUT_S = 5
CANCEL_TIMEOUT_S = 15
# What Slurm's clients print when slurmctld or slurmdbd cannot be reached.
UNREACHABLE_RE = re.compile(
    r"unable to contact|connect(ion)? failure|connection refused|timed out|problem talking to the database"
    r"|zero bytes were transmitted|unable to connect|communication connection failure|no route to host",
    re.IGNORECASE,
)
UNREACHABLE = "Slurm controller unreachable"  # how SlurmUnavailable's message starts when nobody answered
# States in which the job may still run (or run again); everything else is final.
ACTIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
     "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}
)


@dataclass(frozen=True)
class JobInfo:
    """What Slurm says about one job."""

    job_id: str
    state: str  # Slurm's name: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    reason: str = ""  # why it waits, or why it ended
    nodes: str = ""
    exit_code: str = ""  # sacct's "code:signal", when sacct answered

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


class SlurmUnavailable(LaunchError):
    """Slurm did not answer (controller or accounting unreachable, a timeout): nothing is known about the jobs."""


def _reason(done: subprocess.CompletedProcess) -> str:
    return " ".join(done.stderr.split()) or f"exit code {done.returncode}"


def _run(argv: list[str], timeout_s: float | None = None) -> subprocess.CompletedProcess | None:
    """Run a Slurm client; None when it is not installed; SlurmUnavailable when it does not answer in time."""
    timeout_s = QUERY_TIMEOUT_S if timeout_s is None else timeout_s
    if shutil.which(argv[0]) is None:
        return None
    try:
        # Its own session, so that a timeout kills wrappers' children too (they would hold the pipes open).
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as exc:
        raise SlurmUnavailable(f"{UNREACHABLE}: cannot run {argv[0]} ({exc.strerror or exc})") from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        reason = f"{argv[0]} did not answer within {timeout_s:g} s"
        raise SlurmUnavailable(f"{UNREACHABLE}: {reason}") from None
    done = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    if done.returncode != 0 and UNREACHABLE_RE.search(done.stderr):
        raise SlurmUnavailable(f"{UNREACHABLE}: {argv[0]}: {_reason(done)}")
    return done


def query_squeue(job_ids: list[str]) -> dict[str, JobInfo]:
    """Jobs the controller still holds, finished ones included (`--states=all`); raises SlurmUnavailable."""
    if not job_ids:
        return {}
    # --array: one line per array task (a sweep's point is task JOB_I), also while the whole array is pending.
    done = _run(["squeue", "--noheader", "--array", "--states=all", f"--jobs={','.join(job_ids)}",
                 "--format=%i|%T|%r|%N"])
    if done is None:
        return {}
    if done.returncode != 0:
        # A list of only unknown ids fails with "Invalid job id specified"; that just means "not known".
        if "invalid job id" in done.stderr.lower():
            return {}
        raise SlurmUnavailable(f"Slurm query failed: squeue: {_reason(done)}")
    infos = {}
    for line in done.stdout.splitlines():
        job_id, state, reason, nodes = (line.split("|") + ["", "", "", ""])[:4]
        reason = "" if reason == "None" else reason.strip()
        infos[job_id.strip()] = JobInfo(job_id.strip(), state.strip(), reason, nodes.strip())
    return infos


def query_sacct(job_ids: list[str]) -> dict[str, JobInfo]:
    """Jobs from the accounting database; empty where accounting is disabled; SlurmUnavailable if it does not answer."""
    if not job_ids:
        return {}
    done = _run(["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={','.join(job_ids)}",
                 "--format=JobID,State,NodeList,ExitCode"])
    if done is None or done.returncode != 0:
        return {}
    infos = {}
    for line in done.stdout.splitlines():
        job_id, state, nodes, exit_code = (line.split("|") + ["", "", "", ""])[:4]
        # "CANCELLED by 0" -> CANCELLED
        infos[job_id] = JobInfo(job_id, state.split()[0] if state else "UNKNOWN", "", nodes, exit_code)
    return infos


def job_infos(job_ids: list[str]) -> dict[str, JobInfo]:
    """squeue first (current), then sacct for the jobs squeue has forgotten; raises SlurmUnavailable."""
    infos = query_squeue(job_ids)
    missing = [j for j in job_ids if j not in infos]
    return {**infos, **query_sacct(missing)}


def query_jobs(job_ids: list[str]) -> tuple[dict[str, JobInfo], str]:
    """`job_infos`, and "" or why Slurm could not be asked ("Slurm controller unreachable: ...").

    With a reason, the empty dict means "unknown", never "Slurm no longer knows these jobs".
    """
    try:
        return job_infos(job_ids), ""
    except SlurmUnavailable as exc:
        return {}, str(exc)


def slurm_available() -> bool:
    return shutil.which("squeue") is not None


def cancel_job(job_id: str) -> None:
    """scancel the job; its stderr becomes the error message when Slurm refuses."""
    done = _run(["scancel", job_id], timeout_s=CANCEL_TIMEOUT_S)
    if done is None:
        raise LaunchError(f"cannot cancel Slurm job {job_id}: scancel was not found on PATH; "
                          "run this on a Slurm login node")
    if done.returncode != 0:
        raise LaunchError(f"scancel {job_id} failed: {_reason(done)}")
