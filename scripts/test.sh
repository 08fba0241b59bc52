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
rest="not (unit or component or fuzz or cli) and not extended"
if [ "${1:-}" = "--full" ]; then
    rest="not (unit or component or fuzz or cli)"
    shift
fi
if [ $# -gt 0 ]; then
    python -m pytest -q -ra "$@"
    exit
fi
# The in-process tiers (unit, component, fuzz) and the CLI tests (short programs, one core each: about 2600 tests)
# on two xdist workers; then the rest, also on two: one test's programs leave about a third of the two cores idle
# (start-up, one-process references, the CLI's own work), which the other worker's test takes. A module's tests
# share its runs and the Slurm tests one cluster: each such group stays on one worker (tests/conftest.py), the
# longest start first (tests/longest_first.txt).
python -m pytest -q -ra -m "unit or component or fuzz or cli" -n 2 --dist loadgroup
python -m pytest -q -ra -m "$rest" -n 2 --dist loadgroup --no-loadscope-reorder
