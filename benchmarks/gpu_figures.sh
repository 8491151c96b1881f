#!/usr/bin/env bash
# One GPU call for the figures of docs/long_context.md, docs/offload.md and docs/observability.md, and the main
# job's memory plot on a GPU. Run through the device entry point, which installs the carried wheels first:
#   bash benchmarks/device_run.sh benchmarks/gpu_figures.sh
# Each part has its own time limit so one slow part cannot starve the others; each part's outputs land in
# $OUT/<part>.tgz as soon as it ends, and $OUT/summary.txt collects the last lines of each part's log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_figures}
WORK=/tmp/gpu_figures_work
mkdir -p "$OUT" "$WORK"
python3 -c "import matplotlib" 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_upstream/mpl/*.whl
export PYTHONPATH=$PWD:/tmp/site

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0)) s" >>"$OUT/summary.txt"
  tail -n 25 "$WORK/$name.log" >>"$OUT/summary.txt"
  tar -czf "$OUT/$name.tgz" -C "$WORK" $(cd "$WORK" && ls -d "$name"*)
}

# The main job on one GPU: device-allocator memory per phase against the floor, and the loss curves.
part main 60 python3 -m deepspeed.launcher.runner --num_gpus 1 examples/train_gpt.py \
  --deepspeed_config examples/ds_config_gpt_zero3.json --out "$WORK/main" --steps 60
# Long sequences: the 3B Qwen2-shaped model at 32K tokens, ZeRO-3 with the optimizer offloaded: ours untiled and
# with tiled MLP + tiled logits/loss (upstream 0.19.8 tiled comes last).
LONG='"seq": 32768, "offload": true, "trace": false, "warmup": 1, "timed_steps": 1'
part long_context 200 python3 benchmarks/run_all.py --scenario s3 --impl ours --out "$WORK/long_context" \
  --extra-site /tmp/site --job-timeout-s 100 --set "{$LONG}" --variant tiled='{"tile_mlp": 8, "tile_loss": 16}'
# Offloaded step: overlapped against synchronous host step, beside the floor of its parts.
[ -f benchmarks/offload_overlap_gpu.py ] &&
  part offload_overlap 100 python3 benchmarks/offload_overlap_gpu.py --layers 12 --seq 8192 --steps 3 \
    --out "$WORK/offload_overlap.jsonl"
# Monitors and the FLOPs profiler on against off.
part monitor_overhead 45 python3 benchmarks/monitor_overhead.py --steps 10 --out "$WORK/monitor_overhead.json"
# Upstream 0.19.8 on the tiled long-sequence row.
part long_context_upstream 100 python3 benchmarks/run_all.py --scenario s3 --impl upstream \
  --out "$WORK/long_context_upstream" --extra-site /tmp/site --job-timeout-s 95 \
  --set "{$LONG, \"tile_mlp\": 8, \"tile_loss\": 16}"
