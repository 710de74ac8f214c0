#!/usr/bin/env bash
# On a GPU runner: parity reports of the backend the registry selects for the GPU and of the
# reference backend on the same GPU (full corpus), then their comparison.
#   ci/gpu_parity.sh VENDOR        (VENDOR: nvidia or amd; names the reports)
# Writes ci/reports/parity-VENDOR-gpu-full.json and parity-VENDOR-reference-full.json.
# Fails when the GPU is not the vendor's or when the registry picks the reference backend
# for it (then there is no GPU backend to check).
set -euo pipefail
vendor=${1:?usage: ci/gpu_parity.sh VENDOR (nvidia or amd)}
case "$vendor" in
  nvidia|amd) ;;
  *) echo "ci/gpu_parity.sh: VENDOR must be nvidia or amd; got $vendor" >&2; exit 2 ;;
esac
source "$(dirname "$0")/common.sh"
unset TRITON_INTERPRET PORTABLE_MX_BACKEND
gpu="$REPORTS/parity-$vendor-gpu-full.json"
ref="$REPORTS/parity-$vendor-reference-full.json"
status=0
"${PMX[@]}" parity --corpus full --device cuda --json "$gpu" || status=$?
if [ ! -f "$gpu" ]; then exit $((status ? status : 1)); fi
"$PY" - "$gpu" "$vendor" <<'PYEOF' || exit 1
import json, sys

report, vendor = json.load(open(sys.argv[1])), sys.argv[2]
versions, used = report["versions"], report["backends"]
is_amd = bool(versions.get("hip"))
if (vendor == "amd") != is_amd:
    sys.exit(f"gpu_parity: asked for {vendor} but torch is a {'ROCm' if is_amd else 'CUDA'} build "
             f"on {report['device']['description']}")
if set(used.values()) == {"reference"}:
    sys.exit(f"gpu_parity: the registry selected only the reference backend on "
             f"{report['device']['description']} ({used}): no GPU backend to check")
print(f"gpu_parity: {vendor}: {report['device']['description']}, backends {used}")
PYEOF
"${PMX[@]}" parity --corpus full --device cuda --backend reference --json "$ref" || status=$?
if [ -f "$ref" ]; then
  "${PMX[@]}" parity --compare "$ref" "$gpu" || status=$?
fi
exit "$status"
