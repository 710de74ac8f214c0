#!/usr/bin/env bash
# The reference backend's report of the full corpus on the CPU: the anchor that the GPU
# reports (ci/gpu_parity.sh) are compared with across vendors (ci/compare_reports.sh).
# Takes a few minutes on a CI runner. Writes ci/reports/parity-cpu-reference-full.json.
#   ci/cpu_reference.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"
unset TRITON_INTERPRET
"${PMX[@]}" parity --corpus full --device cpu --backend reference --json "$REPORTS/parity-cpu-reference-full.json"
