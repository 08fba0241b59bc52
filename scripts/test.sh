#!/usr/bin/env bash
# Fresh clone -> .venv -> install -> lint + the full test suite (unit, dist, CLI).
# Extra arguments go to pytest, e.g. ./scripts/test.sh tests/unit -k plan
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_setup.sh

ruff check trainctl tests scripts
if [ $# -gt 0 ]; then
    python -m pytest -q -ra "$@"
    exit
fi
# The in-process tiers (about 2000 tests, one core each) on two xdist workers; then the rest in one process, where
# each torchrun run already fills both cores.
python -m pytest -q -ra -m "unit or fuzz" -n 2 --dist loadgroup
python -m pytest -q -ra -m "not (unit or fuzz)"
