"""Worker entry point: `python -m trainctl.train RUN_DIR` (under torchrun, or alone as a world of one), or this
file run in a rank that trainctl.train.agent forked (cluster.rank_start=fork: the same code, started forked).

Reads only the run directory. Every rank logs to RUN_DIR/logs/rank{R}.log. How a worker ends:
- done: exit 0;
- stopped on request (a signal; see stop.py): a checkpoint of the step it stopped at, then 128 + the signal;
- failed: one line on stderr (the console), the traceback of an unexpected error in the rank's log once,
  and torchelastic's error file (TORCHELASTIC_ERROR_FILE, set by torchrun per worker) holding the same
  line, the rank and the exact time, from which the launcher names the first rank that failed
  (launch/backends/local/failure.py). Exit 2 for what the user can fix in the run directory, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
import sys
import time
from pathlib import Path

from trainctl.core import rundir
from trainctl.core.lean_process import imports_without_gc
from trainctl.train.errors import EXIT_CONFIG, EXIT_FAILURE, WorkerError, storage_line
from trainctl.train.rank_process import allocator_defaults, as_new_rank, end_rank, is_forked_rank

log = logging.getLogger("trainctl.train")

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_MESSAGE_CHARS = 2000


class _OneLineFormatter(logging.Formatter):
    """For the console: the message only, never a traceback (the rank's log has it)."""

    def format(self, record: logging.LogRecord) -> str:
        plain = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None, "stack_info": None})
        return super().format(plain)


