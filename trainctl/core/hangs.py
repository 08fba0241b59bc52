"""The hang watchdog's files: what a worker writes (train/loop/watchdog.py) and what the launcher reads back.

Each rank of each attempt (one start of the worker group by torchrun, within one launch or Slurm restart) owns

    RUN_DIR/logs/hangs/<run id>.s<slurm restart>.a<torchrun restart>.rank<R>.txt

Its first line is a JSON header (rank, host, pid, attempt, timeout) written when the watchdog is set up. If the
rank makes no progress for `train.hang_timeout_s`, Python's faulthandler appends every thread's stack, starting
with its own "Timeout (H:MM:SS)!" line, and ends the process. A rank that ends any other way removes its file, so
a file with the timeout line is a hang, one without it a process killed from outside (nothing to report).
Attempts are kept side by side: a restart never overwrites what the attempt before it dumped.

No torch here: the launcher imports this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainctl.core import rundir

FIRED = "Timeout ("  # how faulthandler.dump_traceback_later starts its dump
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_MAX_HEADER = 4096


@dataclass(frozen=True)
class Attempt:
    """One start of the worker group: torchrun's rendezvous id, the Slurm restart and torchrun's restart count."""

    run_id: str
    slurm_restart: int
    restart: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Attempt:
        return cls(run_id=env.get("TORCHELASTIC_RUN_ID", ""),
                   slurm_restart=rundir.as_int(env.get("SLURM_RESTART_COUNT"), 0),
                   restart=rundir.as_int(env.get("TORCHELASTIC_RESTART_COUNT"), 0))

    @property
    def label(self) -> str:
        run_id = _UNSAFE.sub("_", self.run_id)[:64] or "none"
        return f"{run_id}.s{self.slurm_restart}.a{self.restart}"


@dataclass(frozen=True)
class Hang:
    """A rank whose watchdog fired: it made no progress for timeout_s; its stacks are in `path`."""

    rank: int
    host: str
    attempt: Attempt
    timeout_s: float
    path: Path
    time: float  # when the dump was written (the file's mtime)


def header(rank: int, host: str, pid: int, attempt: Attempt, timeout_s: float) -> str:
    """The first line of a rank's hang file."""
    return json.dumps({"rank": rank, "host": host, "pid": pid, "run_id": attempt.run_id,
                       "slurm_restart": attempt.slurm_restart, "restart": attempt.restart,
                       "timeout_s": timeout_s}) + "\n"


def read_hang(path: Path) -> Hang | None:
    """The hang a file records; None when its watchdog never fired or the file is not one of ours."""
    try:
        with open(path, "rb") as f:
            first = f.readline(_MAX_HEADER).decode(errors="replace")
            fired = any(line.startswith(FIRED.encode()) for line in f)
        mtime = path.stat().st_mtime
    except OSError:
        return None
    try:
        head = json.loads(first)
    except ValueError:
        return None
    if not fired or not isinstance(head, dict) or rundir.as_int(head.get("rank")) is None:
        return None
    attempt = Attempt(rundir.as_str(head.get("run_id")), rundir.as_int(head.get("slurm_restart"), 0),
                      rundir.as_int(head.get("restart"), 0))
    return Hang(rank=rundir.as_int(head.get("rank")), host=rundir.as_str(head.get("host")), attempt=attempt,
                timeout_s=rundir.as_float(head.get("timeout_s"), 0.0), path=path, time=mtime)


def hangs(run_dir: Path, since: float | None = None) -> list[Hang]:
    """Every rank whose watchdog fired (dumped at or after `since`, a time.time(), when given), oldest first."""
    found = [h for h in map(read_hang, rundir.hang_files(run_dir)) if h is not None]
    if since is not None:
        found = [h for h in found if h.time >= since]
    return sorted(found, key=lambda h: (h.time, h.rank))


def newest_attempt_hangs(run_dir: Path, since: float | None = None) -> list[Hang]:
    """The hung ranks of the newest attempt that had any, by rank: what stopped the run."""
    found = hangs(run_dir, since)
    if not found:
        return []
    newest = found[-1].attempt
    return sorted((h for h in found if h.attempt == newest), key=lambda h: h.rank)


