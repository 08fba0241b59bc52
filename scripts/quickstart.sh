#!/usr/bin/env bash
# Fresh clone -> .venv -> install -> train recipe=tiny_cpu on this CPU (2 workers, DDP).
# Extra arguments are passed on as overrides, e.g. ./scripts/quickstart.sh train.steps=50
# TRAINCTL_RUNS_DIR: where the run goes (default runs/, as `trainctl launch`'s own default).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_setup.sh

name="quickstart-$(date +%Y%m%d-%H%M%S)"
runs=${TRAINCTL_RUNS_DIR:-runs}
# The launch prints a short plan (`trainctl plan recipe=tiny_cpu` shows all of it; `trainctl recipes` the others).
trainctl launch recipe=tiny_cpu "runs_dir=$runs" --name "$name" "$@"

# The demo's promise: validation loss at the end is at most half of the step-0 one.
python - "$runs/$name/result.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
ratio = r["final_val_loss"] / r["initial_val_loss"]
print(f"val loss {r['initial_val_loss']:.3f} -> {r['final_val_loss']:.3f} (x{ratio:.2f}) in {r['steps']} steps, {r['wall_time_s']:.0f} s")
sys.exit(0 if ratio <= 0.5 else 1)
PY
