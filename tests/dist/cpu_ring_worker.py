"""`python -m trainctl.train RUN_DIR` with context parallelism allowed on CPU (see cpu_ring_attention.py), for
one run directory or several trained one after another (many_runs_worker.py).

Run under torchrun by test_context_parallel.py. The worker is the product's, unchanged, except
that its device check for cp (CUDA only) is lifted once the CPU ring is installed.
"""

from __future__ import annotations

import sys

import cpu_ring_attention
from many_runs_worker import run_all

import trainctl.train.loop.job_setup as job_setup

if __name__ == "__main__":
    cpu_ring_attention.install()
    job_setup.check_cp_device = lambda cp, device: None
    sys.exit(run_all(sys.argv[1:]))
