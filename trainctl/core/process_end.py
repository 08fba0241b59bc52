"""How a worker or a tool child that has imported torch ends: as the interpreter's exit ends a process, without its
teardown of every module.

After `main` returns, the interpreter joins the non-daemon threads, runs the atexit handlers (logging's shutdown,
which flushes and closes every log file; W&B's), then tears down every module, which for torch, DTensor and
torch._dynamo costs about 0.5 s of one core per process (2-core AMD EPYC) and writes nothing. `exit_now` does the
first three and ends there: a launch of N ranks saves N of those, an eval, generate or export one.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int | None) -> NoReturn:
    """End this process with `code` (None: 0) once its non-daemon threads have ended, its atexit handlers have run
    and stdout and stderr are flushed, skipping the teardown of its modules. Files a program keeps open must be
    closed (or line-buffered) by then, as the worker's are: nothing is flushed at teardown that was not before."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # closed, or a broken pipe: nothing more can be said
                pass
        os._exit(code or 0)
