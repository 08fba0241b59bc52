#!/usr/bin/env bash
# The worker's distributed tests under another torch release, in its own venv (.venv-torch<VERSION>).
#
#   ./scripts/test_torch.sh 2.11.0                 # the tests of tests/release_tier.txt
#   ./scripts/test_torch.sh 2.11.0 tests/dist/test_pipeline.py -k gpipe
#   TRAINCTL_PREPARE_ONLY=1 ./scripts/test_torch.sh 2.11.0   # only the venv and its torch (download, install)
#
# Why: the GPU machines run torch 2.11 while .venv has 2.13; both must train. PyPI's 2.11 is a CUDA build
# (about 2.6 GB of wheels with its nvidia-* dependencies) that runs on CPU. The wheels are downloaded once
# into a cache outside git (TRAINCTL_WHEEL_CACHE, default ~/.cache/trainctl/wheels/torch-<VERSION>) and
# installed from there without the index; a second run only checks. Measured on 2 cores: download 23 s,
# install 38 s, trainctl and its dependencies 13 s; the venv takes 4.7 GB.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${1:?usage: scripts/test_torch.sh VERSION [pytest args...]}
shift
PYTHON=${PYTHON:-python3}
CACHE=${TRAINCTL_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/trainctl/wheels/torch-$VERSION}
VENV=.venv-torch$VERSION
PY=$VENV/bin/python

have_torch() {
  [ -x "$PY" ] && "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null
}

if ! have_torch; then
  if ! ls "$CACHE"/torch-"$VERSION"*.whl >/dev/null 2>&1; then
    echo "[torch $VERSION] downloading wheels into $CACHE"
    mkdir -p "$CACHE"
    "$PYTHON" -m pip download --quiet --disable-pip-version-check -d "$CACHE" "torch==$VERSION" numpy
  fi
  echo "[torch $VERSION] creating $VENV from $CACHE"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-index -f "$CACHE" "torch==$VERSION" numpy
fi
if [ "${TRAINCTL_PREPARE_ONLY:-0}" = 1 ]; then
  # torch and trainctl's dependencies, not trainctl: its editable install writes into the checkout, where another
  # install may be running. The install below then finds every dependency there (a few seconds instead of minutes).
  if mapfile -t reqs < <("$PY" "$(dirname "$0")/_requirements.py" dev fp8) && [ ${#reqs[@]} -gt 0 ]; then
    echo "[torch $VERSION] installing trainctl's dependencies (dev, fp8)"
    if ! "$PY" -m pip install --quiet --disable-pip-version-check "${reqs[@]}" > "$VENV/deps.log" 2>&1; then
      cat "$VENV/deps.log"
      exit 1
    fi
  fi
  echo "[torch $VERSION] $VENV has torch"
  exit 0
fi
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" \
     trainctl hydra pytest torchao transformers tokenizers peft >/dev/null 2>&1 \
   || [ pyproject.toml -nt "$VENV/.trainctl-installed" ]; then
  echo "[torch $VERSION] installing trainctl (editable) with dev and fp8 extras"
  # Its output (a pip configuration's missing find-links folders warn once per package) goes to a log, shown on failure.
  if ! "$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev,fp8]" > "$VENV/install.log" 2>&1; then
    cat "$VENV/install.log"
    exit 1
  fi
  touch "$VENV/.trainctl-installed"
fi
# The tests start torchrun and `python -m trainctl...` from PATH: they must be this venv's.
export PATH="$PWD/$VENV/bin:$PATH"

"$PY" -c "import torch; print(f'[torch {torch.__version__}] worker tests under', torch.__file__)"
if [ $# -eq 0 ]; then  # what differs by release, one case of each (the list says why)
  mapfile -t tier < <(grep -v '^#' tests/release_tier.txt)
  set -- "${tier[@]}"
fi
# Two workers, as scripts/test.sh runs its torchrun tests (a module's runs stay on one).
"$PY" -m pytest -q -ra -p no:cacheprovider -n 2 --dist loadgroup --no-loadscope-reorder "$@"
