#!/usr/bin/env bash
# On several GPUs of one host (through benchmarks/device_run.sh, which installs the carried wheels): parity of ZeRO
# stages 0-3 over NCCL through our launcher at every world size in 2, 4, 8 that the machine has, then the
# GPU-marked tests (real streams: release under a lagging compute stream, the CUDA kernels, offload transfers).
# Results under $OUT (parity_nccl_ws<W>.jsonl, parity_log_ws<W>.txt, gpu_tests.txt, env.txt).
#   bash benchmarks/device_run.sh benchmarks/multigpu/run_multi.sh [MAX_GPUS]      (default: every visible GPU)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/multi_out}
mkdir -p "$OUT"
# NVLink multicast stays off; the launcher passes the environment to every rank.
export PYTHONPATH=$PWD:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    TORCH_EXTENSIONS_DIR=/tmp/torch_ext PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch,sys;print(sys.version);print(torch.__version__, torch.version.cuda, torch.cuda.device_count())'
  } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
visible=$(python3 -c 'import torch; print(torch.cuda.device_count())')
max=${1:-$visible}
status=0
for world in 2 4 8; do
    if (( world > max || world > visible )); then
        continue
    fi
    start=$(date +%s)
    timeout 300 python3 -m deepspeed.launcher.runner --num_gpus "$world" benchmarks/multigpu/parity.py \
        --out "$OUT/parity_nccl_ws$world.jsonl" > "$OUT/parity_log_ws$world.txt" 2>&1
    rc=$?
    (( rc == 0 )) || status=1
    echo "parity world size $world rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/parity_log_ws$world.txt"
    cat "$OUT/parity_nccl_ws$world.jsonl" 2>/dev/null
done
start=$(date +%s)
DS_ACCELERATOR=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/unit/zero3/test_gpu_release.py tests/kernels/test_cuda_kernels.py tests/unit/zero/test_offload_transfers_gpu.py \
    tests/unit/zero3/test_parked_window.py tests/unit/test_clipping_norm.py \
    > "$OUT/gpu_tests.txt" 2>&1
rc=$?
(( rc == 0 )) || status=1
echo "gpu tests rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu_tests.txt"
tail -n 15 "$OUT/gpu_tests.txt"
exit $status
