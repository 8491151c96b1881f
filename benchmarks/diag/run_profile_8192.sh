#!/usr/bin/env bash
# Device entry point: one ZeRO-3 step of ours next to FSDP2's at 8192 tokens (qwen2-3b, micro-batch 4 x seq 2048),
# profiled by benchmarks/profile_phases.py (2 warm-up steps, 3 timed, 2 profiled), one process after the other on an
# otherwise idle GPU, JSON into $OUT, then side-by-side tables (stdout and $OUT/profile_compare*.md).
# Setup as scenario S3: HF "auto" ZeRO-3 values (_harness.hf_auto_config), torch AdamW fused, clipping 1.0,
# activation checkpointing inside every decoder layer (non-reentrant for ours and FSDP2, as
# _harness.default_checkpoint_reentrant gives them); FSDP2: fully_shard per layer, bf16 compute, fp32 reduce.
# Extra arguments are A/B variants of ours, each TAG=JSON of zero_optimization keys, profiled after the two and
# compared with ours, e.g.  master_off='{"lean_gather_from_master": false}'.
# Carry: .whl_upstream (pydantic & co.).
#   bash benchmarks/diag/run_profile_8192.sh [TAG=JSON ...]
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/profile_out}
mkdir -p "$OUT"
source "$REPO/benchmarks/carried_wheels.sh"
install_site_wheels "$REPO" || exit 1
export PYTHONPATH=$REPO:/tmp/site PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
COMMON='"dtype": "bf16", "model": "qwen2-3b", "micro_batch": 4, "seq": 2048, "warmup": 2, "steps": 3, "profile_steps": 2, "ds_config": "hf_auto", "checkpoint_reentrant": false, "cprofile": true'
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/summary.txt"
profile() {  # IMPL [TAG ZERO_JSON]
  local extra=""
  [ -n "${2:-}" ] && extra=", \"tag\": \"$2\", \"zero\": $3"
  local spec="{\"impl\": \"$1\", \"stage\": 3, $COMMON$extra}"
  echo "$spec" >>"$OUT/COMMANDS.txt"
  timeout 200 python3 "$REPO/benchmarks/profile_phases.py" --out "$OUT" --spec "$spec" >>"$OUT/log.txt" 2>&1
  echo "$1 ${2:-}: rc=$?" | tee -a "$OUT/summary.txt"
  tail -n 1 "$OUT/log.txt" | tee -a "$OUT/summary.txt"
}
profile ours
profile fsdp2
for variant in "$@"; do
  profile ours "${variant%%=*}" "${variant#*=}"
done
compare() {  # A B MD
  if [ -f "$1" ] && [ -f "$2" ]; then
    python3 "$REPO/benchmarks/profile_phases.py" --compare "$1" "$2" --md "$3"
  else
    echo "a profile is missing ($1, $2): no comparison"; tail -n 30 "$OUT/log.txt"
  fi
}
compare "$OUT/ours_z3_8192tok.json" "$OUT/fsdp2_z3_8192tok.json" "$OUT/profile_compare.md"
for variant in "$@"; do
  tag=${variant%%=*}
  compare "$OUT/ours_z3_8192tok.json" "$OUT/ours_z3_8192tok_$tag.json" "$OUT/profile_compare_$tag.md"
done
