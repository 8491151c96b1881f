#!/usr/bin/env bash
# Client checks on one CUDA GPU, results into $OUT: the CUDA-context check after `import deepspeed`, then
# Lightning's Trainer with strategy="deepspeed_stage_2" and "deepspeed_stage_3" (the image must ship lightning).
#   OUT=results/clients bash benchmarks/clients/run_gpu.sh [--smoke]
# On a machine without a package index: bash benchmarks/device_run.sh benchmarks/clients/run_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/clients_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}${BENCH_EXTRA_SITE:+:$BENCH_EXTRA_SITE}" PYTHONUNBUFFERED=1
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
python3 benchmarks/clients/cuda_import_check.py --out "$OUT" "$@" > "$OUT/cuda_import_check.txt" 2>&1
rc=$?
tail -n 1 "$OUT/cuda_import_check.txt"
# Lightning gates on the installed distribution's metadata (as for any user, who pip-installs the package), so it
# runs against an installed copy rather than the source tree on PYTHONPATH.
python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/ours_installed . > "$OUT/install.txt" 2>&1
PYTHONPATH="/tmp/ours_installed${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/clients/lightning_gpu.py --out "$OUT" "$@" \
  > "$OUT/lightning.txt" 2>&1
lrc=$?
tail -n 3 "$OUT/lightning.txt"
rm -rf "$OUT/lightning_work"   # checkpoints: large and not needed once the records are written
exit $(( rc || lrc ))
