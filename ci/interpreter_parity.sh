#!/usr/bin/env bash
# The Triton kernels under the Triton interpreter on the CPU against the reference backend:
# parity reports of both on the small corpus, then their comparison (bit-exact bytes,
# statistics within fp32 summation-order noise). Runs anywhere, no GPU.
#   ci/interpreter_parity.sh
# Writes ci/reports/parity-cpu-reference-small.json and parity-cpu-triton-interpret-small.json.
set -euo pipefail
source "$(dirname "$0")/common.sh"
# Must be set before triton is imported: the triton-interpret backend serves CPU tensors
# only in an interpreter process.
export TRITON_INTERPRET=1
ref="$REPORTS/parity-cpu-reference-small.json"
interp="$REPORTS/parity-cpu-triton-interpret-small.json"
status=0
"${PMX[@]}" parity --corpus small --device cpu --backend reference --json "$ref" || status=$?
"${PMX[@]}" parity --corpus small --device cpu --backend triton-interpret --json "$interp" || status=$?
# Compare whatever was written, even when a run reported errors: the table says which cases.
if [ -f "$ref" ] && [ -f "$interp" ]; then
  "${PMX[@]}" parity --compare "$ref" "$interp" || status=$?
fi
exit "$status"
