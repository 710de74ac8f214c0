#!/usr/bin/env bash
# Everything a machine with a GPU should run, in one command that fits one device call (a
# command may run 600 s; a GPU is lent for about 15 minutes, start-up included). Steps run
# in the order of what is least known, so that a run cut short still brings back what
# matters most:
#
#   default   portable-mx info; the benchmarks, each in its quick mode (element-wise, GEMM,
#             host overhead, MoE when benchmarks/moe.py exists, the MoE backward's ragged
#             products against torch's grouped_mm forms); the GPU tests in what
#             is left of the budget (`pytest -m gpu`: the compiled kernels against the
#             reference); the small parity corpus against a CPU reference report
#             (benchmarks/gpu_parity.sh, in three parts); then, in what is left, the peers beside portable_mx (torchao's to_mx, gemlite's
#             GEMM: their first calls compile and autotune for minutes; gemlite's tuned
#             configs come back in results/peers/, to commit in benchmarks/peers/).
#             (The full corpus's parity,
#             ci/gpu_parity.sh, needs a call of its own: it reached 216 of 728 cases in the
#             75 s that were left here.)
#   --sweeps  portable-mx info; the tuning sweeps (benchmarks/sweeps/*.py: candidate tile
#             configs per kernel, exhaustive GEMM tuning studies from the committed static
#             verdicts, or $GPU_CHECK_STUDIES when set); the GPU tests in what is left of
#             the budget, then the small parity corpus.
#   --tune    portable-mx info; the exhaustive GEMM tuning studies, starting from the
#             static verdicts committed in benchmarks/sweeps/studies/ (sm_90, triton 3.6;
#             verdicts of another kernel hash or triton are compiled again); the grouped
#             (MoE) GEMM's tile sweep (benchmarks/sweeps/grouped_sweep.py); the GPU tests
#             whole, then the small parity corpus in what is left.
#
#   benchmarks/gpu_check.sh [OUT_DIR] [--sweeps | --tune] [--plan]
#
#   OUT_DIR   where the logs and JSON go (default: gpu-check-<date>; a relative path is
#             taken from the repository root); the summary is OUT_DIR/summary.txt, and
#             OUT_DIR.tar.gz (or $GPU_CHECK_ARCHIVE) holds the whole folder, refreshed
#             after every step (a run cut short keeps what it did). On the device machine
#             (OUT_DIR inside the folder $OUT, whose files come back, at most 8 of them)
#             the logs are written under /tmp and OUT_DIR receives two files: summary.txt
#             and, beside it, OUT_DIR.tar.gz with everything.
#   --plan    print the mode's steps with their time limits and the worst case (the sum of
#             the limits), and run nothing.
#   --quick   the benchmarks' quick modes only (the default; kept for symmetry).
#
# Budget: every step has a time limit, and the worst case of each mode stays under
# BUDGET_S (540 s: a 600 s call with a minute to spare), which tests/test_gpu_check.py
# checks. A call given less than 600 s sets GPU_CHECK_BUDGET_S (its limit less a minute):
# the steps limited to what is left of the budget then end in time for the archive (a
# budget below the mode's fixed steps, their worst case in --plan, is refused). Adding a step is one `step` or `bench` line in the mode's function below, with
# a limit that keeps the sum under the budget (`--plan` shows it).
#
# Python: $PYTHON, else the project's .venv, else python3. Packages the machine lacks
# (pydantic, optuna; pytest-xdist and execnet to spread the GPU tests over 16 workers;
# torchao and gemlite for the peers) are installed from .whl/ when that folder exists
# (../shared/device/fetch-wheels.sh fills it), into a private --target folder: the
# machine's torch and triton are never touched. The preflight step then imports
# portable_mx: where it cannot (no .whl carried, a wheel missing), the run stops there
# with one summary line instead of failing every step. A failing step does not stop the
# others; the exit status is the number of failed steps (0: all passed; a benchmark's
# performance goal missed is a figure, not a failure).
set -uo pipefail
cd "$(dirname "$0")/.."

