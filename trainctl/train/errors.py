"""Exceptions the worker raises for problems it reports as one line, no traceback (as opposed to our bugs).

Every such error subclasses WorkerError and carries the worker's exit code: `__main__` reads it from the error
(no table of error types there), so a new error chooses its code where it is defined. Nothing here imports
torch or another worker module: the exit path can still classify an error when those imports are what failed.
"""

EXIT_FAILURE = 1  # the run failed: a bug, a bad step, a checkpoint that cannot be saved
EXIT_CONFIG = 2  # the run directory asks for something the worker cannot do; the user fixes it there


class WorkerError(Exception):
    """A failure whose message is one line that says what happened and what to do; logged without a traceback."""

    exit_code = EXIT_FAILURE


class WorkerConfigError(WorkerError):
    """The run directory asks for something this worker cannot do; the message is one line naming the key."""

    exit_code = EXIT_CONFIG
