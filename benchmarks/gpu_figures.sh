#!/usr/bin/env bash
# The GPU figures of docs/long_context.md, docs/offload.md, docs/nvme.md, docs/observability.md and
# docs/checkpoints.md, in groups whose part limits each sum to under one device call's 600 s. Run a group through
# the device entry point, which installs the carried wheels first:
#   bash benchmarks/device_run.sh benchmarks/gpu_figures.sh long|offload|more|final|diag|spfake|extra|recheck|next|core|late|baselines|step|tiled|gil|hostdiag|delayed|resume|maxlen|disk|route|verify|maxlen2|smoke|largest|verify2|verify3|maxlen3|largest3|bounds|maxlen4|resident|zenflow2|largest4
#   (no argument: all; several groups comma-separated, e.g. delayed,baselines)
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

GROUP=${1:-all}
want() { [[ $GROUP == all || ",$GROUP," == *",$1,"* ]]; }  # GROUP may list several, comma-separated

if want long; then
  # Long sequences (3B Qwen2-shaped, ZeRO-3, optimizer offloaded): one process per row, lengths in increasing order
  # until the first that runs out of device memory (benchmarks/long_context_gpu.py).
  LC="python3 benchmarks/long_context_gpu.py --out $WORK/long_context.jsonl"
  ALST="--tile-mlp 8 --tile-loss 16 --act-offload --warmup-seq 8192"
  part long_ours 170 $LC --impl ours $ALST --lengths 32768,131072,262144 --budget-s 160
  part long_upstream 150 $LC --impl upstream $ALST --lengths 32768,131072,262144 --budget-s 140
  part long_plain 55 $LC --impl ours --lengths 8192,16384,24576,32768,49152 --budget-s 45
  part long_resident 75 $LC --impl ours --tile-mlp 8 --tile-loss 16 --lengths 32768,131072 --budget-s 65
  cp "$WORK/long_context.jsonl" "$OUT/"
  # The S3 row at 8192 tokens (micro-batch 4 x 2048): ours with the tiled loss against FSDP2 on the plain model.
  S3="python3 benchmarks/run_all.py --scenario s3 --extra-site /tmp/site --job-timeout-s 50"
  ROW='"seq": 2048, "micro_batch": 4, "trace": false, "warmup": 1, "timed_steps": 3'
  # Two shard counts for the loss: 16 narrow head products may cost step time at this length; 4 runs beside it.
  part tiled_8192 140 bash -c "$S3 --out $WORK/tiled_8192_ours16 --impl ours --set '{$ROW, \"tile_loss\": 16}' \
    && $S3 --out $WORK/tiled_8192_ours4 --impl ours --set '{$ROW, \"tile_loss\": 4}' \
    && $S3 --out $WORK/tiled_8192_fsdp2 --impl fsdp2 --set '{$ROW}'"
fi

if want offload; then
  # Offloaded step of the 3B model at 8192 tokens: overlapped, synchronous and 16-bit states, beside the floor.
  part offload_3b 190 python3 benchmarks/offload_overlap_gpu.py --layers 36 --seq 8192 --steps 3 \
    --cases overlap_on,overlap_off,bf16_states,floor --out "$WORK/offload_3b.jsonl"
  # Upstream 0.19.8 and FSDP2 with CPU offload on the same 3B step.
  part offload_baselines 120 python3 benchmarks/run_all.py --scenario s3 --impl upstream,fsdp2 \
    --out "$WORK/offload_baselines" --extra-site /tmp/site --job-timeout-s 58 \
    --set '{"seq": 8192, "offload": true, "trace": false, "warmup": 1, "timed_steps": 2}'
  # Monitors and the FLOPs profiler on against off: 40 steps per engine in alternating windows (10 could not tell
  # a 1 % difference from noise).
  part monitor_overhead 70 python3 benchmarks/monitor_overhead.py --steps 40 --out "$WORK/monitor_overhead.json"
fi

