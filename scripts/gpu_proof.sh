#!/usr/bin/env bash
# Everything a session lent a GPU runs, in stages that each fit one call of the device tool (10 minutes),
# and its rehearsal here on CPU in an environment shaped like the GPU image.
#
#   scripts/gpu_wheels.sh                               # here, first: .gpu-wheels/ (5 MB; name it in carry)
#   scripts/gpu_proof.sh --rehearse                     # here: every stage on CPU, shrunk (before a device call)
#   scripts/gpu_proof.sh check install tests            # call 1 on the GPU (carry .gpu-wheels)
#   scripts/gpu_proof.sh install loop titan             # call 2: trainctl vs bare, then torchtitan, same $OUT
#   scripts/gpu_proof.sh install variants:1/2           # call 3: eager, compile, ac_selective
#   scripts/gpu_proof.sh install variants:2/2 loss_head # call 4: ac_full, fp8, fp8_rowwise; the loss head
#
# Expected GPU time per real stage (H100; estimates until the first call measures them, each with a hard
# limit of STAGE_LIMIT=540 s so that the $OUT check still runs inside the 10-minute call):
#   check 10 s, install 15 s, tests 4-6 min (pytest -m gpu: ~15 one-process runs of a 512-dim model),
#   loop 3-4 min (bench_loop, Llama 3.2 1B bf16 compiled: 2 rounds x 2 arms x (compile ~40 s + 40 steps)),
#   variants:I/2 4-5 min each (3 launches of 40 steps: interpreter + compile ~60 s, steps ~15 s),
#   loss_head 1-2 min (both sizes, dense vs chunked),
#   titan 2-3 min (install ~5 s; torchrun + imports ~20 s; torchtitan's per-block compile of the 1B shape
#   ~60 s; 40 steps at ~0.3-0.4 s; if CUDA runs out of memory at 8 x 2048, one retry at 4 x 2: up to 4 min,
#   within bench_titan's own 480 s). It runs in loop's call because only one call's $OUT comes back together:
#   titan.json then carries the ratio trainctl/torchtitan (else `bench_titan.py --compare` makes it here).
#   About 23 minutes in all, machine starts excluded.
#
# Stages: check (GPU, torch/CUDA/cuDNN, Python, the image's packages, a C compiler and Python.h for compile),
# install (only the carried wheels the image lacks, by name, with no index; trainctl from this checkout on
# PYTHONPATH), tests, loop, variants[:I/N], loss_head, titan (torchtitan 0.2.2 from the carried wheels,
# installed by the stage itself, training the llama1b_bench shape). Results go to $OUT, all the
# device tool brings back: proof.log (every stage's output and wall time), loop.json, variants[-IofN].json/.md,
# loss_head.json, titan.json; the script fails if $OUT breaks the tool's limits (8 files, 16 MiB each, two
# folders deep). Tables under benchmarks/<gpu>/ are made here from those files (the GPU machine's working copy
# is discarded).
#
# --rehearse runs the same stages on CPU in .venv-gpu-rehearse: Python 3.12 where pyenv or PATH has it (the
# image's), torch 2.11.0 from scripts/test_torch.sh's wheel cache and the image's other packages from the
# index; what the image lacks comes only from the carried wheels, with no index and no pip configuration.
# Models shrink to CPU sizes; CUDA-only tests skip but are collected and imported. Without a GPU, the real
# `check` says so and exits 3.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/_gpu_common.sh

STAGES="check install tests loop variants loss_head titan"
REHEARSE=0
if [ "${1:-}" = "--rehearse" ]; then REHEARSE=1; shift; fi
if [ $# -eq 0 ]; then
  if [ "$REHEARSE" = 1 ]; then set -- $STAGES; else set -- check; fi
fi
for stage in "$@"; do
  case $stage in
    check|install|tests|loop|variants|variants:[1-9]/[1-9]|loss_head|titan) ;;
    *) echo "gpu_proof: unknown stage '$stage' ($STAGES; variants:I/N for a part)" >&2; exit 2 ;;
  esac
done

WHEELS=${TRAINCTL_GPU_WHEELS:-.gpu-wheels}
STAGE_LIMIT=${TRAINCTL_STAGE_LIMIT:-540}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-proof-work.XXXXXX")  # run directories: never under $OUT
trap 'rm -rf "$WORK"' EXIT
export WANDB_MODE=disabled PYTHONUNBUFFERED=1

