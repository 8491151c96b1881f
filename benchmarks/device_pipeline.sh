#!/usr/bin/env bash
# GPU entry point of the pipeline benchmark (no registry on the GPU machine): install the carried wheels, then run
# benchmarks/scenarios/pipeline.py (ours and upstream DeepSpeed 0.19.8, GAS 1, 2, 4, 8, 16) into $OUT.
#   device call: bash benchmarks/device_pipeline.sh [pipeline.py arguments]      (carry: .whl_upstream)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/carried_wheels.sh
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
install_site_wheels . || exit 1
install_upstream_wheel .
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch,sys;print(sys.version);print(torch.__version__, torch.version.cuda)'; \
  (cd /tmp && PYTHONPATH=/tmp/upstream_ds:/tmp/site python3 -c 'import deepspeed;print("upstream", deepspeed.__version__, deepspeed.__file__)') 2>&1 | tail -1; \
  PYTHONPATH=$PWD:/tmp/site python3 -c 'import deepspeed;print("ours", deepspeed.__version__, deepspeed.__file__)' 2>&1 | tail -1; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 benchmarks/scenarios/pipeline.py --out "$OUT" --extra-site /tmp/site "$@" 2>&1 | tee "$OUT/stdout.txt"