BUDGET_S=540
if [ -n "${GPU_CHECK_BUDGET_S:-}" ]; then
  case "$GPU_CHECK_BUDGET_S" in
    ''|*[!0-9]*) echo "gpu_check: GPU_CHECK_BUDGET_S must be a number of seconds; got $GPU_CHECK_BUDGET_S" >&2; exit 2 ;;
  esac
  BUDGET_S=$((10#$GPU_CHECK_BUDGET_S))  # (base 10: a leading 0 is no octal)
fi
out=""
sweeps=0
plan=0
for arg in "$@"; do
  case "$arg" in
    --sweeps|--tune)
       want=$([ "$arg" = --sweeps ] && echo 1 || echo 2)
       if [ "$sweeps" != 0 ] && [ "$sweeps" != "$want" ]; then
         echo "gpu_check: --sweeps and --tune are two runs; give one" >&2; exit 2
       fi
       sweeps=$want ;;
    --plan) plan=1 ;;
    --quick) ;;
    -h|--help) sed -n '2,/^set /{/^set /!p}' "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) if [ -n "$out" ]; then echo "gpu_check: one OUT_DIR only; got $out and $arg" >&2; exit 2; fi
       out=$arg ;;
  esac
done
mode=$(case $sweeps in 1) echo sweeps ;; 2) echo tune ;; *) echo default ;; esac)

# ----------------------------------------------------------------------------- the steps
# step NAME LIMIT COMMAND...        run with a time limit, log to NAME.log, record the result
# bench NAME LIMIT SCRIPT ARGS...   a step that runs a Python script, when it is in this checkout
# step_rest NAME MAX COMMAND...     last steps only: a step limited to what is left of the
#                                   budget (at most MAX s), skipped when under 20 s are left;
#                                   it adds nothing to the worst case
# peer_rest NAME MAX COMMAND...     a step_rest for a peer: cut at its limit, it is recorded
#                                   as such, not counted as a failed step; skipped when
#                                   under 60 s are left

gpu_tests() {  # gpu_tests LIMIT: what the compiled kernels do on this GPU, against the reference
  step tests-gpu "$1" "$PY" "${gpu_pytest[@]}"
}
# the GPU tests' command: the small parity corpus runs apart (its step parity-small, in parts,
# benchmarks/gpu_parity.sh): as one test it outran the step on the H200 (2026-11-27), and
# the tests queued behind it on its worker never ran
gpu_pytest_command() {
  gpu_pytest=(-m pytest -m gpu -v -ra --tb=short "${xdist[@]}" -p no:cacheprovider
    --deselect tests/test_parity.py::test_reference_vs_gpu_backend_small_corpus
    --junitxml="$out/tests-gpu.xml" tests)
}

committed_verdicts() {  # the study directory of the tuning sweep: a copy of the committed static
  # verdicts (it also receives the Optuna journal), or $GPU_CHECK_STUDIES; without them the
  # sweep spent its whole budget compiling (the H200's --sweeps run of 2026-11-26: nothing studied)
  studies=${GPU_CHECK_STUDIES:-$out/results/tune/studies}
  if [ -z "${GPU_CHECK_STUDIES:-}" ] && [ $plan -eq 0 ]; then
    mkdir -p "$studies" && cp benchmarks/sweeps/studies/static-verdicts.json "$studies/"
  fi
}

steps_default() {
  # limits from the H200 runs of 2026-11-27: wheels 1 s, info 9-12 s, element-wise 19-22 s,
  # GEMM 26 s without the peer (past 165 s with gemlite's autotuning in it: now peer-gemm),
  # overhead 23-35 s, MoE 26-35 s, the GPU tests cut at 99% twice (175 s, then 220 s on 16
  # workers: they take what is left, at most 280 s), peer-gemm 148 s with no tuned configs
  bench bench-elementwise 35 benchmarks/elementwise.py --quick --out "$out/results/elementwise-quick.json"
  bench bench-gemm 185 benchmarks/gemm.py --quick --out "$out/results/gemm-quick.json"
  bench bench-overhead 45 benchmarks/overhead.py --gpu-checks --out "$out/results"
  bench bench-moe 45 benchmarks/moe.py --quick --out "$out/results/moe-quick.json"
  # never run on a GPU (2026-11-27, ninth session): 5 compiles and ~17 calls of each of 10
  # products; predicted 15-30 s
  bench bench-ragged 45 benchmarks/ragged.py --quick --out "$out/results/ragged-quick.json"
  step_rest tests-gpu 280 "$PY" "${gpu_pytest[@]}"
  step_rest parity-small 150 bash benchmarks/gpu_parity.sh "$PY" "$out/results/parity" small
  # the peers last, in what is left: their first calls autotune (gemlite: minutes where it
  # has no configs for the device; it starts from those earlier runs tuned, benchmarks/peers/,
  # and writes back what it tunes after each variant, so its runs build on each other: it
  # goes first) and compile (torchao). A peer cut at its limit is not a failed step.
  peer_configs
  peer_rest peer-gemm 240 "$PY" benchmarks/gemm.py --quick --peer --peer-cache "$out/results/peers" \
    --out "$out/results/gemm-peer-quick.json"
  peer_rest peer-elementwise 90 "$PY" benchmarks/elementwise.py --quick --peer --shapes 8192x8192 --ops quantize \
    --cases "quantize floor,quantize rceil" --out "$out/results/elementwise-peer-quick.json"
}