if want more; then
  # Second pass on the same machine: upstream's ALST row at 128K, the plain row's bracket (after a short warm-up
  # step), the overlapped/synchronous host step in the other order, and NVMe against CPU offload on a 1.2B model
  # of the same shape (its swap files fit the machine's disk; it needs more than 100 s with the async I/O op's
  # build).
  LC="python3 benchmarks/long_context_gpu.py --out $WORK/long_more.jsonl"
  part long_more_upstream 130 $LC --impl upstream --tile-mlp 8 --tile-loss 16 --act-offload --warmup-seq 4096 \
    --lengths 32768,131072 --budget-s 400
  part long_more_plain 70 $LC --impl ours --warmup-seq 4096 --lengths 16384,24576,32768,49152 --budget-s 400
  cp "$WORK/long_more.jsonl" "$OUT/"
  part offload_order 100 python3 benchmarks/offload_overlap_gpu.py --layers 36 --seq 8192 --steps 3 \
    --cases overlap_off,overlap_on --out "$WORK/offload_order.jsonl"
  part offload_nvme 180 python3 benchmarks/offload_overlap_gpu.py --layers 12 --seq 8192 --steps 1 \
    --cases overlap_on,nvme --nvme-path /tmp/nvme_swap --out "$WORK/offload_nvme.jsonl"
fi

if want diag; then
  # Where the offloaded step's time goes: forward, backward and step apart, the optimizer's phases per thread and
  # one profiled step, for the overlapped and the synchronous host step.
  part offload_diag 300 python3 benchmarks/offload_overlap_gpu.py --layers 36 --seq 8192 --steps 3 \
    --cases overlap_on,overlap_on_long_route,overlap_off,floor --breakdown --breakdown-dir "$WORK/offload_diag_prof" --out "$WORK/offload_diag.jsonl"
  part monitor_overhead 70 python3 benchmarks/monitor_overhead.py --steps 40 --out "$WORK/monitor_overhead.json"
fi

if want recheck; then
  # The offloaded 3B step with the one-pass host Adam, with fp32 and with 16-bit states, beside upstream 0.19.8 and
  # FSDP2 with CPU offload in the same call.
  part offload_recheck 135 python3 benchmarks/offload_overlap_gpu.py --layers 36 --seq 8192 --steps 3 \
    --cases overlap_on,bf16_states --out "$WORK/offload_recheck.jsonl"
  part offload_baselines 120 python3 benchmarks/run_all.py --scenario s3 --impl upstream,fsdp2 \
    --out "$WORK/offload_baselines" --extra-site /tmp/site --job-timeout-s 58 \
    --set '{"seq": 8192, "offload": true, "trace": false, "warmup": 1, "timed_steps": 2}'
fi

if want next || want core; then
  # One call for what is still unmeasured: the offloaded step with its phases (after the restore, side-tensor and
  # norm changes) with and without clipping, beside its floor; the 8192-token tiled-loss rows; the monitor overhead
  # (first: the shortest). ``core`` is the first two parts alone, for a call with little device time left.
  part monitor_overhead 70 python3 benchmarks/monitor_overhead.py --steps 40 --out "$WORK/monitor_overhead.json"
  part offload_next 240 python3 benchmarks/offload_overlap_gpu.py --layers 36 --seq 8192 --steps 3 \
    --cases overlap_on,overlap_on_noclip,floor --breakdown --out "$WORK/offload_next.jsonl"
fi

if want next || want tiled; then
  S3="python3 benchmarks/run_all.py --scenario s3 --extra-site /tmp/site --job-timeout-s 50"
  ROW='"seq": 2048, "micro_batch": 4, "trace": false, "warmup": 1, "timed_steps": 3'
  # Ours on the plain model too: which part of a step-time gap to FSDP2 is the tiling's and which the engine's.
  # 2 and 4 loss shards (16 cost 0.035 s more than 4 in call K): fewer, wider head products, a larger logits tile.
  part tiled_8192 180 bash -c "$S3 --out $WORK/tiled_8192_ours2 --impl ours --set '{$ROW, \"tile_loss\": 2}' \
    && $S3 --out $WORK/tiled_8192_ours4 --impl ours --set '{$ROW, \"tile_loss\": 4}' \
    && $S3 --out $WORK/tiled_8192_fsdp2 --impl fsdp2 --set '{$ROW}' \
    && $S3 --out $WORK/tiled_8192_ours0 --impl ours --set '{$ROW}'"
fi

if want final; then
  # One trial each on either side of the 2x line (ours with 16-bit states at 14.2 B parameters, upstream with
  # fp32 states at 7.1 B), then the universal conversion.
  LM="python3 benchmarks/largest_model_gpu.py --out $WORK/largest.jsonl"
  part largest_ours 170 $LM --impl ours --states bf16 --bisect 180,230 --budget-s 160
  part largest_upstream 120 $LM --impl upstream --states fp32 --bisect 88,110 --budget-s 110
  cp "$WORK/largest.jsonl" "$OUT/"
  part universal 95 python3 benchmarks/universal_convert_gpu.py --layers 18 --out "$WORK/universal.json"
