#!/usr/bin/env bash
# Prepare .gpu-wheels/ here (with network) for a lent GPU box (no network; torch 2.11, typer and rich already
# there): the packages trainctl and its tests need that the box lacks, at the versions .venv tests with.
#
#   ./scripts/gpu_wheels.sh [OUT_DIR]       # default .gpu-wheels (git-ignored); prints the total size
#   ./scripts/gpu_wheels.sh --dry-run       # list what it would fetch, fetch nothing
#
# Binary wheels (PyYAML, safetensors, torchao) are fetched for every CPython in TRAINCTL_GPU_PYTHONS (the box's
# Python is only known once lent: gpu_proof.sh check prints it). antlr4-python3-runtime 4.9.3, which hydra-core
# pins, exists on PyPI only as a source archive: `pip wheel` builds it here. wandb is left out: the GPU runs log
# with logging.wandb.mode=disabled. The device tool carries at most 64 MiB in all.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-.gpu-wheels}
PYTHONS=${TRAINCTL_GPU_PYTHONS:-"3.10 3.11 3.12"}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

# The versions this checkout is tested with, read from .venv (fallbacks: known-good pins).
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo "$2"; }
PURE=("hydra-core==$(version hydra-core 1.3.2)" "omegaconf==$(version omegaconf 2.3.0)"
      "pytest==$(version pytest 8.3.0)" "pluggy==$(version pluggy 1.5.0)" "iniconfig==$(version iniconfig 2.0.0)"
      "packaging==$(version packaging 24.0)")
BINARY=("PyYAML==$(version PyYAML 6.0.2)" "safetensors==$(version safetensors 0.4.5)"
        "torchao==$(version torchao 0.18.0)")
SOURCE_ONLY="antlr4-python3-runtime==4.9.3"

if [ "$DRY" = 1 ]; then
  echo "pure:   ${PURE[*]}"
  echo "binary: ${BINARY[*]} for CPython ${PYTHONS}"
  echo "built:  $SOURCE_ONLY"
  echo "into:   $OUT"
  exit 0
fi

mkdir -p "$OUT"
pip_download() { "$PY" -m pip download --quiet --disable-pip-version-check --no-deps -d "$OUT" "$@"; }
pip_download "${PURE[@]}"
for version in $PYTHONS; do
  pip_download --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "${BINARY[@]}"
done
"$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$OUT" "$SOURCE_ONLY"
echo "$(ls "$OUT" | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT"
