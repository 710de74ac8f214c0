#!/usr/bin/env bash
# The cross-vendor step: compare every parity report under DIR (searched recursively, as
# actions/download-artifact lays them out), one comparison per corpus. Reports are named
# parity-<where>-<backend>-<corpus>.json; a reference report, when there is one, is the
# baseline. Fails on any mismatch, or when no corpus has two reports to compare.
#   ci/compare_reports.sh DIR
set -euo pipefail
dir=${1:?usage: ci/compare_reports.sh DIR}
dir=$(cd "$dir" && pwd)
source "$(dirname "$0")/common.sh"
status=0
compared=0
for corpus in small full; do
  files=()
  while IFS= read -r f; do files+=("$f"); done < <(
    find "$dir" -type f -name "parity-*-reference-$corpus.json" | sort
    find "$dir" -type f -name "parity-*-$corpus.json" ! -name "parity-*-reference-$corpus.json" | sort
  )
  if [ "${#files[@]}" -ge 2 ]; then
    echo "== corpus $corpus: ${#files[@]} reports"
    "${PMX[@]}" parity --compare "${files[@]}" || status=1
    compared=$((compared + 1))
  elif [ "${#files[@]}" -eq 1 ]; then
    echo "== corpus $corpus: only ${files[0]}; nothing to compare it with"
  fi
done
if [ "$compared" -eq 0 ]; then
  echo "ci/compare_reports.sh: no corpus has two parity reports under $dir" >&2
  exit 1
fi
exit "$status"
