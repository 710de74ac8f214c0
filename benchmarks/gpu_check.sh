#!/usr/bin/env bash
# Everything a machine with a GPU should run, in one command that fits one device call (a
# command may run 600 s; a GPU is lent for about 15 minutes, start-up included). Steps run
# in the order of what is least known, so that a run cut short still brings back what
# matters most:
#
#   default   portable-mx info; the benchmarks, each in its quick mode (element-wise, GEMM,
#             host overhead, MoE when benchmarks/moe.py exists); the GPU tests
#             (`pytest -m gpu`: the compiled kernels against the reference, the small
#             parity corpus against a CPU reference report); in what is left of the budget,
#             the parity reports of the full corpus, the GPU backend against the reference
#             on the same GPU (ci/gpu_parity.sh).
#   --sweeps  portable-mx info; the tuning sweeps (benchmarks/sweeps/*.py: candidate tile
#             configs per kernel, exhaustive GEMM tuning studies, static verdicts read from
#             $GPU_CHECK_STUDIES when set); the GPU tests in what is left of the budget.
#   --tune    portable-mx info; the exhaustive GEMM tuning studies, starting from the
#             static verdicts committed in benchmarks/sweeps/studies/ (sm_90, triton 3.6;
#             verdicts of another kernel hash or triton are compiled again); the grouped
#             (MoE) GEMM's tile sweep (benchmarks/sweeps/grouped_sweep.py); the GPU tests
#             whole.
#
#   benchmarks/gpu_check.sh [OUT_DIR] [--sweeps | --tune] [--plan]
#
#   OUT_DIR   where the logs and JSON go (default: gpu-check-<date>); the summary is
#             OUT_DIR/summary.txt, and OUT_DIR.tar.gz (or $GPU_CHECK_ARCHIVE) holds the
#             whole folder, refreshed after every step (a run cut short keeps what it did).
#   --plan    print the mode's steps with their time limits and the worst case (the sum of
#             the limits), and run nothing.
#   --quick   the benchmarks' quick modes only (the default; kept for symmetry).
#
# Budget: every step has a time limit, and the worst case of each mode stays under
# BUDGET_S (540 s: a 600 s call with a minute to spare), which tests/test_gpu_check.py
# checks. Adding a step is one `step` or `bench` line in the mode's function below, with
# a limit that keeps the sum under the budget (`--plan` shows it).
#
# Python: $PYTHON, else the project's .venv, else python3. Packages the machine lacks
# (pydantic, optuna; pytest-xdist and execnet to spread the GPU tests over 8 workers;
# torchao and gemlite for the peers) are installed from .whl/ when that folder exists
# (../shared/device/fetch-wheels.sh fills it), into a private --target folder: the
# machine's torch and triton are never touched. A failing step does not stop the others;
# the exit status is the number of failed steps (0: all passed).
set -uo pipefail
cd "$(dirname "$0")/.."

BUDGET_S=540
out=""
sweeps=0
plan=0
for arg in "$@"; do
  case "$arg" in
    --sweeps) sweeps=1 ;;
    --tune) sweeps=2 ;;
    --plan) plan=1 ;;
    --quick) ;;
    -h|--help) sed -n '2,/^set /{/^set /!p}' "$0"; exit 0 ;;
    *) out=$arg ;;
  esac
done
mode=$(case $sweeps in 1) echo sweeps ;; 2) echo tune ;; *) echo default ;; esac)

# ----------------------------------------------------------------------------- the steps
# step NAME LIMIT COMMAND...        run with a time limit, log to NAME.log, record the result
# bench NAME LIMIT SCRIPT ARGS...   a step that runs a Python script, when it is in this checkout
# step_rest NAME MAX COMMAND...     last steps only: a step limited to what is left of the
#                                   budget (at most MAX s), skipped when under 20 s are left;
#                                   it adds nothing to the worst case

gpu_tests() {  # gpu_tests LIMIT: what the compiled kernels do on this GPU, against the reference
  step tests-gpu "$1" "$PY" -m pytest -m gpu -v -ra --tb=short "${xdist[@]}" -p no:cacheprovider \
    --junitxml="$out/tests-gpu.xml" tests
}

steps_default() {
  # limits from the H200 run of 2026-11-26 (second): element-wise 15 s, GEMM 147 s,
  # overhead 17 s, MoE 40 s, the GPU tests 145 s on 8 workers (the 130 s they had would
  # have cut them)
  bench bench-elementwise 40 benchmarks/elementwise.py --quick --out "$out/results/elementwise-quick.json"
  bench bench-gemm 165 benchmarks/gemm.py --quick --out "$out/results/gemm-quick.json"
  bench bench-overhead 40 benchmarks/overhead.py --gpu-checks --out "$out/results"
  bench bench-moe 60 benchmarks/moe.py --quick --out "$out/results/moe-quick.json"
  gpu_tests 175
  # The full corpus, in what is left of the budget (the GPU tests hold the small corpus
  # against a CPU reference report): the GPU backend's report and the reference backend's
  # on the same GPU, compared; both land in $out, to be compared with a CPU reference
  # report on any machine (ci/cpu_reference.sh, then portable-mx parity --compare).
  step_rest parity 75 bash -c 'vendor=$("$1" -c "import torch; print(\"amd\" if torch.version.hip else \"nvidia\")") &&
    PYTHON="$1" PORTABLE_MX_REPORTS="$2" bash ci/gpu_parity.sh "$vendor"' parity "$PY" "$out"
}

