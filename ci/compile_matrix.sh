#!/usr/bin/env bash
# Compile every kernel launch for every GPU target (NVIDIA and AMD) on this machine, which
# needs no GPU, and check what the targets must show (native MX instructions, shared memory,
# spills). Writes ci/reports/compile-matrix.json; exits non-zero when a config fails.
#   ci/compile_matrix.sh [extra compile-matrix arguments]
set -euo pipefail
source "$(dirname "$0")/common.sh"
# The interpreter would replace compilation: make sure it is off.
unset TRITON_INTERPRET
"${PMX[@]}" compile-matrix --json "$REPORTS/compile-matrix.json" "$@"