def restart_reasons(run_dir: Path, current: Attempt) -> list[dict]:
    """Why each earlier attempt of this torchrun ended, for result.json: "hang" with the ranks whose watchdog
    fired, or "failure" (a worker exited or was killed; its error file and log say why)."""
    by_restart: dict[int, list[int]] = {}
    for hang in hangs(run_dir):
        same = hang.attempt.run_id == current.run_id and hang.attempt.slurm_restart == current.slurm_restart
        if same and hang.attempt.restart < current.restart:
            by_restart.setdefault(hang.attempt.restart, []).append(hang.rank)
    reasons = []
    for restart in range(current.restart):
        ranks = sorted(set(by_restart.get(restart, [])))
        reasons.append({"attempt": restart, "reason": "hang", "ranks": ranks} if ranks
                       else {"attempt": restart, "reason": "failure"})
    return reasons


# ---------------------------------------------------------------- the Slurm batch shell's questions

REPEATS_TO_EXCLUDE = 2  # a node whose rank hung first in this many attempts of a job is excluded from its requeue


def first_hosts(run_dir: Path, run_id: str) -> dict[tuple[int, int], str]:
    """(Slurm restart, torchrun restart) -> the host of the rank whose watchdog fired first in that attempt of
    torchrun run `run_id` (the Slurm job id): the node that stopped first; its peers only waited on it."""
    first: dict[tuple[int, int], str] = {}
    for hang in hangs(run_dir):  # oldest first
        if hang.attempt.run_id == run_id and hang.host:
            first.setdefault((hang.attempt.slurm_restart, hang.attempt.restart), hang.host)
    return first


def hung_hosts(run_dir: Path, run_id: str, slurm_restart: int) -> list[str]:
    """The nodes that hung first in any torchrun attempt of this Slurm attempt."""
    found = first_hosts(run_dir, run_id)
    return sorted({host for (restart, _), host in found.items() if restart == slurm_restart})


def repeated_hosts(run_dir: Path, run_id: str) -> list[str]:
    """The nodes that hung first in at least REPEATS_TO_EXCLUDE attempts of the job: to be excluded."""
    counts: dict[str, int] = {}
    for host in first_hosts(run_dir, run_id).values():
        counts[host] = counts.get(host, 0) + 1
    return sorted(host for host, n in counts.items() if n >= REPEATS_TO_EXCLUDE)


def requeue_reasons(run_dir: Path, current: Attempt) -> list[dict]:
    """Why each earlier Slurm attempt of this job ended, for result.json: "hang" with the nodes that hung first,
    or "requeue" (preemption, a node failure, an operator's requeue). Slurm keeps the job id, torchrun's run id."""
    found = first_hosts(run_dir, current.run_id)
    reasons = []
    for restart in range(current.slurm_restart):
        hosts = sorted({host for (slurm_restart, _), host in found.items() if slurm_restart == restart})
        reasons.append({"attempt": restart, "reason": "hang", "hosts": hosts} if hosts
                       else {"attempt": restart, "reason": "requeue"})
    return reasons


def main(argv: list[str]) -> int:
    """`python -m trainctl.core.hangs hung RUN_DIR JOB_ID SLURM_RESTART | repeated RUN_DIR JOB_ID`: the hosts,
    comma-separated (Slurm's node list syntax) on stdout, exit 0; exit 1 when there are none."""
    if len(argv) == 4 and argv[0] == "hung":
        hosts = hung_hosts(Path(argv[1]), argv[2], rundir.as_int(argv[3], 0))
    elif len(argv) == 3 and argv[0] == "repeated":
        hosts = repeated_hosts(Path(argv[1]), argv[2])
    else:
        print("usage: python -m trainctl.core.hangs hung RUN_DIR JOB_ID SLURM_RESTART | repeated RUN_DIR JOB_ID")
        return 2
    if hosts:
        print(",".join(hosts))
    return 0 if hosts else 1


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
