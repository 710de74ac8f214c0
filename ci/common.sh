#!/usr/bin/env bash
# Sourced by the ci/*.sh scripts (not run on its own): move to the repository root and
# define PY (the python that runs the checks), PMX (the portable-mx command line run by it)
# and REPORTS (where reports go: $PORTABLE_MX_REPORTS or ci/reports).
# PY is $PYTHON when set (a venv called by its full path, a CI runner's interpreter,
# `conda run`: whatever python has portable_mx; the tests pass their own), else the
# project's .venv/bin/python when .venv exists, else python3 from PATH.
set -euo pipefail
PY=${PYTHON:-}
# a relative path names a file from where the caller stands, before the cd below
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
PMX=("$PY" -m portable_mx.cli)
REPORTS=${PORTABLE_MX_REPORTS:-ci/reports}
mkdir -p "$REPORTS"
