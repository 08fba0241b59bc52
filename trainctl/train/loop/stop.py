"""Stop requests: the first signal asks every rank to checkpoint and exit at the next step boundary.

How a stop reaches a worker: the launcher forwards Ctrl-C (SIGINT) or SIGTERM (`trainctl cancel`) to torchrun,
which forwards it to every worker and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT for them; Slurm sends SIGTERM at
the end and the preemption signal (`cluster.preemption.signal`, SIGUSR2 by default) as an early warning.

- The first SIGINT, SIGTERM or preemption signal only raises a flag: the loop agrees on it across ranks in
  the step's one all-reduce, so every rank saves the same step and leaves together (exit 128 + signal).
- A second SIGINT/SIGTERM stops the worker at once: no save, no traceback. On Slurm every process of the
  step gets the signal AND torchrun forwards its own copy, so a second one that follows the first within
  DUPLICATE_S is the same request, not a second one.
- Before the loop starts (setup) nothing is worth saving: the first signal stops the worker at once.

Signals are read by a thread from Python's wakeup fd, not by a Python-level handler: the handler runs only
when the main thread is back in the interpreter, which a worker blocked in a collective may never be.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time

log = logging.getLogger("trainctl.train")

_PR_SET_PDEATHSIG = 1


def exit_code_of(signal_name: str) -> int:
    """The shell's exit code of a process ended by this signal: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signal.Signals[signal_name].value


class StopRequest:
    """A flag raised by a stop signal (or a test's hook: `request`); `requested` is this rank's view (the loop
    agrees across ranks)."""

    DUPLICATE_S = 2.0  # a repeat within this many seconds is the same stop delivered twice (Slurm + torchrun)

    def __init__(self, preemption_signal: str = "SIGUSR2") -> None:
        self.preemption_signal = preemption_signal
        self.requested = False
        self.signal_name = ""
        self.armed = False  # True once the loop runs: a first signal then means "save and stop"
        self._first_at = 0.0
        self._previous: dict = {}
        self._previous_wakeup = -1
        self._pipe: tuple[int, int] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(("SIGINT", "SIGTERM", self.preemption_signal)))

    @property
    def preempted(self) -> bool:
        """The stop came from the preemption warning (requeue), not a plain SIGTERM (e.g. scancel)."""
        return self.requested and self.signal_name == self.preemption_signal

    @property
    def exit_code(self) -> int:
        """128 + the signal that asked for the stop; 0 for a stop no signal asked for."""
        return exit_code_of(self.signal_name) if self.signal_name else 0

    def install(self) -> None:
        """Catch the stop signals (main thread only): a thread reads them from the wakeup fd as they arrive."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd requires it
        self._pipe = (read_fd, write_fd)
        for name in self.names:
            sig = signal.Signals[name]
            # A Python-level handler is what makes the interpreter write the signal to the wakeup fd.
            self._previous[sig] = signal.signal(sig, _ignore)
        self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="stop-signals", daemon=True).start()

    def uninstall(self) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        os.close(self._pipe[1])  # the watcher's read sees EOF and ends
        self._pipe = None

    def _watch(self, read_fd: int) -> None:
        handled = {signal.Signals[name].value for name in self.names}
        while data := _read(read_fd):
            for signum in data:
                if signum in handled:
                    self.on_signal(signal.Signals(signum).name)
        os.close(read_fd)

    def request(self, signal_name: str = "", now: float | None = None) -> None:
        """Ask for a stop: this rank's flag, which the next step's agreement spreads to every rank (then all save
        that step and leave). A first stop signal calls it; so may a test's hook (hooks.py), with no signal
        name: such a stop exits 0 and records nothing."""
        self.requested, self.signal_name = True, signal_name
        self._first_at = time.monotonic() if now is None else now

    def on_signal(self, name: str, now: float | None = None) -> None:
        """React to one delivered stop signal (called by the watcher thread)."""
        now = time.monotonic() if now is None else now
        if not self.armed:
            self._exit_now(name, "before training started: nothing to save")
        if not self.requested:
            self.request(name, now)
            log.warning("%s received: checkpointing at the end of this step, then stopping "
                        "(a second SIGINT/SIGTERM stops at once, without a checkpoint)", name)
            return
        if name in ("SIGINT", "SIGTERM") and now - self._first_at > self.DUPLICATE_S:
            self._exit_now(name, "second stop signal: no checkpoint")

    def _exit_now(self, name: str, why: str) -> None:
        log.warning("%s received (%s): exiting now", name, why)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(exit_code_of(name))


def _ignore(signum, frame) -> None:
    """The Python-level half of a stop signal: the watcher thread does the work."""


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 64)
    except OSError:
        return b""


def die_with_parent() -> None:
    """Under torchrun on Linux: SIGKILL this worker when torchrun dies, so a killed torchrun takes its workers along.

    torchrun starts each worker in a session of its own: a SIGKILL of torchrun's process group (a second Ctrl-C)
    would otherwise leave them training, orphaned. If torchrun died before the call, exit at once. Not for a
    world of one started by hand: its parent is a shell, whose exit must not end the run.
    (The death signal follows the parent *thread*; torchrun starts its workers from its main thread.)
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0
    except (OSError, AttributeError):
        failed = True
    if failed:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: this worker may outlive a killed torchrun")
        return
    if parent == 1 or os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)  # orphaned already: as if the death signal had come


def requeue_slurm_job() -> bool:
    """Put this Slurm job back in the queue (rank 0, after the stop checkpoint); False outside Slurm or on failure."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    try:
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        # A container without Slurm's client: the job's batch shell requeues it after the workers exit.
        log.warning("scontrol requeue %s is not possible here (%s); the batch script requeues the job", job, exc)
        return False
    if proc.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job, proc.stderr.strip())
        return False
    log.warning("Slurm job %s requeued: it resumes from the checkpoint just saved", job)
    return True