peer_configs() {  # the peers' configs tuned by earlier runs (benchmarks/peers/), copied where the
  # run writes them back: commit that folder's files there after the run
  if [ $plan -eq 0 ]; then
    mkdir -p "$out/results/peers" && cp benchmarks/peers/*.json "$out/results/peers/" 2>/dev/null
  fi
  return 0
}

steps_sweeps() {
  # each sweep checks every candidate against the reference before timing it, and stops
  # timing new ones when its own budget (25-30 s under its limit) is spent
  bench sweep-elementwise 115 benchmarks/sweeps/elementwise_sweep.py --out "$out/results" --budget 90
  bench sweep-gemm 185 benchmarks/sweeps/gemm_sweep.py --out "$out/results" --budget 155
  committed_verdicts
  bench sweep-tune 130 benchmarks/sweeps/tune_sweep.py --out "$out/results/tune" --study-dir "$studies" \
    --jobs "$(nproc)" --budget-s 105
  step_rest tests-gpu 150 "$PY" "${gpu_pytest[@]}"
  step_rest parity-small 150 bash benchmarks/gpu_parity.sh "$PY" "$out/results/parity" small
}

steps_tune() {
  committed_verdicts
  bench sweep-tune 180 benchmarks/sweeps/tune_sweep.py --out "$out/results/tune" --study-dir "$studies" \
    --jobs "$(nproc)" --budget-s 155
  bench sweep-grouped 140 benchmarks/sweeps/grouped_sweep.py --out "$out/results" --budget 110
  gpu_tests 155
  step_rest parity-small 150 bash benchmarks/gpu_parity.sh "$PY" "$out/results/parity" small
}

steps_setup() {
  if [ $plan -eq 1 ] || [ -d .whl ]; then
    step wheels 10 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$site" .whl/*.whl
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  else
    printf '%-22s %-26s\n' wheels "none carried (.whl absent)" | tee -a "$out/summary.txt"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  step preflight 15 "$PY" -c "import portable_mx, pydantic, optuna, pytest; print(portable_mx.__file__)"
  if [ $plan -eq 0 ] && [ "$last_rc" -ne 0 ]; then
    echo "gpu_check: portable_mx (or pydantic, optuna, pytest) does not import with $PY: nothing else can run" \
      "(see preflight.log; carry .whl, filled by ../shared/device/fetch-wheels.sh)" | tee -a "$out/summary.txt"
    finish
    exit 100
  fi
  step info 20 bash -c '{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
      --format=csv,noheader 2>/dev/null || rocm-smi --showproductname 2>/dev/null || echo "no nvidia-smi / rocm-smi"; } &&
    "$1" -c "import json, sys; from portable_mx import cli; report = cli.info(); json.dump(report, open(sys.argv[1], \"w\"), indent=1, default=str)" "$2"' \
    info "$PY" "$out/info.json"
  [ $plan -eq 1 ] || sed -n '1,/^backends/{/^backends/!p}' "$out/info.log" >> "$out/summary.txt"
}

# ----------------------------------------------------------------------------- --plan: list, run nothing
if [ $plan -eq 1 ]; then
  PY=python3 out=OUT site=SITE xdist=() last_rc=0
  worst=0
  step() { printf '  %-22s %4s s\n' "$1" "$2"; worst=$((worst + $2)); }
  bench() { step "$@"; }
  step_rest() { printf '  %-22s %4s s  at most: what is left of the budget\n' "$1" "$2"; }
  peer_rest() { step_rest "$@"; }
  echo "gpu_check plan ($mode): steps in run order, with their time limits"
  gpu_pytest_command
  steps_setup
  "steps_$mode"
  echo "worst case $worst s (budget $BUDGET_S s)"
  [ $worst -le $BUDGET_S ]
  exit
fi

# ----------------------------------------------------------------------------- a real run
if [ -n "${GPU_CHECK_BUDGET_S:-}" ]; then  # a budget the fixed steps alone could overrun: the
  # call would be cut before the archive is written (the budget caps only the last steps)
  mode_flag=$(case $mode in sweeps) echo --sweeps ;; tune) echo --tune ;; esac)
  if ! worst=$(bash "$0" --plan $mode_flag | sed -n 's/^worst case \([0-9]*\) s .*/\1/p') || [ -z "$worst" ] ||
      [ "$worst" -gt "$BUDGET_S" ]; then
    echo "gpu_check: GPU_CHECK_BUDGET_S=$BUDGET_S is below the $mode mode's fixed steps (${worst:-?} s, --plan)" >&2
    exit 2
  fi
fi
out=${out:-gpu-check-$(date +%Y%m%d-%H%M%S)}
if ! { mkdir -p "$out/results" && out=$(cd "$out" && pwd); }; then
  echo "gpu_check: cannot use $out as the output folder" >&2
  exit 2
fi
# On the device machine only 8 files of $OUT come back: the logs go under /tmp, and OUT_DIR
# receives summary.txt (a copy, refreshed after every step) and OUT_DIR.tar.gz beside it.
deliver=""
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  case "$out/" in "$(cd "$OUT" && pwd)"/*)
    deliver=$out
    rmdir "$deliver/results" 2>/dev/null
    out=/tmp/gpu-check/$(basename "$deliver")
    rm -rf "$out" && mkdir -p "$out/results" ;;
  esac
fi
archive=${GPU_CHECK_ARCHIVE:-${deliver:-$out}.tar.gz}
site=${GPU_CHECK_SITE:-/tmp/portable_mx-site}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

failed=0
last_rc=0
t_all=$(date +%s)
finish() {  # the archive (written aside, then renamed) and the delivered summary
  tar czf "$archive.part" -C "$(dirname "$out")" "$(basename "$out")" 2>/dev/null && mv -f "$archive.part" "$archive"
  [ -z "$deliver" ] || cp "$out/summary.txt" "$deliver/summary.txt"
}
step() {  # the summary line and the archive are refreshed after every step
  local name=$1 limit=$2 t0 rc verdict=ok; shift 2
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  last_rc=$rc
  if { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && [ -n "${peer_step:-}" ]; then
    verdict="cut at ${limit}s (a peer)"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="TIMEOUT after ${limit}s"; failed=$((failed + 1))
  elif [ $rc -ne 0 ]; then verdict="FAILED (exit $rc)"; failed=$((failed + 1)); fi
  printf '%-22s %-26s %5ss\n' "$name" "$verdict" "$(( $(date +%s) - t0 ))" | tee -a "$out/summary.txt"
  finish
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
  if [ "$limit" -ge "${rest_min:-20}" ]; then step "$name" "$limit" "$@"
  else printf '%-22s %-26s\n' "$name" "skipped (${left}s of budget left)" | tee -a "$out/summary.txt"; fi
}
peer_rest() {  # (under 60 s left a peer is skipped: its first calls alone compile and autotune longer)
  peer_step=1 rest_min=60
  step_rest "$@"
  peer_step="" rest_min=""
}

{
  echo "portable_mx gpu_check ($mode) $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
} > "$out/summary.txt"
cat "$out/summary.txt"
xdist=()
steps_setup
if "$PY" -c "import xdist, execnet" >/dev/null 2>&1; then
  xdist=(-n 16)
  # work stealing (pytest-xdist >= 3.2): an idle worker takes the tests queued behind a slow one
  if "$PY" -c "import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 2))" \
      >/dev/null 2>&1; then xdist+=(--dist worksteal); fi
else printf '%-22s %-26s\n' pytest-xdist "absent: GPU tests on one worker (carry pytest-xdist, execnet)" |
  tee -a "$out/summary.txt"; fi
gpu_pytest_command
"steps_$mode"

echo "total $(( $(date +%s) - t_all ))s, $failed failed step(s)" | tee -a "$out/summary.txt"
finish
exit $failed
