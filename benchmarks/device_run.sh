#!/usr/bin/env bash
# The GPU machine's entry point (no registry there): install the carried wheels, then run the suite into $OUT.
#   device call: bash benchmarks/device_run.sh [run_all.py arguments]      (carry: .whl_upstream)
# .whl_upstream/ holds upstream DeepSpeed's no-ops wheel (baselines/upstream.py prepare) and, in site/, the
# pure-Python wheels the GPU image lacks (pydantic, pydantic-core, annotated-types, typing-inspection, hjson),
# needed by our engine and upstream alike.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl_upstream/site/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/upstream_ds \
    .whl_upstream/deepspeed-0.19.8-py3-none-any.whl || echo "upstream install FAILED (upstream rows will fail)"
export BENCH_EXTRA_SITE=/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch,sys;print(sys.version);print(torch.__version__, torch.version.cuda)'; \
  (cd /tmp && PYTHONPATH=/tmp/upstream_ds:/tmp/site python3 -c 'import deepspeed;print("upstream", deepspeed.__version__, deepspeed.__file__)') 2>&1 | tail -1; \
  PYTHONPATH=$PWD:/tmp/site python3 -c 'import deepspeed;print("ours", deepspeed.__version__, deepspeed.__file__)' 2>&1 | tail -1; \
  python3 -c 'import matplotlib; print("matplotlib", matplotlib.__version__)' 2>&1 | tail -1; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 benchmarks/run_all.py --out "$OUT" --extra-site /tmp/site --command-line "bash benchmarks/device_run.sh $*" "$@" 2>&1 | tee "$OUT/stdout.txt"
