#!/usr/bin/env bash
# Device entry point: S3 rows of specs_call3.jsonl (one at a time), a cProfile'd phase profile of ours at the
# fake world size 8, and the third report's initialisation rows (ours and upstream), into $OUT.
# Carry: .whl_upstream.   bash benchmarks/diag/run_call3.sh
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/call3_out}
mkdir -p "$OUT"
source "$REPO/benchmarks/carried_wheels.sh"
install_site_wheels "$REPO" || exit 1
install_upstream_wheel "$REPO"
export PYTHONPATH=$REPO:/tmp/site PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext BENCH_EXTRA_SITE=/tmp/site
cd "$REPO"
python3 benchmarks/diag/run_s3_rows.py --out "$OUT/rows" --specs benchmarks/diag/specs_call3.jsonl --extra-site /tmp/site \
    --deadline-s 200 --run-name diag/call3_rows
S='{"impl": "ours", "stage": 3, "ds_config": "hf_auto", "dtype": "bf16", "model": "qwen2-3b", "world_size": 8, "warmup": 2, "steps": 3, "profile_steps": 2, "checkpoint_reentrant": false, "cprofile": true, "cprofile_top": 120}'
echo "$S" > "$OUT/profile_spec.json"
timeout 120 python3 benchmarks/profile_phases.py --out "$OUT" --spec "$S" > "$OUT/profile_log.txt" 2>&1
echo "profile rc=$?"; tail -c 400 "$OUT/profile_log.txt"
timeout 240 python3 benchmarks/init_paths.py --out "$OUT/init" --impls ours,upstream --configs report3_bf16,report3_fp32 \
    --jobs 1 --timeout-s 110 2>&1 | tail -n 12
