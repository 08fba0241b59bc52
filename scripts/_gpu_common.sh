# Sourced by gpu_wheels.sh and gpu_proof.sh: what the GPU image lacks, and which Python rehearses it here.

# The packages trainctl needs that the GPU image's python3 lacks, carried as wheels, installed by name.
GPU_MISSING=(hydra-core omegaconf antlr4-python3-runtime torchao)

# torchtitan for the `titan` stage (torchtitan side by side), pure Python, carried apart from GPU_MISSING so a
# problem there stays in that stage. 0.2.2 is the newest release that imports under torch 2.11 (0.3.0 needs
# torch.distributed.fsdp.DataParallelMeshDims, from a later torch). It declares datasets, einops, pillow,
# tensorboard, tomli and tyro; at train time (llama3, synthetic tokens) it imports only torchdata's
# StatefulDataLoader, tyro (its config parser) and `datasets` (stubbed by bench_titan.py: the text dataloader
# that needs it, with pyarrow and pandas behind it, is not used). TITAN_NO_DEPS install with --no-deps (their
# declared requirements are not used); TITAN_WITH_DEPS resolve against the image and the carried wheels.
TITAN_NO_DEPS=(torchtitan torchdata)
TITAN_WITH_DEPS=(tyro docstring-parser typeguard)

# The rehearsal's interpreter: TRAINCTL_REHEARSE_PYTHON, else a Python 3.12 (the image's minor version) from
# pyenv or PATH, else python3 (then the rehearsal runs another minor version than the image: it says so).
rehearse_python() {
  local candidate
  for candidate in "${TRAINCTL_REHEARSE_PYTHON:-}" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 \
      "$(command -v python3.12 || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then echo "$candidate"; return; fi
  done
  command -v python3
}

rehearse_python_version() {
  "$(rehearse_python)" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")'
}
