#!/usr/bin/env bash
# Device entry point for benchmarks/diagnose_step_peak.py: several traced steps side by side, JSON into $OUT.
#   device call: bash benchmarks/diag/run_diag.sh            (carry: .whl_upstream)
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/diag_out}
mkdir -p "$OUT"
source "$REPO/benchmarks/carried_wheels.sh"
install_site_wheels "$REPO" || exit 1
install_upstream_wheel "$REPO"
export PYTHONUNBUFFERED=1 DS_BUILD_OPS=0 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
i=0
for spec in "$@"; do
  i=$((i + 1))
  impl=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["impl"])' "$spec")
  root=$REPO; [ "$impl" = upstream ] && root=/tmp/upstream_ds
  (cd /tmp && PYTHONPATH=$root:/tmp/site MASTER_PORT=$((29600 + i)) MASTER_ADDR=127.0.0.1 \
     timeout 300 python3 "$REPO/benchmarks/diagnose_step_peak.py" --spec "$spec" --out "$OUT" > "$OUT/log_$i.txt" 2>&1; \
     echo "spec $i rc=$?" >> "$OUT/log_$i.txt") &
  if [ $((i % 3)) = 0 ]; then wait; fi
done
wait
tail -n 40 "$OUT"/log_*.txt
