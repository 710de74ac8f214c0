#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install portable_mx into it.
#   scripts/setup_venv.sh VENV [EXTRAS]
# torch: a torch that the host python already has (a GPU build, say) is kept: the venv
# then sees the system site-packages. Otherwise a GPU machine gets the registry's default
# torch and a machine with no GPU gets $TORCH_SPEC (default torch==2.13.0, which resolves
# to the CPU build offered on the project's machines instead of gigabytes of CUDA wheels).
set -euo pipefail
venv=${1:-.venv}
extras=${2:-}
py=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$venv/bin/python" ]; then
  if "$py" -c "import torch" >/dev/null 2>&1; then
    echo "setup: keeping the torch that $py already has ($("$py" -c 'import torch; print(torch.__version__)'))"
    "$py" -m venv --system-site-packages "$venv"
  else
    "$py" -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 || command -v rocminfo >/dev/null 2>&1; then
    echo "setup: GPU machine with no torch: installing the default torch build"
    "${pip[@]}" torch
  else
    echo "setup: no GPU: installing $torch_spec"
    "${pip[@]}" "$torch_spec"
  fi
fi
"${pip[@]}" -e ".${extras:+[$extras]}"
