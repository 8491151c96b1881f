#!/usr/bin/env bash
# Device call on 2 GPUs (kind nvidia-h200-x2, carry .whl_upstream): run_multi.sh at world size 2 (parity over NCCL,
# then the GPU-marked tests). Kept so the commands recorded in benchmarks/results/COMMANDS.txt still run.
#   bash benchmarks/multigpu/run_x2.sh
exec bash "$(dirname "$0")/run_multi.sh" 2
