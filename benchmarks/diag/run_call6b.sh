#!/usr/bin/env bash
# Device entry point: the GPU-marked tests of the parameter and initialisation paths, the third report's
# initialisation rows (ours), then the ZeRO-1/2 and offloaded rows of specs_call6b.jsonl, into $OUT.
# The kernels' checks JIT-build the ops first (ninja).
# Carry: .whl_upstream.   bash benchmarks/diag/run_call6b.sh
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/call6b_out}
mkdir -p "$OUT"
source "$REPO/benchmarks/carried_wheels.sh"
install_site_wheels "$REPO" || exit 1
install_upstream_wheel "$REPO"
export PYTHONPATH=$REPO:/tmp/site PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext BENCH_EXTRA_SITE=/tmp/site
cd "$REPO"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv > "$OUT/env.txt" 2>&1
DS_ACCELERATOR=cuda timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/unit/zero3/test_single_rank_gather.py tests/unit/zero3/test_gpu_release.py \
    tests/dist/test_zero3_init_placement.py tests/kernels/test_cuda_kernels.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.txt"
tail -n 5 "$OUT/gpu_tests.txt"
timeout 190 python3 benchmarks/init_paths.py --out "$OUT/init" --impls ours --configs report3_bf16,report3_fp32 \
    --jobs 1 --timeout-s 90 2>&1 | tail -n 12
python3 benchmarks/diag/run_s3_rows.py --out "$OUT/rows" --specs benchmarks/diag/specs_call6b.jsonl --extra-site /tmp/site \
    --deadline-s 120 --run-name diag/call6b_rows
