#!/usr/bin/env bash
# Fresh clone -> .venv -> install -> lint + the test suite (unit, dist, CLI, Slurm): what CI runs.
#   ./scripts/test.sh          every proof once: the cases in tests/extended_tier.txt (more layouts, schedules and
#                              optimizers of a proof this run already makes) are left out
#   ./scripts/test.sh --full   every case (about twice as long); run it before changing the worker's layouts
# Other arguments go to pytest, e.g. ./scripts/test.sh tests/unit -k plan
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_setup.sh

ruff check trainctl tests scripts
tiers=(-m "not extended")
if [ "${1:-}" = "--full" ]; then
    tiers=()
    shift
fi
if [ $# -gt 0 ]; then
    python -m pytest -q -ra "$@"
    exit
fi
# Every tier in one pytest run on two xdist workers (one collection, one start of each worker): the longest groups of
# tests that start programs first (tests/longest_first.txt), the other programs' tests next, and the in-process tiers
# (about 2600 tests of milliseconds to seconds) last, where they fill whichever worker is free until the end. One
# test's programs leave about a third of the two cores idle (start-up, one-process references, the CLI's own work),
# which the other worker's test takes. A module's tests share its runs and the Slurm tests one cluster: each such
# group stays on one worker (tests/conftest.py).
python -m pytest -q -ra "${tiers[@]}" -n 2 --dist loadgroup --no-loadscope-reorder
