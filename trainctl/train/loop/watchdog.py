"""The hang watchdog: a rank that makes no progress for `train.hang_timeout_s` dumps every thread's stack and exits.

Setup is watched too (a stuck rendezvous of a subgroup, a checkpoint read that never returns), phase by phase,
except building the data: a first tokenization or cache build is long and has no progress points to re-arm at.

It is Python's own `faulthandler.dump_traceback_later`: a C thread that needs neither the GIL nor the stuck
thread, so a collective that never returns, a stuck read or a hook that sleeps forever are all caught. The loop
re-arms it at each point of progress (each step, each evaluation, each save, the final commit), so every one of
them gets a whole timeout; a slow save is not a hang unless it alone takes longer. When it fires, the process
exits with code 1 (faulthandler's `_exit(1)`): torchrun's agent sees a failed worker, stops the others and
restarts the group up to `cluster.max_restarts` times, and the restarted workers resume from the newest
committed checkpoint. The peers of a hung rank are blocked in its collective: their own timers fire too, so
every rank's stack is in the logs (core/hangs.py names the files and reads them back).

A normal end, a stop on request (Ctrl-C, SIGTERM: the step finishes and saves, progress as usual) and an error
all cancel the timer and remove the rank's file: only a hang leaves one with a stack in it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
from pathlib import Path

from trainctl.core import hangs, rundir

log = logging.getLogger("trainctl.train")


class HangWatchdog:
    """One rank's watchdog; `arm()` at each point of progress, `close()` at the end (always)."""

    def __init__(self, timeout_s: float, path: Path | None):
        self.timeout_s, self.path = timeout_s, path
        self._file = None

    @classmethod
    def for_rank(cls, timeout_s: float, run_dir: Path, rank: int, env=os.environ) -> HangWatchdog:
        """The rank's watchdog writing to its file of this attempt; one that does nothing when timeout_s is 0."""
        if timeout_s <= 0:
            return cls(0.0, None)
        attempt = hangs.Attempt.from_env(env)
        watchdog = cls(timeout_s, rundir.hang_file(run_dir, attempt.label, rank))
        watchdog.open(hangs.header(rank, socket.gethostname(), os.getpid(), attempt, timeout_s))
        return watchdog

    def open(self, header: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w")  # noqa: SIM115  (faulthandler writes to its descriptor until close())
        self._file.write(header)
        self._file.flush()

    def arm(self) -> None:
        """Progress: the stacks are dumped and the process ends unless arm() (or close()) comes within timeout_s."""
        if self._file is not None:
            faulthandler.dump_traceback_later(self.timeout_s, exit=True, file=self._file)

    def pause(self) -> None:
        """Unwatched until the next arm(): for work that is long by nature and has no progress to report."""
        if self._file is not None:
            faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        """Cancel the timer and remove the file: this rank ended without hanging."""
        if self._file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self._file.close()
        self._file = None
        with contextlib.suppress(OSError):
            self.path.unlink()


def restart_record(run_dir: Path, env=os.environ) -> dict:
    """result.json's account of torchrun's restarts of this launch and of the Slurm job's requeues (the batch shell
    requeues a job that hung past torchrun's restarts): how many of each, and why each attempt ended."""
    attempt = hangs.Attempt.from_env(env)
    return {"restarts": attempt.restart, "restart_reasons": hangs.restart_reasons(run_dir, attempt),
            "requeues": attempt.slurm_restart, "requeue_reasons": hangs.requeue_reasons(run_dir, attempt)}
