#!/usr/bin/env bash
# Fresh clone -> .venv -> install -> train recipe=tiny_cpu on this CPU (2 workers, DDP).
# Extra arguments are passed on as overrides, e.g. ./scripts/quickstart.sh train.steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_setup.sh

trainctl recipes
trainctl plan recipe=tiny_cpu "$@"
trainctl launch recipe=tiny_cpu --name "quickstart-$(date +%Y%m%d-%H%M%S)" "$@"
