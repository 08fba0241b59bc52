"""How a worker rank's process starts and ends, whether torchrun exec'd it or trainctl's agent forked it
(cluster.rank_start; train/agent.py). Free of torch: it runs before torch is imported.

- Before torch: the CUDA allocator's default (`allocator_defaults`), in the worker and in the agent alike.
- A forked rank first becomes what a new interpreter would be (`as_new_rank`): the agent's signal handlers
  (torchrun's, which raise in the agent's main thread), its exit handlers and its process name are not the rank's.
- The end (`end_rank`): without the interpreter's teardown of torch's modules (core/lean_process.py), except a forked
  rank's success, which returns to torchrun's wrapper: it reports a return value for every rank, and waits for all of
  them, before any rank may exit.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

from trainctl.core.lean_process import exit_now

# Set by the agent to its own pid: a process whose parent is that pid is one of its forked ranks (a rank's own
# children, e.g. Inductor's compile workers, inherit the variable but not the parent).
AGENT_PID_ENV = "TRAINCTL_RANK_AGENT_PID"
_PR_SET_NAME = 15

ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the older name, and torch's newer one
ALLOC_CONF_DEFAULT = "expandable_segments:True"


def allocator_defaults(env: dict = os.environ) -> None:
    """Expandable segments for the CUDA caching allocator, unless the user configured it.

    A large model runs near the device's capacity, where fixed-size segments fragment: expandable ones
    grow in place. Set before torch is imported (the allocator reads it at its first CUDA allocation).
    """
    if not any(env.get(name) for name in ALLOC_CONF_ENVS):
        env[ALLOC_CONF_ENVS[0]] = ALLOC_CONF_DEFAULT


def is_forked_rank() -> bool:
    """Whether this process is a rank forked by this agent (not a worker started by plain torchrun)."""
    return os.environ.get(AGENT_PID_ENV) == str(os.getppid())


def as_new_rank() -> None:
    """In a forked rank, before the worker runs: the signal dispositions and exit handlers of a new interpreter.

    The agent's handlers raise in the agent's main thread (torchrun's shutdown), which in a rank would turn a
    SIGHUP or an early SIGTERM into an exception instead of the default end. Its exit handlers (weakref finalizers
    of its own objects among them) are its own, not the rank's; logging's shutdown is everyone's.
    """
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    atexit._clear()
    atexit.register(logging.shutdown)
    name_process(Path(sys.executable).name)  # not torchrun's "pt_elastic", which the fork inherited


def name_process(name: str) -> None:
    """The process's name as `ps`, `top` and `pgrep` show it (Linux: prctl PR_SET_NAME, 15 bytes); else nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def end_rank(code: int) -> None:
    """The end of `python -m trainctl.train`: exit now (core/lean_process.py), except a forked rank's success,
    which returns to torchrun's wrapper (it reports the rank's return value, then the rank exits without the
    interpreter's teardown); a failure exits with its code, which torchrun reads as the rank's."""
    if code == 0 and is_forked_rank():
        atexit._run_exitfuncs()
        return
    exit_now(code)