fi

if want extra; then
  # The 3B model's universal conversion: the checkpoint on the disk, the universal folder in host memory (one
  # 64 GiB disk cannot hold both), then the SP=8 fake-group rows.
  part universal_3b 190 python3 benchmarks/universal_convert_gpu.py --layers 36 --universal-dir /dev/shm/universal \
    --out "$WORK/universal_3b.json"
fi

if want spfake || want extra; then
  # Ulysses sequence parallelism at SP=8 on one GPU: rank 0 of PyTorch's fake 8-rank group (collectives move no
  # data, so its allocations are one rank's), the 3B model with ALST, ZeRO-3 and the optimizer offloaded; per-rank
  # peaks beside the floor at each total length (benchmarks/sp_fake_group_gpu.py).
  part sp_fake 150 python3 benchmarks/sp_fake_group_gpu.py --tile-mlp 8 --tile-loss 16 --act-offload \
    --lengths 131072,262144,524288 --budget-s 140 --out "$WORK/sp_fake.jsonl"
  cp "$WORK/sp_fake.jsonl" "$OUT/"
fi

if want late || want baselines; then
  # Upstream 0.19.8 and FSDP2 with CPU offload on the 3B step.
  part offload_baselines 120 python3 benchmarks/run_all.py --scenario s3 --impl upstream,fsdp2 \
    --out "$WORK/offload_baselines" --extra-site /tmp/site --job-timeout-s 58 \
    --set '{"seq": 8192, "offload": true, "trace": false, "warmup": 1, "timed_steps": 2}'
fi

if want late || want disk; then
  # The disk under /tmp (where the NVMe rows swap): write and read throughput of the async I/O op per setting.
  part aio_disk 90 python3 benchmarks/kernels/bench_aio.py --dir /tmp/aio_bench --mib 1024 --queue-depths 1,8,32 \
    --threads 1,4 --out "$WORK/aio_disk.jsonl"
fi

if want late; then
  # NVMe optimizer state alone in its process (its resident memory without another case's leftovers; the swaps
  # pipelined, several requests in flight); upstream's step at 7.09 B parameters with a limit long enough for its
  # set-up.
  part offload_nvme_alone 130 python3 benchmarks/offload_overlap_gpu.py --layers 12 --seq 8192 --steps 1 \
    --cases nvme_pipelined --nvme-path /tmp/nvme_swap --out "$WORK/offload_nvme_alone.jsonl"
  part largest_upstream 220 python3 benchmarks/largest_model_gpu.py --out "$WORK/largest_upstream.jsonl" \
    --impl upstream --states fp32 --bisect 88,110 --budget-s 210
  cp "$WORK/largest_upstream.jsonl" "$OUT/" 2>/dev/null
fi

if want resume; then
  # The GPU-marked tests first (streams, events and kernels run for real only there); pytest and pytest-timeout
  # come from the image, or else from carried wheels (.whl_upstream/tests).
  GPU_TESTS=$(grep -rl 'mark.gpu' tests | sort | tr '\n' ' ')
  part gpu_tests 150 bash -c "{ python3 -c 'import pytest_timeout' 2>/dev/null || python3 -m pip install -q \
    --no-index --no-deps --no-compile --target /tmp/site .whl_upstream/tests/*.whl; } && DS_ACCELERATOR=cuda python3 -m pytest -q -p no:cacheprovider --timeout=120 -m gpu \
    --continue-on-collection-errors $GPU_TESTS; python3 -m pytest -q -p no:cacheprovider --timeout=120 \
    tests/kernels/test_cpu_adam.py -k gil"
fi

if want hostdiag || want resume; then
  # The host update alone at 1 B parameters, from the main thread or a worker, with and without the rounded copy
  # (to page-locked or pageable staging), and with page-locked master and gradient: which difference from the
  # floor's update makes the engine's slower.
  part host_adam_variants 150 python3 benchmarks/offload_overlap_gpu.py --cases host_adam_variants --steps 4 \
    --variant-params 1000000000 --out "$WORK/host_adam_variants.jsonl"
fi

if want resume || want step; then
  # The offloaded step with and without clipping (with ``baselines``: beside upstream and FSDP2 in one call).
  part offload_resume 200 python3 benchmarks/offload_overlap_gpu.py --layers 36 --seq 8192 --steps 3 \
    --cases overlap_on,overlap_on_noclip,floor --breakdown --out "$WORK/offload_resume.jsonl"