def setup_logging(run_dir: Path, rank: int) -> Path:
    """Every rank to logs/rank{R}.log; warnings and errors also to stderr, one line each (torchrun adds the rank)."""
    logs = run_dir / rundir.LOGS
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"rank{rank}.log"
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    to_file = logging.FileHandler(path)
    to_file.setFormatter(fmt)
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setLevel(logging.WARNING)
    to_stderr.setFormatter(_OneLineFormatter("%(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(to_file)
    root.addHandler(to_stderr)
    logging.captureWarnings(True)
    # A crash in C (segfault, abort) dumps every thread's stack into the rank's log, not onto the console.
    faulthandler.enable(file=to_file.stream, all_threads=True)
    return path


def one_line(err: BaseException, user_error: bool) -> str:
    """A user error's own message; for anything else `Type: message`. Whitespace folded, length bounded."""
    text = " ".join(str(err).split())
    line = text if user_error and text else f"{type(err).__name__}: {text}" if text else type(err).__name__
    return line if len(line) <= _MESSAGE_CHARS else line[: _MESSAGE_CHARS - 3] + "..."


def write_error_file(message: str, exit_code: int, log_path: Path | None) -> None:
    """torchelastic's error file, as its ErrorHandler writes it, minus the traceback: torchrun prints the file's
    traceback (py_callstack) in its summary on the console, and without one it prints the message.

    Our own fields carry what torchelastic's do not: the global rank, the time to the microsecond (its timestamp
    is whole seconds: two ranks failing in the same second would tie), the exit code, and the attempt.
    """
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    now = time.time()
    data = {
        "message": {"message": message, "extraInfo": {"timestamp": str(int(now))}},
        rundir.ERROR_FILE_KEY: {
            "rank": int(os.environ.get("RANK", 0)),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "exit_code": exit_code,
            "time": now,
            "host": socket.gethostname(),
            "log": str(log_path) if log_path else "",
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID", ""),
            "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
            "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
        },
    }
    with contextlib.suppress(OSError, ValueError):  # the exit code still says it failed
        rundir.write_json_atomic(Path(path), data)


def fail(message: str, exit_code: int, log_path: Path | None) -> int:
    """A failure that happened before logging was set up: stderr and the error file."""
    print(message, file=sys.stderr, flush=True)
    write_error_file(message, exit_code, log_path)
    return exit_code


def main(argv: list[str]) -> int:
    allocator_defaults()
    if len(argv) != 1:
        return fail("usage: python -m trainctl.train RUN_DIR", EXIT_CONFIG, None)
    run_dir = Path(argv[0]).resolve()
    if not rundir.is_run_dir(run_dir):
        message = f"{run_dir}: not a run directory (no {rundir.CONFIG}); create one with `trainctl launch`"
        return fail(message, EXIT_CONFIG, None)
    expected = os.environ.get(rundir.RUN_DIR_ENV)
    if expected and Path(expected).resolve() != run_dir:
        # launch.sh names the directory it found itself in; training anywhere else would write another run.
        message = (f"{run_dir}: the launch script runs from {expected}; "
                   f"relaunch with {expected}/{rundir.SCRIPT} or `trainctl resume`")
        return fail(message, EXIT_CONFIG, None)
    rank = int(os.environ.get("RANK", 0))
    try:
        log_path = setup_logging(run_dir, rank)
    except OSError as exc:
        return fail(f"{run_dir / rundir.LOGS}: cannot write the rank's log ({exc.strerror})", EXIT_CONFIG, None)
    try:
        return run_worker(run_dir, rank, log_path)
    except BaseException as err:  # outside run_worker's own handling (a signal before it was set up): still one line
        return report(err, log_path)[0]


def report(err: BaseException, log_path: Path | None) -> tuple[int, str]:
    """Log a failure and write the error file; (exit code, its one-line message)."""
    code, message = failed(err)
    if code != 0 and message:
        write_error_file(message, code, log_path)
    return code, message


def run_worker(run_dir: Path, rank: int, log_path: Path) -> int:
    """The exit code; a failure is reported (log, stderr, error file) the moment it reaches the top."""
    from trainctl.train.loop.stop import StopRequest, die_with_parent

    die_with_parent()  # first: a torchrun killed from now on takes this worker along
    # Which machine each rank ran on: the first thing to know when one node misbehaves.
    log.info("rank %s of %s on host %s, pid %d", rank, os.environ.get("WORLD_SIZE", 1), socket.gethostname(),
             os.getpid())
    try:
        from trainctl.config.load import load_run_config

        cfg = load_run_config(run_dir)
    except Exception as err:
        message = f"{run_dir / rundir.CONFIG} does not load ({one_line(err, False)}); launch the run again"
        log.error("%s", message)
        write_error_file(message, EXIT_CONFIG, log_path)
        return EXIT_CONFIG
    stop = StopRequest(cfg.cluster.stop_signal)
    reported: list[tuple[int, str]] = []  # by the trainer, before it closes the process group
    try:
        stop.install()
        if rank == 0:
            rundir.clear_stop(run_dir)  # a new attempt: an earlier stop no longer describes the run
        # Imported after logging is set up: torch import warnings land in the rank's log.
        with imports_without_gc():
            from trainctl.train.loop.hooks import hooks_from_env
            from trainctl.train.loop.trainer import run

        summary = run(cfg, run_dir, stop, on_error=lambda exc: reported.append(report(exc, log_path)),
                      hooks=hooks_from_env())
    except BaseException as err:
        return reported[0][0] if reported else report(err, log_path)[0]
    # The stop handlers stay until the process exits: torchrun's SIGTERM to a failed rank's peers must not
    # replace the exit code they chose (a default handler would end them as killed by SIGTERM).
    return stop.exit_code if summary["stopped"] else 0


def failed(err: BaseException) -> tuple[int, str]:
    """Log a failure: a user error as its one line, anything else with its traceback (in the log only)."""
    if isinstance(err, KeyboardInterrupt):  # Ctrl-C before the stop handlers were installed: nothing trained yet
        log.warning("SIGINT received before training started: exiting")
        return 130, ""
    if isinstance(err, SystemExit):
        code = err.code if isinstance(err.code, int) else EXIT_FAILURE
        return code, "" if code == 0 else f"exited with code {code}"
    if isinstance(err, WorkerError):  # its message says what happened and what to do: no traceback
        message = one_line(err, True)
        log.error("%s", message)
        return err.exit_code, message
    if storage := storage_line(err):  # the machine refused a write: what to change, not an errno
        log.error("training failed: %s", storage, exc_info=err)
        return EXIT_FAILURE, storage
    message = one_line(err, False)
    log.error("training failed: %s", message, exc_info=err)
    return EXIT_FAILURE, message


if __name__ == "__main__":
    # Started by plain torchrun (or alone), or forked by trainctl.train.agent (cluster.rank_start=fork): a forked
    # rank first drops the agent's signal and exit handlers (train/rank_process.py). Either way the end skips the
    # teardown of torch's modules.
    if is_forked_rank():
        as_new_rank()
    end_rank(main(sys.argv[1:]))
