#!/usr/bin/env bash
# Everything a machine with a GPU should run, in one command, in under 10 minutes on one
# H100: the test suite on the GPU, the parity report of the GPU backend against a CPU
# reference report, every benchmark (with the peers torchao and gemlite where installed),
# and `portable-mx info`. Writes everything under one folder and prints a summary last.
#
#   benchmarks/gpu_check.sh [OUT_DIR] [--sweeps] [--quick]
#
#   OUT_DIR   where the logs and JSON go (default: gpu-check-<date>); the summary is
#             OUT_DIR/summary.txt, and OUT_DIR.tar.gz (or $GPU_CHECK_ARCHIVE) holds the
#             whole folder, refreshed after every step (a run cut short keeps what it did).
#   --sweeps  instead of the suite, the parity report and the benchmarks: the GPU kernel
#             tests and the tuning sweeps (benchmarks/sweeps/*.py: candidate tile configs
#             per kernel, exhaustive GEMM tuning studies, static verdicts read from
#             $GPU_CHECK_STUDIES when set); about 9.5 minutes on one H100.
#   --quick   the benchmarks' quick modes only (the default; kept for symmetry).
#
# Python: $PYTHON, else the project's .venv, else python3. Packages the machine lacks
# (pydantic, optuna; torchao and gemlite for the peers) are installed from .whl/ when
# that folder exists (../shared/device/fetch-wheels.sh fills it), into a private
# --target folder: the machine's torch and triton are never touched.
# Each step has its own time limit and a failing step does not stop the others; the exit
# status is the number of failed steps (0: all passed).
set -uo pipefail
cd "$(dirname "$0")/.."

out=""
sweeps=0
for arg in "$@"; do
  case "$arg" in
    --sweeps) sweeps=1 ;;
    --quick) ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) out=$arg ;;
  esac
done
out=${out:-gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
archive=${GPU_CHECK_ARCHIVE:-$out.tar.gz}

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi

if [ -d .whl ] && ! "$PY" -c "import pydantic, optuna" >/dev/null 2>&1; then
  site=${GPU_CHECK_SITE:-/tmp/portable_mx-site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    > "$out/wheels.log" 2>&1 || echo "wheel install failed: see wheels.log" >> "$out/summary.txt"
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

failed=0
t_all=$(date +%s)
# step NAME LIMIT_SECONDS COMMAND...: run with a time limit, log to NAME.log, record the result
step() {
  local name=$1 limit=$2; shift 2
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  local secs=$(( $(date +%s) - t0 ))
  local verdict=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="TIMEOUT after ${limit}s"; failed=$((failed + 1))
  elif [ $rc -ne 0 ]; then verdict="FAILED (exit $rc)"; failed=$((failed + 1)); fi
  printf '%-22s %-26s %5ss\n' "$name" "$verdict" "$secs" | tee -a "$out/summary.txt"
  tar czf "$archive" -C "$(dirname "$out")" "$(basename "$out")" 2>/dev/null
}

{
  echo "portable_mx gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null \
    || rocm-smi --showproductname 2>/dev/null | head -n 5 || echo "no nvidia-smi / rocm-smi"
  "$PY" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
} > "$out/summary.txt" 2>&1
cat "$out/summary.txt"

step info 60 "$PY" -m portable_mx.cli info
"$PY" -m portable_mx.cli info --json > "$out/info.json" 2>/dev/null
mkdir -p "$out/results"
bench() {  # bench NAME LIMIT SCRIPT ARGS...: only scripts that exist in this checkout
  local name=$1 limit=$2 script=$3; shift 3
  if [ -f "$script" ]; then step "$name" "$limit" "$PY" "$script" "$@"
  else printf '%-22s %-26s\n' "$name" "absent ($script)" | tee -a "$out/summary.txt"; fi
}
xdist=()
if "$PY" -c "import xdist" >/dev/null 2>&1; then xdist=(-n 6); fi

if [ $sweeps -eq 1 ]; then
  # the kernels compiled on this GPU against the reference, then the sweeps (each checks
  # every candidate against the reference before timing it)
  step tests-kernels 90 "$PY" -m pytest -q -ra "${xdist[@]}" -p no:cacheprovider \
    tests/test_triton_gemm_upcast.py tests/test_triton_gemm.py tests/test_triton_kernels.py
  bench sweep-elementwise 140 benchmarks/sweeps/elementwise_sweep.py --out "$out/results" --budget 115
  bench sweep-gemm 215 benchmarks/sweeps/gemm_sweep.py --out "$out/results" --budget 185
  studies=()
  if [ -n "${GPU_CHECK_STUDIES:-}" ]; then studies=(--study-dir "$GPU_CHECK_STUDIES"); fi
  bench sweep-tune 140 benchmarks/sweeps/tune_sweep.py --out "$out/results/tune" "${studies[@]}" \
    --jobs "$(nproc)" --budget-s 115
else
  # The CPU reference report of the full parity corpus is CPU work: it runs beside the GPU
  # tests (which are not timed), on a few threads, and is done before any benchmark starts.
  OMP_NUM_THREADS=4 timeout 400 "$PY" -m portable_mx.cli parity --backend reference --device cpu \
    --corpus full --json "$out/parity-reference-cpu.json" > "$out/parity-reference-cpu.log" 2>&1 &
  ref_pid=$!

  # The whole suite on the GPU (kernel tests run compiled there; tests marked `gpu` too),
  # spread over worker processes when pytest-xdist is there.
  step tests 300 "$PY" -m pytest -q -ra "${xdist[@]}" -p no:cacheprovider --junitxml="$out/tests.xml" tests

  wait $ref_pid; ref_rc=$?
  printf '%-22s %-26s\n' parity-reference-cpu "$([ $ref_rc -eq 0 ] && echo ok || echo "FAILED (exit $ref_rc)")" \
    | tee -a "$out/summary.txt"
  [ $ref_rc -eq 0 ] || failed=$((failed + 1))
  step parity-gpu 240 "$PY" -m portable_mx.cli parity --device cuda --corpus full --json "$out/parity-gpu.json"
  step parity-compare 60 "$PY" -m portable_mx.cli parity --compare "$out/parity-reference-cpu.json" \
    "$out/parity-gpu.json"

  # Benchmarks (each writes its JSON under $out/results and prints its table last).
  bench bench-elementwise 120 benchmarks/elementwise.py --quick --out "$out/results/elementwise-quick.json"
  bench bench-gemm 150 benchmarks/gemm.py --quick --out "$out/results/gemm-quick.json"
  bench bench-moe 150 benchmarks/moe.py --quick --out "$out/results/moe-quick.json"
  bench bench-overhead 90 benchmarks/overhead.py --gpu-checks --out "$out/results"
fi

echo "total $(( $(date +%s) - t_all ))s, $failed failed step(s)" | tee -a "$out/summary.txt"
tar czf "$archive" -C "$(dirname "$out")" "$(basename "$out")" 2>/dev/null
exit $failed
