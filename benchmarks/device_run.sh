#!/usr/bin/env bash
# The GPU machine's entry point (no registry there): install the carried wheels, then run the suite into $OUT.
#   device call: bash benchmarks/device_run.sh [run_all.py arguments]      (carry: .whl_upstream)
# What .whl_upstream/ holds: benchmarks/carried_wheels.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/carried_wheels.sh
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
install_site_wheels . || exit 1
install_upstream_wheel .
export BENCH_EXTRA_SITE=/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch,sys;print(sys.version);print(torch.__version__, torch.version.cuda)'; \
  (cd /tmp && PYTHONPATH=/tmp/upstream_ds:/tmp/site python3 -c 'import deepspeed;print("upstream", deepspeed.__version__, deepspeed.__file__)') 2>&1 | tail -1; \
  PYTHONPATH=$PWD:/tmp/site python3 -c 'import deepspeed;print("ours", deepspeed.__version__, deepspeed.__file__)' 2>&1 | tail -1; \
  python3 -c 'import matplotlib; print("matplotlib", matplotlib.__version__)' 2>&1 | tail -1; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 benchmarks/run_all.py --out "$OUT" --extra-site /tmp/site --command-line "bash benchmarks/device_run.sh $*" "$@" 2>&1 | tee "$OUT/stdout.txt"
