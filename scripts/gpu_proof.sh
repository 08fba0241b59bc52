#!/usr/bin/env bash
# Everything a session lent a GPU runs, in stages that each fit one call of the device tool (<10 minutes):
#
#   ./scripts/gpu_wheels.sh                        # here, first: .gpu-wheels/ (carry it, 7 MB)
#   scripts/gpu_proof.sh check install tests       # on the GPU box: the box, the wheels, pytest -m gpu
#   scripts/gpu_proof.sh install loop              # bench_loop: llama1b_bench (Llama 3.2 1B, bf16, compiled)
#   scripts/gpu_proof.sh install variants          # bench_variants on llama1b_bench: compile, AC, fp8
#
# Stages: check (GPU model, power limit, torch/CUDA/cuDNN, Python, a C compiler and Python.h for compile),
# install (the carried wheels with --no-deps; trainctl from this checkout), tests, loop, variants.
# Every stage writes its log and results under $OUT (the device tool brings that folder back) and under
# benchmarks/<gpu>/ with the device, the date and the command. Without a GPU, `check` says so and exits 3.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/gpu-proof-out}
WHEELS=${TRAINCTL_GPU_WHEELS:-.gpu-wheels}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled

gpu_slug() {
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z_' | tr -cd 'a-z0-9_'
}

stage_check() {
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
    echo "check: no NVIDIA GPU on this machine (nvidia-smi missing or failing)"
    return 3
  fi
  nvidia-smi --query-gpu=name,power.limit,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" - <<'PY'
import os, shutil, sys, sysconfig
import torch
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  cuda {torch.version.cuda}  "
      f"cudnn {torch.backends.cudnn.version()}  device {torch.cuda.get_device_name(0)}")
cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
print(f"C compiler: {cc or 'MISSING'}  Python.h: {'present' if headers else 'MISSING'}"
      f"  -> torch.compile {'usable' if cc and headers else 'NOT usable: run variants with compile off'}")
PY
}

stage_install() {
  if [ -d "$WHEELS" ]; then
    "$PY" -m pip install --quiet --no-deps --no-index --find-links "$WHEELS" "$WHEELS"/*.whl 2>&1 | tail -3 || true
  else
    echo "install: no $WHEELS here; run scripts/gpu_wheels.sh before the call and carry it"
  fi
  # trainctl itself from this checkout (no build isolation: no network); PYTHONPATH covers a box without setuptools.
  "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | tail -2 || true
  "$PY" -c "import hydra, omegaconf, yaml, trainctl; print('install: trainctl', trainctl.__file__)"
}

stage_tests() {
  "$PY" -m pytest -m gpu -q -ra -p no:cacheprovider tests/gpu tests/dist/test_context_parallel.py
}

stage_loop() {
  "$PY" scripts/bench_loop.py --recipe llama1b_bench --device cuda --warmup 10 --steps 30 --rounds 2 \
    --json "$OUT/bench_loop.json"
}

stage_variants() {
  "$PY" scripts/bench_variants.py --recipe llama1b_bench --base train.steps=40 logging.log_every=10 \
    --out "$OUT/variants"
}

run_stage() {
  local name=$1
  echo "=== $name ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
  "stage_$name" 2>&1 | tee "$OUT/$name.log"
  return "${PIPESTATUS[0]}"
}

[ $# -gt 0 ] || set -- check
status=0
for stage in "$@"; do
  case $stage in
    check|install|tests|loop|variants) run_stage "$stage" || status=$? ;;
    *) echo "gpu_proof: unknown stage '$stage' (check, install, tests, loop, variants)" >&2; exit 2 ;;
  esac
  if [ "$stage" = check ] && [ "$status" = 3 ]; then exit 3; fi
done

slug=$(gpu_slug)
if [ -n "$slug" ]; then
  dest="benchmarks/$slug/$(date -u +%Y%m%d)"
  mkdir -p "$dest"
  cp -r "$OUT"/. "$dest"/
  printf 'device: %s\ndate: %s\ncommand: scripts/gpu_proof.sh %s\n' "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >> "$dest/RUNS.txt"
  echo "results: $OUT and $dest"
fi
exit "$status"
