"""The trainer lock of a run directory and the identity of its holder: one process trains in a run at a time.

Separate from the layout and its tolerant readers (core/rundir.py) because this is the one part that holds OS
state (an flock'd descriptor, /proc identities) rather than reading files; rundir.py's `python -m` entry point,
which launch scripts call, runs this module's `main` (rundir.py never imports this module).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainctl.core.rundir import (
    HOLDER,
    LOCK,
    RESULT,
    as_int,
    as_str,
    open_regular,
    read_json,
    result,
    write_json_atomic,
)

# ---------------------------------------------------------------- process identity


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str:
    """A pid's start time in clock ticks since boot (/proc/PID/stat field 22), with the boot id; "" if gone.

    A pid is reused; (boot id, pid, start time) names one process for as long as the machine runs.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    return f"{boot_id()}:{fields[19]}" if len(fields) > 19 else ""


def same_process(pid, start, host) -> bool:
    """Whether the recorded (pid, start time, host) is a process alive on this machine now."""
    pid = as_int(pid)
    if not pid or pid <= 0 or not isinstance(start, str) or not start or host != socket.gethostname():
        return False
    return process_start(pid) == start


def identity(pid: int | None = None) -> dict:
    pid = pid or os.getpid()
    me = {"pid": pid, "host": socket.gethostname(), "pid_start": process_start(pid), "time": time.time()}
    if os.environ.get("SLURM_JOB_ID"):
        me["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return me


# ---------------------------------------------------------------- the trainer lock


class LockHeld(Exception):
    """Another process trains in this run directory; the message names it."""


def refusal(run_dir: Path) -> str:
    """The one line that refuses a second trainer, naming the first."""
    return (f"run {run_dir.name} is being trained by {describe_holder(read_json(run_dir / HOLDER))}; "
            f"wait for it, or `trainctl cancel {run_dir.name}` first")


def describe_holder(holder: dict) -> str:
    if not holder:
        return "another process (it has not recorded who it is)"
    job = as_str(holder.get("slurm_job_id"))
    who = f"pid {as_int(holder.get('pid'), 0)} on {as_str(holder.get('host'), '?')}"
    return f"Slurm job {job} ({who})" if job else who


@dataclass
class TrainerLock:
    """An exclusive flock on RUN_DIR/trainer.lock, held by one process and released when it exits.

    flock locks an open file description: it dies with the last process holding it (a crashed holder's lock
    is free again), children inherit it (torchrun and its workers keep it while the launcher waits), and on a
    shared filesystem it is coherent across nodes where the filesystem supports flock (NFSv4, Lustre, GPFS).
    """

    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def acquire(run_dir: Path, inheritable: bool = False) -> TrainerLock:
    """Take the run directory's trainer lock without waiting, or raise LockHeld naming the holder.

    Writes trainer.json (who holds it) once held. `inheritable`: keep the descriptor open across exec, so
    a script exec'd from the holder (launch.sh -> torchrun) keeps holding it.
    """
    run_dir = Path(run_dir)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LockHeld(f"{run_dir / LOCK} is not a regular file (something else was put there); remove it")
    os.set_blocking(fd, True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise LockHeld(refusal(run_dir)) from None
        raise
    os.set_inheritable(fd, inheritable)
    write_json_atomic(run_dir / HOLDER, identity())
    return TrainerLock(run_dir / LOCK, fd)


def lock_holder(run_dir: Path) -> dict | None:
    """Who trains in this run directory now (its trainer.json, possibly {}), or None when nobody holds the lock."""
    run_dir = Path(run_dir)
    lock = open_regular(run_dir / LOCK)  # a FIFO planted there must not block
    if lock is None:
        return None
    with lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return read_json(run_dir / HOLDER)
    return None


def main(argv: list[str]) -> int:
    """For launch scripts: `hold RUN_DIR PID` records PID as the lock's holder; `refusal RUN_DIR` names the holder;
    `completed RUN_DIR` exits 0 (saying so) when the run already finished."""
    if len(argv) == 3 and argv[0] == "hold":
        write_json_atomic(Path(argv[1]) / HOLDER, identity(int(argv[2])))
        return 0
    if len(argv) == 2 and argv[0] == "refusal":
        print(f"trainctl: {refusal(Path(argv[1]))}", file=sys.stderr)
        return 2
    if len(argv) == 2 and argv[0] == "completed":
        return 0 if said_completed(Path(argv[1])) else 1
    print("usage: python -m trainctl.core.rundir hold RUN_DIR PID | refusal RUN_DIR | completed RUN_DIR",
          file=sys.stderr)
    return 2


def said_completed(run_dir: Path) -> bool:
    """For launch scripts: a finished run (result.json) is not trained again, so its result is never rewritten;
    says so on stderr. Extending it is `trainctl resume NAME train.steps=N`."""
    if result(run_dir) is None:
        return False
    print(f"trainctl: run {run_dir.name} already finished (see {run_dir / RESULT}); nothing to train. "
          f"To train further: trainctl resume {run_dir.name} train.steps=N", file=sys.stderr)
    return True


if __name__ == "__main__":  # run as `python -m trainctl.core.rundir ...` (rundir.py forwards here)
    sys.exit(main(sys.argv[1:]))
