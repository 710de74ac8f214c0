#!/usr/bin/env bash
# The parity corpus on this GPU's backend (the one the registry selects) against the
# reference backend on the CPU, in parts (quantize, decompose "gain", decompose
# "counterfactual"), each part its own pair of reports and its own comparison, so that a
# run cut at its limit keeps the parts it finished (a report is written only when its
# corpus is done). gpu_check.sh runs it as the step parity-small; as one pytest test the
# small corpus outran the GPU tests' step on the H200 (2026-11-27: still running after
# 160 s, the step cut at 220 s, the tests queued behind it never run).
#
#   benchmarks/gpu_parity.sh PYTHON OUT_DIR [CORPUS]    (CORPUS: small (default) or full)
#
# GPU_PARITY_DEVICE names the device (default cuda; a ROCm torch calls its GPU cuda too).
# Writes OUT_DIR/parity-<part>-{reference,gpu}.json. Exit status: 0 when every part agrees,
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
failed=0
for part in quantize decompose-gain decompose-counterfactual; do
  ref="$out/parity-$part-reference.json" gpu="$out/parity-$part-gpu.json"
  echo "== $part ($corpus corpus)"
  if ! "$py" -m portable_mx.cli parity --corpus "$corpus" --device cpu --backend reference \
      --filter "$part/*" --json "$ref"; then
    failed=$((failed + 1)); continue
  fi
  "$py" -m portable_mx.cli parity --corpus "$corpus" --device "$device" --filter "$part/*" --json "$gpu"
  if [ ! -f "$gpu" ]; then failed=$((failed + 1)); continue; fi
  # the GPU report must come from a GPU backend: the reference on the GPU proves nothing here
  if ! "$py" -c 'import json, sys; used = json.load(open(sys.argv[1]))["backends"]; print("backends", used)
sys.exit(f"gpu_parity: only the reference backend served the GPU: {used}" if set(used.values()) == {"reference"} else 0)' "$gpu"
  then failed=$((failed + 1)); continue; fi
  "$py" -m portable_mx.cli parity --compare "$ref" "$gpu" || failed=$((failed + 1))
done
echo "gpu_parity: $failed of 3 part(s) failed"
exit "$failed"
