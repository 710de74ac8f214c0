#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install portable_mx into it.
#   scripts/setup_venv.sh VENV [EXTRAS]
# torch and triton: the ones the host python already has (a CUDA or ROCm build of torch,
# with the triton it was built with) are kept and never reinstalled: the venv sees them
# (through --system-site-packages, and a .pth file when the host python is itself a
# virtual environment), and portable_mx does not list triton as a requirement. A machine
# with no torch gets $TORCH_SPEC (default torch==2.13.0, the CPU build on the project's
# machines; an NVIDIA machine gets PyPI's default build, a CUDA one; an AMD machine stops
# unless PIP_INDEX_URL names a ROCm index of torch). A machine with no triton
# gets $TRITON_SPEC (default: the latest triton), whose interpreter runs the kernels on
# the CPU in the tests.
set -euo pipefail
venv=${1:-.venv}
extras=${2:-}
py=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
triton_spec=${TRITON_SPEC:-triton}

if [ ! -x "$venv/bin/python" ]; then
  if "$py" -c "import torch" >/dev/null 2>&1; then
    echo "setup: keeping the torch that $py already has ($("$py" -c 'import torch; print(torch.__version__)'))"
    "$py" -m venv --system-site-packages "$venv"
    # a host python inside a virtual environment: --system-site-packages reaches only its
    # base interpreter, so the environment's own site-packages are added by a .pth file
    "$py" - "$venv" <<'EOF'
import site, sys, pathlib, subprocess
if sys.prefix != sys.base_prefix:
    venv = pathlib.Path(sys.argv[1])
    target = subprocess.check_output(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip()
    paths = [p for p in site.getsitepackages() if pathlib.Path(p).is_dir()]
    pathlib.Path(target, "_host_site_packages.pth").write_text("\n".join(paths) + "\n")
EOF
  else
    "$py" -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    echo "setup: no torch: installing $torch_spec (TORCH_SPEC)"
    "${pip[@]}" "$torch_spec"
  elif command -v rocminfo >/dev/null 2>&1 && ! command -v nvidia-smi >/dev/null 2>&1 \
      && [ -z "${PIP_INDEX_URL:-}" ]; then
    # (PyPI's default torch is a CUDA build: on an AMD machine it would run on the CPU only)
    echo "setup: AMD GPU machine with no torch: PyPI's default torch is a CUDA build. Install torch's ROCm" \
         "build into the host python first, or rerun with PIP_INDEX_URL set to pytorch.org's index for your" \
         "ROCm release (https://download.pytorch.org/whl/rocm<version>)" >&2
    exit 1
  elif command -v nvidia-smi >/dev/null 2>&1 || command -v rocminfo >/dev/null 2>&1; then
    echo "setup: GPU machine with no torch: installing torch from ${PIP_INDEX_URL:-PyPI} (TORCH_SPEC chooses another)"
    "${pip[@]}" torch
  else
    echo "setup: no GPU: installing $torch_spec"
    "${pip[@]}" "$torch_spec"
  fi
fi
if ! "$venv/bin/python" -c "import triton" >/dev/null 2>&1; then
  echo "setup: no triton: installing $triton_spec"
  "${pip[@]}" "$triton_spec"
fi
echo "setup: $("$venv/bin/python" -c 'import torch, triton; print("torch", torch.__version__, "| triton", triton.__version__)')"
"${pip[@]}" -e ".${extras:+[$extras]}"
