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


def storage_line(err: BaseException) -> str | None:
    """A write the machine refused (file size limit, full disk, quota) in one line that names the limit and the
    file; None for any other error. Python ignores SIGXFSZ, so `ulimit -f` shows up as EFBIG here."""
    import errno
    import resource

    if not isinstance(err, OSError) or err.errno not in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT):
        return None
    where = err.filename or "a file"
    if err.errno == errno.EFBIG:
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        limit = "" if soft == resource.RLIM_INFINITY else f" ({soft / 2**20:.1f} MiB, `ulimit -f`)"
        return (f"{where}: the write reached the file size limit{limit}; raise it (ulimit -f unlimited) in the "
                "shell or job script that starts the run")
    return f"{where}: {err.strerror}; free space (or quota) on that filesystem, or set runs_dir to a larger one"
