# Sourced by gpu_wheels.sh and gpu_proof.sh: what the GPU image lacks, and which Python rehearses it here.

# The packages trainctl needs that the GPU image's python3 lacks, carried as wheels, installed by name.
GPU_MISSING=(hydra-core omegaconf antlr4-python3-runtime torchao)

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
