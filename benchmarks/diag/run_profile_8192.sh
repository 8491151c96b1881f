#!/usr/bin/env bash
# Device entry point: one ZeRO-3 step of ours next to FSDP2's at 8192 tokens (qwen2-3b, micro-batch 4 x seq 2048),
# profiled by benchmarks/profile_phases.py (2 warm-up steps, 3 timed, 2 profiled), one process after the other on an
# otherwise idle GPU, JSON into $OUT, then a side-by-side table (stdout and $OUT/profile_compare.md).
# Setup as scenario S3: HF "auto" ZeRO-3 values (_harness.hf_auto_config), torch AdamW fused, clipping 1.0,
# activation checkpointing inside every decoder layer (non-reentrant for ours and FSDP2, as
# _harness.default_checkpoint_reentrant gives them); FSDP2: fully_shard per layer, bf16 compute, fp32 reduce.
# Carry: .whl_upstream (pydantic & co.).
#   bash benchmarks/diag/run_profile_8192.sh
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/profile_out}
mkdir -p "$OUT"
source "$REPO/benchmarks/carried_wheels.sh"
install_site_wheels "$REPO" || exit 1
export PYTHONPATH=$REPO:/tmp/site PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
COMMON='"dtype": "bf16", "model": "qwen2-3b", "micro_batch": 4, "seq": 2048, "warmup": 2, "steps": 3, "profile_steps": 2, "ds_config": "hf_auto", "checkpoint_reentrant": false'
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/summary.txt"
for impl_stage in "ours 3" "fsdp2 3"; do
  set -- $impl_stage
  spec="{\"impl\": \"$1\", \"stage\": $2, $COMMON}"
  echo "$spec" >>"$OUT/COMMANDS.txt"
  timeout 200 python3 "$REPO/benchmarks/profile_phases.py" --out "$OUT" --spec "$spec" >"$OUT/log_$1.txt" 2>&1
  echo "$1: rc=$?" | tee -a "$OUT/summary.txt"
  tail -n 1 "$OUT/log_$1.txt" | tee -a "$OUT/summary.txt"
done
if [ -f "$OUT/ours_z3_8192tok.json" ] && [ -f "$OUT/fsdp2_z3_8192tok.json" ]; then
  python3 "$REPO/benchmarks/profile_phases.py" --compare "$OUT/ours_z3_8192tok.json" "$OUT/fsdp2_z3_8192tok.json" \
    --md "$OUT/profile_compare.md"
else
  echo "a profile is missing: no comparison (see $OUT/log_*.txt)"
  tail -n 30 "$OUT"/log_*.txt
fi