fi

if want gil; then
  # The offloaded step with the short switch interval on and off, with and without clipping; then the host update
  # beside a busy training thread (chunk size, switch interval, worker threads).
  part offload_switch 230 python3 benchmarks/offload_overlap_gpu.py --layers 36 --seq 8192 --steps 3 --breakdown \
    --cases overlap_on_noclip,overlap_on_noclip_long_switch,overlap_on,overlap_on_long_switch \
    --out "$WORK/offload_switch.jsonl"
  part host_contention 120 python3 benchmarks/host_adam_contention.py --params 1000000000 --chunk-mib 64,256 \
    --switch-ms 5,0.5 --out "$WORK/host_contention.jsonl"
fi

if want delayed || want verify; then
  # The one-step-delayed update (ZenFlow, ZeRO-2, optimizer on the host) against the same model with its
  # optimizer on the GPU; 6 timed steps so the median spans the 4-step update interval.
  part offload_delayed 170 python3 benchmarks/offload_overlap_gpu.py --layers 36 --seq 8192 --steps 6 \
    --cases zenflow,gpu_resident --out "$WORK/offload_delayed.jsonl"
fi

if want maxlen; then
  # The longest step with ALST, on either side of the 1.25x line: upstream at 256K (its 128K step peaked at 35 GiB
  # allocated and 59.5 GiB reserved of 80), then ours at 320K (1.25 x 256K). One length each, after the 8192-token
  # warm-up step (a warm-up sets no step-time estimate, so the length is always tried).
  LC="python3 benchmarks/long_context_gpu.py --out $WORK/maxlen.jsonl"
  ALST="--tile-mlp 8 --tile-loss 16 --act-offload --warmup-seq 8192 --budget-s 600"
  part maxlen_upstream 230 $LC --impl upstream $ALST --lengths 262144
  part maxlen_ours 320 $LC --impl ours $ALST --lengths 327680
  cp "$WORK/maxlen.jsonl" "$OUT/"
fi

if want smoke; then
  # A short check of the delayed update on an NCCL group (4 layers, 2048 tokens): the step completes and how it
  # compares with the GPU-resident step at that size; not the 3B figure of the delayed group.
  part delayed_small 75 python3 benchmarks/offload_overlap_gpu.py --layers 4 --seq 2048 --steps 6 \
    --cases zenflow,gpu_resident --out "$WORK/delayed_small.jsonl"
fi

if want verify || want smoke; then
  # The page-locking and activation-offload tests on the device, before the long run that depends on them.
  part gpu_offload_tests 60 bash -c "{ python3 -c 'import pytest_timeout' 2>/dev/null || python3 -m pip install -q \
    --no-index --no-deps --no-compile --target /tmp/site .whl_upstream/tests/*.whl; } && DS_ACCELERATOR=cuda \
    python3 -m pytest -q -p no:cacheprovider --timeout=50 -m gpu tests/unit/test_activation_offload_gpu.py \
    tests/dist/test_gpu_engine_modes.py"
fi

if want verify2; then
  # The delayed update at 4 layers with the column-indexed packing, then the GPU tests with the CUDA ops built
  # beforehand (a build inside a test ran past its time limit) and a report per test in the output.
  part delayed_small2 100 python3 benchmarks/offload_overlap_gpu.py --layers 4 --seq 2048 --steps 6 \
    --cases zenflow,gpu_resident --out "$WORK/delayed_small2.jsonl"
  part ops_build 120 env DS_ACCELERATOR=cuda python3 -c "from deepspeed.ops.op_builder.utils import UtilsBuilder; \
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder; \
from deepspeed.ops.op_builder.cpu_adam import CPUAdamBuilder; [b().load() for b in (UtilsBuilder, FusedAdamBuilder, CPUAdamBuilder)]"
  part gpu_tests2 200 bash -c "{ python3 -c 'import pytest_timeout' 2>/dev/null || python3 -m pip install -q \
    --no-index --no-deps --no-compile --target /tmp/site .whl_upstream/tests/*.whl; } && DS_ACCELERATOR=cuda \
    python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --timeout=150 --junitxml=$WORK/gpu_tests2.xml -m gpu \
    tests/unit/test_activation_offload_gpu.py tests/dist/test_gpu_engine_modes.py"
fi

