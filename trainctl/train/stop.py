"""Stop requests: a signal asks the loop to checkpoint and exit at the next step boundary.

SIGTERM (torchrun forwards it to its workers when it is itself stopped; Slurm sends it at the
end) and the preemption signal (`cluster.preemption.signal`, SIGUSR2 by default: the early
warning the sbatch script asks Slurm for) only set a flag here: the loop agrees on it across ranks in the step's one all-reduce,
so every rank saves the same step and leaves together. SIGINT (Ctrl-C) keeps its default: stop now.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

log = logging.getLogger("trainctl.train")

TEST_STOP_ENV = "TRAINCTL_TEST_STOP_AFTER_STEP"  # tests: act as if a stop was requested after this step


class StopRequest:
    """A flag raised by STOP_SIGNALS; `requested` is this rank's view (the loop agrees across ranks)."""

    def __init__(self, preemption_signal: str = "SIGUSR2") -> None:
        self.preemption_signal = preemption_signal
        self.requested = False
        self.signal_name = ""
        self._previous = {}
        self._test_stop_after = int(os.environ.get(TEST_STOP_ENV, "-1"))

    def wanted(self, done: int) -> bool:
        """This rank's answer after `done` steps: a signal arrived (or the test hook's step is reached)."""
        return self.requested or done == self._test_stop_after

    @property
    def preempted(self) -> bool:
        """The stop came from the preemption warning (requeue), not a plain SIGTERM (e.g. scancel)."""
        return self.requested and self.signal_name == self.preemption_signal

    def install(self) -> None:
        for name in dict.fromkeys(("SIGTERM", self.preemption_signal)):
            sig = signal.Signals[name]
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: checkpointing at the end of this step, then stopping", self.signal_name)


def requeue_slurm_job() -> bool:
    """Put this Slurm job back in the queue (rank 0, after the stop checkpoint); False outside Slurm or on failure."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job, proc.stderr.strip())
        return False
    log.warning("Slurm job %s requeued: it resumes from the checkpoint just saved", job)
    return True
