"""torchrun whose ranks start with the worker already imported (`cluster.rank_start=fork`):

    python -m trainctl.train.agent TORCHRUN_OPTIONS... -m trainctl.train RUN_DIR

It is torchrun itself, `torch.distributed.run.main`: its option parsing, rendezvous, restarts, signal forwarding,
log capture, error files and summary, unchanged. What differs is how a rank starts. With plain torchrun each rank is
a new interpreter that imports torch, DTensor, dynamo and the worker's modules by itself (about 2.5 s of one core
each, a few seconds more on a shared file system, paid by every rank of every node at every start and restart).
Here the agent imports them once, then forks each rank from itself: torchrun's own `--start-method=fork` with its
`--run-path` entry, the worker's __main__.py run in the forked process as `python -m trainctl.train` would run it.

A forked rank must look like a new process to the worker: the agent's signal handlers (torchrun forwards SIGTERM,
SIGINT, SIGHUP, SIGQUIT and the preemption signal by raising in its own main thread) and its exit handlers are
dropped in the child before the worker runs, and the rank's success ends through torchrun's wrapper, which reports
a return value for every rank before any may exit (train/rank_process.py).

Fork is safe only where the agent has not initialised CUDA; on a CUDA device `cluster.rank_start=auto` keeps exec
(docs/run-directory.md: no GPU run has proven the fork yet) and this module refuses a run whose agent finds CUDA
initialised.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import NoReturn

from trainctl.core.lean_process import exit_now, imports_without_gc
from trainctl.train.rank_process import AGENT_PID_ENV, allocator_defaults

WORKER_MODULE = "trainctl.train"
WORKER_MAIN = Path(__file__).with_name("__main__.py")
# torchrun options that say how a rank starts: the agent's to set.
OWN_OPTIONS = ("--start-method", "--start_method", "--run-path", "--run_path", "-m", "--module", "--no-python",
               "--no_python")
USAGE = "usage: python -m trainctl.train.agent [TORCHRUN OPTIONS...] -m trainctl.train RUN_DIR"


def torchrun_argv(argv: list[str]) -> list[str]:
    """torchrun's own arguments for `OPTIONS... -m trainctl.train RUN_DIR`: the worker's __main__.py as a
    `--run-path` entry, forked (ValueError for anything else: this agent starts the trainctl worker only)."""
    if len(argv) < 3 or argv[-3:-1] != ["-m", WORKER_MODULE]:
        raise ValueError(USAGE)
    options = argv[:-3]
    if any(arg.split("=")[0] in OWN_OPTIONS for arg in options):
        raise ValueError(f"{USAGE} (the agent sets how the ranks start: no --start-method, --run-path, -m, "
                         "--no-python)")
    return [*options, "--start-method=fork", "--run-path", str(WORKER_MAIN), argv[-1]]


def preload() -> None:
    """Import torch, torchrun and the worker's modules once, for every rank this agent will fork."""
    allocator_defaults()  # before torch is imported, as the worker does
    # An import that asks torch.cuda.is_available() then asks NVML instead of initialising CUDA in the agent: a CUDA
    # driver initialised before a fork is unusable in the forked ranks.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    with imports_without_gc():
        import torch.distributed.run  # noqa: F401

        from trainctl.config import load  # noqa: F401
        from trainctl.train.loop import hooks, stop, trainer  # noqa: F401
    # The agent's objects live as long as it does: the collector of a forked rank need not walk (and so copy) them.
    gc.freeze()


def cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def main(argv: list[str]) -> NoReturn:
    try:
        args = torchrun_argv(argv)
    except ValueError as err:
        print(err, file=sys.stderr)
        exit_now(2)
    preload()
    if cuda_initialised():  # a fork would hand every rank a CUDA context it cannot use
        print("trainctl: CUDA was initialised while importing the worker; launch with cluster.rank_start=exec",
              file=sys.stderr)
        exit_now(2)
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    from torch.distributed.run import main as torchrun

    torchrun(args)  # a failed run raises (torchrun's own summary and traceback, exit 1), as torchrun does
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1:])
