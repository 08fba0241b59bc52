#!/usr/bin/env bash
# Fresh clone -> .venv -> install -> lint + the full test suite (unit, dist, CLI).
# Extra arguments go to pytest, e.g. ./scripts/test.sh tests/unit -k plan
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_setup.sh

ruff check trainctl tests scripts
python -m pytest -q -ra "$@"