steps_sweeps() {
  # each sweep checks every candidate against the reference before timing it, and stops
  # starting new ones when its own budget (25-30 s under its limit) is spent
  bench sweep-elementwise 115 benchmarks/sweeps/elementwise_sweep.py --out "$out/results" --budget 90
  bench sweep-gemm 185 benchmarks/sweeps/gemm_sweep.py --out "$out/results" --budget 155
  studies=()
  if [ -n "${GPU_CHECK_STUDIES:-}" ]; then studies=(--study-dir "$GPU_CHECK_STUDIES"); fi
  bench sweep-tune 130 benchmarks/sweeps/tune_sweep.py --out "$out/results/tune" "${studies[@]}" \
    --jobs "$(nproc)" --budget-s 105
  step_rest tests-gpu 150 "$PY" -m pytest -m gpu -q -ra --tb=short "${xdist[@]}" -p no:cacheprovider \
    --junitxml="$out/tests-gpu.xml" tests
}

steps_tune() {
  # a copy of the committed verdicts: the study directory also receives the Optuna journal
  local studies=${GPU_CHECK_STUDIES:-$out/results/tune/studies}
  if [ -z "${GPU_CHECK_STUDIES:-}" ] && [ $plan -eq 0 ]; then
    mkdir -p "$studies" && cp benchmarks/sweeps/studies/static-verdicts.json "$studies/"
  fi
  bench sweep-tune 180 benchmarks/sweeps/tune_sweep.py --out "$out/results/tune" --study-dir "$studies" \
    --jobs "$(nproc)" --budget-s 155
  bench sweep-grouped 140 benchmarks/sweeps/grouped_sweep.py --out "$out/results" --budget 110
  gpu_tests 170
}

steps_setup() {
  if [ $plan -eq 1 ] || { [ -d .whl ] && ! "$PY" -c "import pydantic, optuna" >/dev/null 2>&1; }; then
    step wheels 20 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$site" .whl/*.whl
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  step info 20 bash -c '{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
      --format=csv,noheader 2>/dev/null || rocm-smi --showproductname 2>/dev/null || echo "no nvidia-smi / rocm-smi"; } &&
    "$1" -m portable_mx.cli info && "$1" -m portable_mx.cli info --json > "$2"' info "$PY" "$out/info.json"
  [ $plan -eq 1 ] || sed -n '1,/^backends/{/^backends/!p}' "$out/info.log" >> "$out/summary.txt"
}

# ----------------------------------------------------------------------------- --plan: list, run nothing
if [ $plan -eq 1 ]; then
  PY=python3 out=OUT site=SITE xdist=()
  worst=0
  step() { printf '  %-22s %4s s\n' "$1" "$2"; worst=$((worst + $2)); }
  bench() { step "$@"; }
  step_rest() { printf '  %-22s %4s s  at most: what is left of the budget\n' "$1" "$2"; }
  echo "gpu_check plan ($mode): steps in run order, with their time limits"
  steps_setup
  "steps_$mode"
  echo "worst case $worst s (budget $BUDGET_S s)"
  [ $worst -le $BUDGET_S ]
  exit
fi

# ----------------------------------------------------------------------------- a real run
out=${out:-gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out/results"
out=$(cd "$out" && pwd)
archive=${GPU_CHECK_ARCHIVE:-$out.tar.gz}
site=${GPU_CHECK_SITE:-/tmp/portable_mx-site}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

failed=0
t_all=$(date +%s)
step() {  # the summary line and the archive are refreshed after every step
  local name=$1 limit=$2 t0 rc verdict=ok; shift 2
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="TIMEOUT after ${limit}s"; failed=$((failed + 1))
  elif [ $rc -ne 0 ]; then verdict="FAILED (exit $rc)"; failed=$((failed + 1)); fi
  printf '%-22s %-26s %5ss\n' "$name" "$verdict" "$(( $(date +%s) - t0 ))" | tee -a "$out/summary.txt"
  tar czf "$archive" -C "$(dirname "$out")" "$(basename "$out")" 2>/dev/null
}
bench() {
  local name=$1 limit=$2 script=$3; shift 3
  if [ -f "$script" ]; then step "$name" "$limit" "$PY" "$script" "$@"
  else printf '%-22s %-26s\n' "$name" "absent ($script)" | tee -a "$out/summary.txt"; fi
}
step_rest() {
  local name=$1 limit=$2 left; shift 2
  left=$(( BUDGET_S - ($(date +%s) - t_all) ))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -ge 20 ]; then step "$name" "$limit" "$@"
  else printf '%-22s %-26s\n' "$name" "skipped (${left}s of budget left)" | tee -a "$out/summary.txt"; fi
}

{
  echo "portable_mx gpu_check ($mode) $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
} > "$out/summary.txt"
cat "$out/summary.txt"
xdist=()
steps_setup
if "$PY" -c "import xdist" >/dev/null 2>&1; then xdist=(-n 8); fi
"steps_$mode"

echo "total $(( $(date +%s) - t_all ))s, $failed failed step(s)" | tee -a "$out/summary.txt"
tar czf "$archive" -C "$(dirname "$out")" "$(basename "$out")" 2>/dev/null
exit $failed
