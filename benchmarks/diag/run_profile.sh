#!/usr/bin/env bash
# Device entry point for benchmarks/profile_phases.py: ours vs lean-off per ZeRO stage on the S1 model, one
# process after another on an otherwise idle GPU, JSON into $OUT (carry: .whl_upstream for pydantic & co.).
#   bash benchmarks/diag/run_profile.sh
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/profile_out}
mkdir -p "$OUT"
source "$REPO/benchmarks/carried_wheels.sh"
install_site_wheels "$REPO" || exit 1
export PYTHONPATH=$REPO:/tmp/site PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
for stage in 2 1 3; do
  for impl in ours ours_leanoff; do
    timeout 120 python3 "$REPO/benchmarks/profile_phases.py" --out "$OUT" \
      --spec "{\"impl\": \"$impl\", \"stage\": $stage, \"dtype\": \"bf16\"}" 2>&1 | tail -n 1 | tee -a "$OUT/summary.txt"
  done
done