if [ "$REHEARSE" = 1 ]; then
  OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-proof-rehearse.XXXXXX")}
  DEVICE=cpu
  export PYTHONPATH="$PWD" OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}  # this checkout alone, as on the GPU machine
  export TRAINCTL_REHEARSE=1
else
  OUT=${OUT:-$PWD/gpu-proof-out}
  DEVICE=cuda
  PY=${PYTHON:-python3}
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$OUT"
LOG="$OUT/proof.log"

# The image's packages (facts of the GPU machine), installed into the rehearsal venv from the index.
IMAGE_PACKAGES=(transformers tokenizers safetensors tensorboard matplotlib pytest PyYAML packaging typer rich numpy
                setuptools wheel)
TORCH_VERSION=2.11.0
VENV=.venv-gpu-rehearse

# pip here, without the noise of this machine's pip configuration (its file:// indexes lack most names).
pip_quiet() {
  local python=$1
  shift
  "$python" -m pip "$@" --quiet --disable-pip-version-check 2>&1 | grep -v "is ignored: it is neither a file nor"
  return "${PIPESTATUS[0]}"
}

rehearse_setup() {
  local rpy version cache tag
  rpy=$(rehearse_python)
  version=$("$rpy" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  [ "$version" = 3.12 ] || echo "rehearse: no Python 3.12 here; using $rpy ($version), the image runs 3.12.3"
  if [ ! -x "$VENV/bin/python" ] || [ "$("$VENV/bin/python" -c 'import sys; print(sys.version_info[1])')" \
      != "${version#*.}" ]; then
    rm -rf "$VENV" && "$rpy" -m venv "$VENV" || return 1
  fi
  PY=$VENV/bin/python
  if ! "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    cache=${TRAINCTL_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/trainctl/wheels/torch-$TORCH_VERSION}
    tag=cp${version/./}
    if ! ls "$cache"/torch-"$TORCH_VERSION"-"$tag"-*.whl >/dev/null 2>&1; then
      echo "rehearse: downloading torch $TORCH_VERSION for $tag into $cache (once; about 2.6 GB with CUDA's wheels)"
      pip_quiet "$rpy" download -d "$cache" "torch==$TORCH_VERSION" numpy || return 1
    fi
    pip_quiet "$PY" install --no-index -f "$cache" "torch==$TORCH_VERSION" numpy || return 1
  fi
  if [ ! -f "$VENV/.image-packages" ] || [ "$(cat "$VENV/.image-packages")" != "${IMAGE_PACKAGES[*]}" ]; then
    pip_quiet "$PY" install "torch==$TORCH_VERSION" "${IMAGE_PACKAGES[@]}" || return 1
    echo "${IMAGE_PACKAGES[*]}" > "$VENV/.image-packages"
  fi
  # What the image lacks must come from the carried wheels: remove what an earlier rehearsal installed.
  "$PY" -m pip uninstall --quiet --yes "${GPU_MISSING[@]}" "${TITAN_NO_DEPS[@]}" "${TITAN_WITH_DEPS[@]}" wandb \
    2>&1 | grep -v "not installed" || true
  local name
  for name in hydra_core omegaconf antlr4_python3_runtime torchao torchtitan torchdata tyro docstring_parser typeguard \
      typing_extensions; do
    if ! ls "$WHEELS"/"$name"-*.whl >/dev/null 2>&1; then
      TRAINCTL_GPU_PYTHONS="3.12 $version" scripts/gpu_wheels.sh "$WHEELS" || return 1
      break
    fi
  done
  export PATH="$PWD/$VENV/bin:$PATH"  # torchrun and `python` in the tests' subprocesses: the venv's
}

stage_check() {
  if [ "$REHEARSE" = 1 ]; then
    echo "check: rehearsal on CPU: no GPU expected"
    local tree
    tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    tree=$((tree + $(du -sb "$WHEELS" | cut -f1)))
    echo "check: the working tree and $WHEELS carry $((tree / 1024 / 1024)) MiB (the device tool takes 64 MiB)"
    [ "$tree" -le $((64 * 1024 * 1024)) ] || return 1
  else
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
      echo "check: no NVIDIA GPU on this machine (nvidia-smi missing or failing)"
      return 3
    fi
    nvidia-smi --query-gpu=name,power.limit,memory.total,driver_version,clocks.max.sm --format=csv
    echo "nvcc: $(command -v nvcc || echo MISSING)  cmake: $(command -v cmake || echo MISSING)"
  fi
  "$PY" - "${GPU_MISSING[@]}" "${TITAN_NO_DEPS[@]}" "${TITAN_WITH_DEPS[@]}" typing-extensions datasets <<'PY'
import importlib.metadata as md, os, shutil, sys, sysconfig
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"python {sys.version.split()[0]} ({sys.executable})  torch {torch.__version__}  cuda {torch.version.cuda}  "
      f"cudnn {torch.backends.cudnn.version()}  device {gpu}")
image = ["transformers", "tokenizers", "safetensors", "tensorboard", "matplotlib", "pytest", "PyYAML", "packaging",
         "typer", "rich", "numpy"]
def have(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
print("image:", "  ".join(f"{n} {have(n) or 'MISSING'}" for n in image))
print("to carry:", "  ".join(f"{n} {have(n) or 'absent'}" for n in sys.argv[1:]))
cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
print(f"C compiler: {cc or 'MISSING'}  Python.h: {'present' if headers else 'MISSING'}"
      f"  -> torch.compile {'usable' if cc and headers else 'NOT usable: run variants with compile off'}")
missing = [n for n in image if not have(n)]
sys.exit(f"check: the image's packages are missing: {' '.join(missing)}" if missing else 0)
PY
}

# pip install from the carried wheels only: by name, so pip picks the file for this Python; no index, no pip
# configuration (none exists there).
pip_carried() {
  if [ ! -d "$WHEELS" ]; then
    echo "install: no $WHEELS here; run scripts/gpu_wheels.sh before the call and name it in carry"
    return 1
  fi
  env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$WHEELS" "$@"
}

stage_install() {
  pip_carried "${GPU_MISSING[@]}" || return 1
  # trainctl from this checkout on PYTHONPATH (an editable install would need setuptools' build backend).
  "$PY" - <<'PY'
import importlib.metadata as md, importlib.util
import hydra, omegaconf, antlr4, torchao.float8, yaml  # noqa: F401
import trainctl
from trainctl.config.compose import compose
cfg = compose(["recipe=llama1b_bench"])
assert cfg.logging.wandb.mode == "disabled", "llama1b_bench would import wandb, which the GPU image lacks"
# What a local launch of the bench recipe sees here (bench_variants launches it): on the GPU machine it must find
# the GPU from /proc and /dev, or every variant is refused before it starts; the rehearsal runs it on CPU.
import os
from dataclasses import replace
from trainctl.plan.fit import device_warning, local_device_problems, this_machine
machine = this_machine()
cluster = cfg.cluster if os.environ.get("TRAINCTL_REHEARSE") != "1" else replace(cfg.cluster, device="cpu", gpu="")
problems = local_device_problems(cluster, machine)
print("install: trainctl sees GPUs", list(machine.gpus) or "none", "|", device_warning(cluster, machine) or "no warning")
assert not problems, problems
print("install: trainctl", trainctl.__file__, "|", "  ".join(
    f"{n} {md.version(n)}" for n in ("hydra-core", "omegaconf", "antlr4-python3-runtime", "torchao")),
    "| wandb", "present" if importlib.util.find_spec("wandb") else "absent (runs log with wandb disabled)")
PY
}

stage_tests() {
  limit "$PY" -m pytest -m gpu -q -ra -p no:cacheprovider tests/gpu tests/dist/test_context_parallel.py || return 1
  if [ "$REHEARSE" = 1 ]; then
    # On CPU the CUDA tests skip; these show the carried wheels and torch 2.11 train here (fp8 via torchao,
    # the GPU tests' configs resolved, the bench scripts' bookkeeping).
    limit "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" tests/unit/test_gpu_configs.py \
      tests/unit/test_op_checkpointing.py tests/unit/test_mixed_precision.py tests/unit/test_bench_variants_unit.py \
      tests/unit/test_gpu_out_check.py
  fi
}

stage_loop() {
  if [ "$REHEARSE" = 1 ]; then
    limit "$PY" scripts/bench_loop.py --recipe llama1b_bench --device cpu --warmup 2 --steps 2 --rounds 1 \
      model=tiny train.seq_len=64 train.micro_batch=2 --json "$OUT/loop.json"  # compiled, as on the GPU
  else
    limit "$PY" scripts/bench_loop.py --recipe llama1b_bench --device cuda --warmup 10 --steps 30 --rounds 2 \
      --json "$OUT/loop.json"
  fi
}

stage_variants() {
  local part=${1:-} stem="$OUT/variants"
  [ -z "$part" ] || stem="$OUT/variants-${part%/*}of${part#*/}"
  if [ "$REHEARSE" = 1 ]; then
    limit "$PY" scripts/bench_variants.py --recipe llama1b_bench --variants eager ac_selective \
      --base model=tiny cluster.device=cpu cluster.gpu= train.seq_len=64 train.micro_batch=2 train.global_batch=2 \
      train.steps=4 schedule.warmup_steps=1 logging.log_every=2 ${part:+--part "$part"} --runs-dir "$WORK/variants-runs" --out "$stem"
  else
    limit "$PY" scripts/bench_variants.py --recipe llama1b_bench --base train.steps=40 logging.log_every=10 \
      ${part:+--part "$part"} --runs-dir "$WORK/variants-runs" --out "$stem"
  fi
}

stage_loss_head() {
  if [ "$REHEARSE" = 1 ]; then
    limit "$PY" scripts/bench_loss_head.py --device cpu --quick --json "$OUT/loss_head.json"
  else
    limit "$PY" scripts/bench_loss_head.py --device cuda --chunks 1024 2048 8192 all --json "$OUT/loss_head.json"
  fi
}

# torchtitan's own training on the llama1b_bench shape (scripts/bench_titan.py), compared with loop.json when the
# loop stage ran before it in this call. It installs what it needs itself (hydra composes the recipe; pip skips
# what `install` put there already), so `gpu_proof.sh titan` runs alone too.
stage_titan() {
  pip_carried "${GPU_MISSING[@]}" "${TITAN_WITH_DEPS[@]}" && pip_carried --no-deps "${TITAN_NO_DEPS[@]}" || return 1
  if [ "$REHEARSE" = 1 ]; then  # loop's shrunk shape, so that the comparison runs too
    limit "$PY" scripts/bench_titan.py --device cpu --warmup 2 --steps 2 --log-freq 1 --timeout 400 \
      model=tiny train.seq_len=64 train.micro_batch=2 --json "$OUT/titan.json" --loop "$OUT/loop.json"
  else
    limit "$PY" scripts/bench_titan.py --device cuda --warmup 10 --steps 30 --log-freq 5 --timeout 480 \
      --json "$OUT/titan.json" --loop "$OUT/loop.json"
  fi
}

# A stage's command under a deadline, so the $OUT check below still runs inside the device call.
limit() { timeout -k 10 "$STAGE_LIMIT" "$@"; }

run_stage() {
  local stage=$1 start rc
  start=$(date +%s)
  echo "=== $stage ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
  case $stage in
    variants:*) stage_variants "${stage#variants:}" ;;
    *) "stage_$stage" ;;
  esac
  rc=$?
  echo "=== $stage: exit $rc, wall $(( $(date +%s) - start )) s"
  return $rc
}

main() {
  local status=0 stage rc
  if [ "$REHEARSE" = 1 ]; then
    local start
    start=$(date +%s)
    echo "=== rehearse setup"
    rehearse_setup || { echo "rehearse: setting up $VENV failed"; return 1; }
    echo "=== rehearse setup: wall $(( $(date +%s) - start )) s ($PY)"
  fi
  for stage in "$@"; do
    run_stage "$stage"
    rc=$?
    [ "$rc" = 0 ] || status=$rc
    if [ "$stage" = check ] && [ "$rc" = 3 ]; then return 3; fi
  done
  return "$status"
}

if [ "$REHEARSE" = 1 ] && [ "${TRAINCTL_PREPARE_ONLY:-0}" = 1 ]; then  # CI: the venv, while the tests run
  rehearse_setup || { echo "rehearse: setting up $VENV failed"; exit 1; }
  echo "rehearse: $VENV ready"
  exit 0
fi
main "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
echo "=== \$OUT ($OUT):"
if ! python3 scripts/gpu_out_check.py "$OUT"; then
  status=1
fi
echo "gpu_proof: exit $status"
exit "$status"