if want verify3; then
  # verify2 cut to fit a short budget: the GPU tests first (the CUDA ops built by the first test that needs them),
  # then the delayed update at 4 layers.
  part gpu_tests3 160 bash -c "{ python3 -c 'import pytest_timeout' 2>/dev/null || python3 -m pip install -q \
    --no-index --no-deps --no-compile --target /tmp/site .whl_upstream/tests/*.whl; } && DS_ACCELERATOR=cuda \
    python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --timeout=140 --junitxml=$WORK/gpu_tests3.xml -m gpu \
    tests/unit/test_activation_offload_gpu.py tests/dist/test_gpu_engine_modes.py"
  part delayed_small3 70 python3 benchmarks/offload_overlap_gpu.py --layers 4 --seq 2048 --steps 6 \
    --cases zenflow,gpu_resident --out "$WORK/delayed_small3.jsonl"
fi

if want maxlen3; then
  # 16x the plain model's maximum: the plain model between 32K and 48K (36K, then 40K), then this package at 512K
  # with 64 loss shards (at 400K the 16-shard logits tile was 36 of the 61 GiB allocated; 64 shards: about 39 GiB
  # in all at 512K by the floor formula, and about 108 GiB on the host). The step's attention grows with the
  # square of the length (241 s at 400K): about 590K is the longest step one 600 s call can hold.
  LC="python3 benchmarks/long_context_gpu.py --out $WORK/maxlen3.jsonl"
  part maxlen_plain_36k 80 $LC --impl ours --lengths 36864,40960 --budget-s 70
  part maxlen_ours_512k 440 $LC --impl ours --tile-mlp 8 --tile-loss 64 --act-offload --warmup-seq 8192 \
    --budget-s 430 --lengths 524288
  cp "$WORK/maxlen3.jsonl" "$OUT/"
fi

if want bounds; then
  # The plain model's maximum length between 32K (ok) and 48K (out of device memory), in 2K steps; upstream with
  # its own 16-bit states at 110 layers (8.8 B parameters: half of the 18.04 B this package trained with 16-bit
  # states; upstream holds about 20 host bytes per parameter that way); the GPU tests.
  LC="python3 benchmarks/long_context_gpu.py --out $WORK/bounds.jsonl"
  part bounds_plain 90 $LC --impl ours --lengths 34816,36864 --budget-s 80
  cp "$WORK/bounds.jsonl" "$OUT/"
  LM="python3 benchmarks/largest_model_gpu.py --out $WORK/bounds_largest.jsonl"
  part bounds_upstream_bf16 260 $LM --impl upstream --states bf16 --bisect 110,110 --budget-s 250
  cp "$WORK/bounds_largest.jsonl" "$OUT/" 2>/dev/null
  part gpu_tests4 150 bash -c "{ python3 -c 'import pytest_timeout' 2>/dev/null || python3 -m pip install -q \
    --no-index --no-deps --no-compile --target /tmp/site .whl_upstream/tests/*.whl; } && DS_ACCELERATOR=cuda \
    python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --timeout=140 --junitxml=$WORK/gpu_tests4.xml -m gpu \
    tests/unit/test_activation_offload_gpu.py tests/dist/test_gpu_engine_modes.py"
fi

if want maxlen4; then
  # This package at MAXLEN4_SEQ tokens (16x the plain model's first failing length from `bounds`), one step with
  # no warm-up: the step alone takes most of one call at these lengths.
  LC="python3 benchmarks/long_context_gpu.py --out $WORK/maxlen4.jsonl"
  part maxlen_ours_16x 570 $LC --impl ours --tile-mlp 8 --tile-loss 64 --act-offload --budget-s 565 \
    --lengths "${MAXLEN4_SEQ:?set MAXLEN4_SEQ}"
  cp "$WORK/maxlen4.jsonl" "$OUT/" 2>/dev/null
fi

if want resident; then
  # The maximum length without activation offload (tiling on, every layer input kept on the device), in
  # increasing lengths until the first that runs out of device memory; 32K completed in call A.
  LC="python3 benchmarks/long_context_gpu.py --out $WORK/resident.jsonl"
  part resident_ours 330 $LC --impl ours --tile-mlp 8 --tile-loss 64 \
    --lengths "${RESIDENT_LENGTHS:-131072,196608,262144,327680}" --budget-s 320
  cp "$WORK/resident.jsonl" "$OUT/" 2>/dev/null
fi

