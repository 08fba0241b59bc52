"""Processes a test leaves running: found, given a grace period, killed, and reported at the end of the run.

Every process a test starts inherits SESSION_ENV (set once in the pytest process), so /proc tells which live
processes belong to this run, even once they have left their parent (torchrun's workers in their own session).
A process that appeared during a dist, cli or slurm test and outlives it by LEAK_GRACE_S is a leak: left alone it
would hold the cores, a port or a lock for the tests that follow (an 8-worker test then ran 7x slower than alone).
Under pytest-xdist each worker marks its own session (its children carry the worker's value), so one worker never
takes another's torchrun for its leak.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

SESSION_ENV = "TRAINCTL_TEST_SESSION"
LEAK_GRACE_S = 30.0


def mark_session(own: bool = False) -> None:
    """Mark this process's session; `own` (an xdist worker) replaces the value inherited from the controller."""
    if own:
        os.environ[SESSION_ENV] = str(os.getpid())
    else:
        os.environ.setdefault(SESSION_ENV, str(os.getpid()))


def session_processes() -> dict[int, str]:
    """pid -> command line of every live process (but this one) carrying this run's SESSION_ENV."""
    marker = f"{SESSION_ENV}={os.environ.get(SESSION_ENV, '')}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended; its parent has yet to reap it


def leftovers(before: set[int], grace_s: float = LEAK_GRACE_S) -> dict[int, str]:
    """The processes started since `before` that are still alive after the grace period, killed."""
    deadline = time.monotonic() + grace_s
    while True:
        new = {pid: cmd for pid, cmd in session_processes().items() if pid not in before and _alive(pid)}
        if not new or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    for pid in new:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return new
