#!/usr/bin/env bash
# Device entry point: the GPU-marked tests, then the S3 configurations of SPECS (default
# benchmarks/diag/specs_blocks.jsonl) one after the other, each alone (benchmarks/diag/run_s3_rows.py), into $OUT.
# Carry: .whl_upstream (pydantic & co., upstream's wheel).
#   bash benchmarks/diag/run_s3_rows.sh [SPECS] [RUN_NAME]
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/s3_rows_out}
SPECS=${1:-$REPO/benchmarks/diag/specs_blocks.jsonl}
mkdir -p "$OUT"
source "$REPO/benchmarks/carried_wheels.sh"
install_site_wheels "$REPO" || exit 1
install_upstream_wheel "$REPO"
export PYTHONPATH=$REPO:/tmp/site PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
cd "$REPO"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv > "$OUT/env.txt" 2>&1
python3 -c 'import torch,sys;print(sys.version);print(torch.__version__, torch.version.cuda)' >> "$OUT/env.txt" 2>&1
DS_ACCELERATOR=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/unit/zero3/test_single_rank_gather.py tests/unit/zero3/test_gpu_release.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.txt"
tail -n 5 "$OUT/gpu_tests.txt"
python3 benchmarks/diag/run_s3_rows.py --out "$OUT" --specs "$SPECS" --extra-site /tmp/site \
    --deadline-s "${DEADLINE_S:-430}" --run-name "${2:-$(basename "$OUT")}"
