#!/usr/bin/env bash
# Shared setup for quickstart.sh and test.sh: a .venv with torch and trainctl installed.
# Idempotent: a second run only checks. Source it from the project root.
set -euo pipefail

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TRAINCTL_TORCH_VERSION:-2.13.0}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python

# torch first, pinned: an unpinned resolve of "torch>=2.11" would pull the newest CUDA build (GBs).
# --no-compile: Python compiles what a program imports when it first imports it; compiling every installed module
# at install time (most are never imported) took about 70 s of the setup's 200 on 2 cores.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch==$TORCH_VERSION (CPU wheel)"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-compile "torch==$TORCH_VERSION" numpy
fi

# The project and its dev tools; torch is already satisfied so nothing heavy is fetched. Whether they are there is
# asked of the import system without importing them (importing all of them takes about 12 s of one core).
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" \
     trainctl hydra typer rich wandb pytest hypothesis torchao transformers tokenizers tensorboard matplotlib peft \
     datasets >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.trainctl-installed ]; then
  # fp8 extra: torchao declares no dependency on torch, so the pinned CPU torch above stays.
  echo "[setup] installing trainctl (editable) with dev and fp8 extras"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-compile -e ".[dev,fp8]"
  touch .venv/.trainctl-installed
fi
export PATH="$PWD/.venv/bin:$PATH"
