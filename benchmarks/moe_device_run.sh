#!/usr/bin/env bash
# GPU entry point of the MoE benchmark (no registry there): install the carried wheels, then run
# benchmarks/scenarios/moe.py for ours and upstream into $OUT.
#   device call: bash benchmarks/moe_device_run.sh [moe.py arguments]      (carry: .whl_upstream)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/carried_wheels.sh
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
install_site_wheels . || exit 1
install_upstream_wheel .
export PYTHONUNBUFFERED=1
python3 benchmarks/scenarios/moe.py --out "$OUT" --extra-site /tmp/site --upstream-target /tmp/upstream_ds \
  --world-sizes 1,2,4,8 --impls ours,upstream "$@" 2>&1 | tee "$OUT/moe_stdout.txt"
