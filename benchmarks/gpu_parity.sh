#!/usr/bin/env bash
# The parity corpus on this GPU's backend (the one the registry selects) against the
# reference backend on the CPU, in three parts run at once (quantize, decompose "gain",
# decompose "counterfactual"), each part its own pair of reports, its own comparison and
# its own log, so that a run cut at its limit keeps the parts it finished (a report is
# written only when its corpus is done). gpu_check.sh runs it as the step parity-small;
# as one pytest test the small corpus outran the GPU tests' step on the H200 (2026-11-27:
# still running after 160 s, the step cut at 220 s, the tests queued behind it never ran).
#
#   benchmarks/gpu_parity.sh PYTHON OUT_DIR [CORPUS]    (CORPUS: small (default) or full)
#
# GPU_PARITY_DEVICE names the device (default cuda; a ROCm torch calls its GPU cuda too).
# Writes OUT_DIR/parity-<part>-{reference,gpu}.json and parity-<part>.log (printed when
# the part ends). Exit status: 0 when every part agrees,
# else the number of parts that failed (a mismatch, an error, or only the reference
# backend serving the GPU).
set -uo pipefail
py=${1:?usage: benchmarks/gpu_parity.sh PYTHON OUT_DIR [CORPUS]}
out=${2:?usage: benchmarks/gpu_parity.sh PYTHON OUT_DIR [CORPUS]}
corpus=${3:-small}
device=${GPU_PARITY_DEVICE:-cuda}
case "$corpus" in small|full) ;; *) echo "gpu_parity: CORPUS must be small or full; got $corpus" >&2; exit 2 ;; esac
mkdir -p "$out" || exit 2
unset TRITON_INTERPRET PORTABLE_MX_BACKEND
# one part: the reference's report on the CPU, the GPU backend's, the check that a GPU
# backend served it, their comparison; its log is OUT_DIR/parity-<part>.log
part_run() {
  local part=$1 ref="$out/parity-$1-reference.json" gpu="$out/parity-$1-gpu.json"
  echo "== $part ($corpus corpus)"
  "$py" -m portable_mx.cli parity --corpus "$corpus" --device cpu --backend reference \
    --filter "$part/*" --json "$ref" || return 1
  "$py" -m portable_mx.cli parity --corpus "$corpus" --device "$device" --filter "$part/*" --json "$gpu"
  [ -f "$gpu" ] || return 1
  # the GPU report must come from a GPU backend: the reference on the GPU proves nothing here
  "$py" -c 'import json, sys; used = json.load(open(sys.argv[1]))["backends"]; print("backends", used)
sys.exit(f"gpu_parity: only the reference backend served the GPU: {used}" if set(used.values()) == {"reference"} else 0)' \
    "$gpu" || return 1
  "$py" -m portable_mx.cli parity --compare "$ref" "$gpu"
}

# the three parts at once (compiling the kernels is the host's work, and a GPU machine has
# cores to spare: one after another, the GPU half of the small corpus ran past 160 s)
parts=(quantize decompose-gain decompose-counterfactual)
pids=()
for part in "${parts[@]}"; do
  part_run "$part" > "$out/parity-$part.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!parts[@]}"; do
  wait "${pids[$i]}" || failed=$((failed + 1))
  cat "$out/parity-${parts[$i]}.log"
done
echo "gpu_parity: $failed of ${#parts[@]} part(s) failed"
exit "$failed"
