#!/usr/bin/env bash
# Fresh clone -> .venv -> install -> lint + the full test suite (unit, dist, CLI).
# Extra arguments go to pytest, e.g. ./scripts/test.sh tests/unit -k plan
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_setup.sh

ruff check trainctl tests scripts
# Two pytest-xdist workers where there are two cores (TRAINCTL_TEST_WORKERS overrides; 0 = one process): a torchrun
# test spends much of its time starting interpreters and waiting on its ranks, which a second test fills.
# loadgroup keeps each module's shared torchrun run, and the Slurm cluster, on one worker (tests/conftest.py).
CORES=$(python -c "import os; print(len(os.sched_getaffinity(0)))")
WORKERS=${TRAINCTL_TEST_WORKERS:-$(( CORES >= 2 ? 2 : 0 ))}
python -m pytest -q -ra -n "$WORKERS" --dist loadgroup "$@"
