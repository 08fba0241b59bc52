"""Several run directories trained one after another by one worker process per rank (N ranks started once, or one
plain process), for the tests whose cases share a world size: the interpreter, torch's import and the rendezvous
are paid once per shape instead of once per case.

Each run goes through the worker's own entry (trainctl.train.__main__.main) with its own logs; the process group is
formed here once and each run joins it (trainctl.train.parallel.distributed leaves a group it did not form). The
first run that fails ends the process with its exit code, naming the run on stderr.

    python tests/dist/spawn_ranks.py N tests/dist/many_runs_worker.py RUN_DIR [RUN_DIR ...]   (or under torchrun)
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from trainctl.core.lean_process import exit_now
from trainctl.train.__main__ import main


def drop_log_handlers() -> None:
    """The previous run's log files: closed, so the next run's records go only to its own folder."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()


def run_all(run_dirs: list[str]) -> int:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    code = 0
    try:
        for run_dir in run_dirs:
            code = main([run_dir])
            drop_log_handlers()
            if code != 0:
                print(f"many_runs_worker: {run_dir} failed with exit code {code}", file=sys.stderr, flush=True)
                break
    finally:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    # Every run's files are closed and the group is gone: no teardown of torch's modules (core/lean_process.py).
    exit_now(run_all(sys.argv[1:]))
