"""What a worker or a tool child that imports torch pays for being a process, kept to what it needs.

- Its imports, without the cyclic garbage collector (`imports_without_gc`): importing torch, DTensor and
  torch._dynamo allocates several hundred thousand objects that live as long as the process, and the collections
  those allocations trigger on the way find nothing to free (about 0.6 s of one core of a worker's 4 s of imports,
  2-core AMD EPYC).
- Its end, without the interpreter's teardown of every module (`exit_now`): after `main` returns, the interpreter
  joins the non-daemon threads, runs the atexit handlers (logging's shutdown flushes and closes every log file; W&B's),
  then tears down every module, which for torch's costs about 0.5 s of one core and writes nothing.

A launch of N ranks saves N of each; an eval, generate or export one (`python -m trainctl.core.lean_process MODULE
ARGS...`, how the api starts them: MODULE imported without the collector, then `MODULE.main(ARGS)`, then exit_now).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn


@contextlib.contextmanager
def imports_without_gc() -> Iterator[None]:
    """The block runs with automatic garbage collection off; it is back on after (if it was on before)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def exit_now(code: int | None) -> NoReturn:
    """End this process with `code` (None: 0) once its non-daemon threads have ended, its atexit handlers have run
    and stdout and stderr are flushed, skipping the teardown of its modules. Call it from the main thread. Files a
    program keeps open must be closed (or line-buffered) by then, as the worker's are: nothing is flushed at
    teardown that was not before."""
    try:
        # What the interpreter's exit does first, as it does it: the executors' exit hooks (a thread pool's idle
        # workers, e.g. Inductor's compile pool, end on them; joined without them, they would wait forever), then
        # every non-daemon thread joined.
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # closed, or a broken pipe: nothing more can be said
                pass
        os._exit(code or 0)


def run_module(module: str, argv: list[str]) -> NoReturn:
    """`python -m MODULE ARGV...` for a module with `main(argv) -> exit code`, its imports without the collector."""
    with imports_without_gc():
        entry = importlib.import_module(module)
    exit_now(entry.main(argv))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m trainctl.core.lean_process MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    run_module(sys.argv[1], sys.argv[2:])
