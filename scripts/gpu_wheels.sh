#!/usr/bin/env bash
# Prepare .gpu-wheels/ here (with network) for a lent GPU machine (no network). Its python3 (3.12.3, a venv
# at /opt/torch/.venv) already holds torch 2.11, transformers, tokenizers, safetensors, tensorboard, matplotlib,
# pytest, PyYAML, packaging, typer, rich and numpy; this carries ONLY what it lacks:
#
#   hydra-core, omegaconf   pure Python
#   antlr4-python3-runtime  4.9.3, which hydra-core pins, is a source archive on PyPI: `pip wheel` builds it
#   torchao                 float8 training (cp310-abi3: one wheel serves CPython 3.10 and later)
#   torchtitan 0.2.2 and what it imports at train time: torchdata, tyro, docstring-parser, typeguard, and
#                           typing-extensions (typeguard needs >= 4.14; pip takes it only if the image's is older)
#                           for the `titan` stage; pure Python, about 1 MB (see _gpu_common.sh for why these)
#
# wandb is not carried: every GPU run logs with logging.wandb.mode=disabled (the default; bench_variants and
# bench_loop force it), and trainctl imports wandb only for another mode. Wheels are fetched for each CPython
# in TRAINCTL_GPU_PYTHONS (default: 3.12, the image's, and the rehearsal's Python), so gpu_proof.sh's
# `pip install --no-index --find-links DIR NAME...` picks the matching file by name. About 5 MB.
#
#   ./scripts/gpu_wheels.sh [OUT_DIR]       # default .gpu-wheels (git-ignored); prints the total size
#   ./scripts/gpu_wheels.sh --dry-run       # list what it would fetch, fetch nothing
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_gpu_common.sh

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-.gpu-wheels}
PYTHONS=${TRAINCTL_GPU_PYTHONS:-"3.12 $(rehearse_python_version)"}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

# The versions this checkout is tested with, read from .venv (fallbacks: known-good pins).
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo "$2"; }
PURE=("hydra-core==$(version hydra-core 1.3.8)" "omegaconf==$(version omegaconf 2.3.1)")
BINARY=("torchao==$(version torchao 0.18.0)")
SOURCE_ONLY="antlr4-python3-runtime==4.9.3"
TITAN=("torchtitan==0.2.2" "torchdata==0.11.0" "tyro==1.0.17" "docstring-parser==0.18.0" "typeguard==4.6.1"
       "typing-extensions==$(version typing-extensions 4.15.0)")
PYTHONS=$(tr ' ' '\n' <<<"$PYTHONS" | sort -u | tr '\n' ' ')

if [ "$DRY" = 1 ]; then
  echo "pure:   ${PURE[*]}"
  echo "binary: ${BINARY[*]} for CPython ${PYTHONS}"
  echo "built:  $SOURCE_ONLY"
  echo "titan:  ${TITAN[*]}"
  echo "names:  ${GPU_MISSING[*]}"
  echo "titan names: ${TITAN_NO_DEPS[*]} (no deps) ${TITAN_WITH_DEPS[*]}"
  echo "into:   $OUT"
  exit 0
fi

mkdir -p "$OUT"
pip_download() { "$PY" -m pip download --quiet --disable-pip-version-check --no-deps -d "$OUT" "$@"; }
pip_download "${PURE[@]}" "${TITAN[@]}"
for version in $PYTHONS; do
  pip_download --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 "${BINARY[@]}"
done
[ -n "$(ls "$OUT"/antlr4_python3_runtime-4.9.3-*.whl 2>/dev/null)" ] \
  || "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$OUT" "$SOURCE_ONLY"
echo "titan: $(du -ch "$OUT"/{torchtitan,torchdata,tyro,docstring_parser,typeguard,typing_extensions}-*.whl | tail -1 | cut -f1)"
echo "$(ls "$OUT" | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT (CPython $PYTHONS): $(ls "$OUT" | tr '\n' ' ')"
