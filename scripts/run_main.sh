#!/usr/bin/env bash
# Set up (idempotent) and run the main job: the `deepspeed` launcher training a small model.
# Uses every local GPU when there are any; otherwise starts 2 CPU processes over gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
CONFIG=${DS_MAIN_CONFIG:-examples/ds_config_main.json}
NGPU=$("${PYTHON:-python3}" -c "from deepspeed.accelerator import get_accelerator as g; a=g(); print(a.device_count() if a.device_name()!='cpu' else 0)")
NPROC=$([ "$NGPU" -gt 0 ] && echo "$NGPU" || echo 2)
exec deepspeed --num_gpus "$NPROC" examples/train_tiny.py --deepspeed_config "$CONFIG" "$@"
