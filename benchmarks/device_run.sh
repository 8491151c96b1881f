#!/usr/bin/env bash
# The GPU machine's entry point (it has no package index): install the carried wheels, record the environment,
# then run the benchmark runner into $OUT.
#   bash benchmarks/device_run.sh --scenario s3 --impl ours,upstream,fsdp2 [--set JSON] [--variant NAME=JSON]
#   bash benchmarks/device_run.sh benchmarks/multigpu/run_multi.sh [MAX_GPUS]     (a script instead of the runner)
# Carry .whl_upstream/ (`python benchmarks/baselines/upstream.py prepare` fills it): its site/ folder holds the
# pure-Python wheels the GPU image lacks (pydantic and its dependencies, hjson), installed into /tmp/site; the
# folder itself holds upstream DeepSpeed 0.19.8's wheel, installed into /tmp/upstream_ds (a failure only warns:
# the upstream runs then fail on their own).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
pip_target /tmp/site .whl_upstream/site/*.whl || exit 1
pip_target /tmp/upstream_ds .whl_upstream/deepspeed-0.19.8-py3-none-any.whl || echo "upstream install FAILED"
export BENCH_EXTRA_SITE=/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext PYTHONUNBUFFERED=1 OUT
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda)'
  python3 -c 'import torch; print("torch threads", torch.get_num_threads()); print(torch.__config__.parallel_info())'
  lscpu  # cores, threads per core and NUMA nodes: the host optimizer's figures depend on them
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [[ "${1:-}" == *.sh ]]; then
  script=$1; shift
  PYTHONPATH=$PWD:/tmp/site bash "$script" "$@" 2>&1 | tee "$OUT/stdout.txt"
else
  python3 benchmarks/run_all.py --out "$OUT" --extra-site /tmp/site "$@" 2>&1 | tee "$OUT/stdout.txt"
fi
