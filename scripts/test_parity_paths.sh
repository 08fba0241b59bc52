#!/usr/bin/env bash
# The parity tests (pytest -m parity: two computations of the same numbers held to rounding's bound, see
# tests/helpers.py) again on another CPU code path: ATen's portable kernels (ATEN_CPU_CAPABILITY=default) sum
# in other orders than the vectorized ones the main run took, as another CPU's kernels do. A tolerance read off
# one machine fails here; one derived from the arithmetic holds. Extra arguments go to pytest.
#
#   ./scripts/test_parity_paths.sh                 # default kernels
#   CAPABILITY=avx2 ./scripts/test_parity_paths.sh # another path
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_setup.sh

export ATEN_CPU_CAPABILITY=${CAPABILITY:-default}
# The matmuls go to MKL and oneDNN, which pick their own kernels: the same instruction set for them.
case $ATEN_CPU_CAPABILITY in
  default) export MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 ;;
  avx2) export MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
esac
python -c "import torch; print('[parity] CPU kernels:', torch.backends.cpu.get_cpu_capability())"
# Every in-process comparison; none of the torchrun curves (test_parity.py, test_expert_parallel.py, the other
# curve files): they hold their layouts to the same bound (tests/helpers.py curve_rel) on the main path, each is
# several torchrun launches on kernels several times slower here, and a second path re-proves the bound (which the
# in-process cases do), not the layout.
if [ $# -eq 0 ]; then
  set -- --ignore=tests/dist/test_parity.py --ignore=tests/dist/test_expert_parallel.py \
    --ignore=tests/dist/test_expert_parallel_training.py --ignore=tests/dist/test_context_parallel.py \
    --ignore=tests/dist/test_measured_memory.py
fi
python -m pytest -q -ra -m parity "$@"