if want zenflow2; then
  # The GPU tests (ZenFlow at stages 1 and 2 over NCCL among them), then ZenFlow against the GPU-resident step at
  # 36 layers with the step's breakdown, after the segmented publish and the columns' gradient gathered on the
  # device.
  part gpu_tests5 160 bash -c "{ python3 -c 'import pytest_timeout' 2>/dev/null || python3 -m pip install -q \
    --no-index --no-deps --no-compile --target /tmp/site .whl_upstream/tests/*.whl; } && DS_ACCELERATOR=cuda \
    python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --timeout=140 --junitxml=$WORK/gpu_tests5.xml -m gpu \
    tests/unit/test_activation_offload_gpu.py tests/dist/test_gpu_engine_modes.py"
  part offload_zenflow2 220 bash -c "python3 benchmarks/offload_overlap_gpu.py --layers 36 --seq 8192 --steps 6 \
    --breakdown --breakdown-dir $WORK/offload_zenflow2_profile --cases zenflow,gpu_resident \
    --out $WORK/offload_zenflow2.jsonl; rm -f $WORK/offload_zenflow2_profile/*.trace.json"  # traces: too large
fi

if want maxlen2; then
  # Upstream's ALST step at 320K (it completed 256K), then ours at 400K (1.25 x 320K) with the activation buffers
  # page-locked at their own size (at 320K, power-of-two pinned buffers held 107.8 GiB of the host's 128).
  LC="python3 benchmarks/long_context_gpu.py --out $WORK/maxlen2.jsonl"
  ALST="--tile-mlp 8 --tile-loss 16 --act-offload --warmup-seq 8192 --budget-s 600"
  part maxlen_upstream_320k 230 $LC --impl upstream $ALST --lengths 327680
  part maxlen_ours_400k 300 $LC --impl ours $ALST --lengths 409600
  cp "$WORK/maxlen2.jsonl" "$OUT/" 2>/dev/null
fi

if want largest; then
  # The largest model with fp32 states on both sides (upstream was killed for host memory at 88 layers, 7.09 B;
  # ours trained 18.04 B with 16-bit states), then upstream with its own 16-bit states.
  LM="python3 benchmarks/largest_model_gpu.py --out $WORK/largest2.jsonl"
  part largest_upstream_fp32 200 $LM --impl upstream --states fp32 --bisect 60,84 --budget-s 190
  part largest_ours_fp32 200 $LM --impl ours --states fp32 --bisect 100,130 --budget-s 190
  part largest_upstream_bf16 190 $LM --impl upstream --states bf16 --bisect 150,200 --budget-s 180
  cp "$WORK/largest2.jsonl" "$OUT/" 2>/dev/null
fi

if want largest3; then
  # One trial each where call Q left off: upstream with fp32 states between its 60 layers (ok) and 88 (killed),
  # ours with fp32 states past 130 layers (ok at 116.8 GiB of the host's 128). An upstream trial takes about 2 min.
  LM="python3 benchmarks/largest_model_gpu.py --out $WORK/largest3.jsonl"
  part largest_upstream_fp32_74 210 $LM --impl upstream --states fp32 --bisect 74,74 --budget-s 200
  part largest_ours_fp32_140 130 $LM --impl ours --states fp32 --bisect 140,140 --budget-s 120
  cp "$WORK/largest3.jsonl" "$OUT/" 2>/dev/null
fi

if want largest4; then
  # The largest model with 16-bit states on both sides, now that one rank keeps each parameter built on the device
  # as its own shard: upstream one trial past its 110 layers (call R, 101 GiB host), ours from 250 layers up (call D:
  # 230 layers ok, its 67.9 GiB device peak the copy initialize made). A 250-layer step is 19.6 B parameters, 2x
  # upstream at 124 layers.
  LM="python3 benchmarks/largest_model_gpu.py --out $WORK/largest4.jsonl"
  part largest_upstream_bf16_125 240 $LM --impl upstream --states bf16 --bisect 125,125 --budget-s 230
  part largest_ours_bf16 300 $LM --impl ours --states bf16 --bisect 250,300 --budget-s 290
  cp "$WORK/largest4.jsonl" "$OUT/" 2>/dev/null
fi

if want route; then
  # The offloaded 3B step with clipping (its update after the norm now stepped on the training thread) beside the
  # floor's parts (the host update alone from a worker thread is in hostdiag), and with 16-bit states: the host
  # update reads and writes half the state bytes, which shows if it is bound by memory bandwidth.
  part offload_route 260 python3 benchmarks/offload_overlap_gpu.py --layers 36 --seq 8192 --steps 4 --breakdown \
    --cases overlap_on,bf16_states,floor --out "$WORK/offload_route.jsonl"
fi
