#!/usr/bin/env bash
# Sourced by the ci/*.sh scripts (not run on its own): move to the repository root and
# define PY (the venv's python when .venv exists, else `python`), PMX (the portable-mx
# command line run by it) and REPORTS (where reports go: $PORTABLE_MX_REPORTS or ci/reports).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python
fi
PMX=("$PY" -m portable_mx.cli)
REPORTS=${PORTABLE_MX_REPORTS:-ci/reports}
mkdir -p "$REPORTS"
