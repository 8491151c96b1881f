#!/usr/bin/env bash
# Set up (idempotent) and run the main job: the `deepspeed` launcher trains a small byte-level GPT (3.3M
# parameters) with ZeRO-3 on the public-domain text in examples/data/, printing train and held-out loss and the
# memory of each phase against the model-state floor; results (metrics.json, memory PNGs) go to runs/main/.
# Uses every local GPU when there are any; otherwise starts 2 CPU processes over gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
CONFIG=${DS_MAIN_CONFIG:-examples/ds_config_gpt_zero3.json}
NGPU=$("${PYTHON:-python3}" -c "from deepspeed.accelerator import get_accelerator as g; a=g(); print(a.device_count() if a.device_name()!='cpu' else 0)")
NPROC=$([ "$NGPU" -gt 0 ] && echo "$NGPU" || echo 2)
[ "$NGPU" -gt 0 ] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec deepspeed --num_gpus "$NPROC" examples/train_gpt.py --deepspeed_config "$CONFIG" --out runs/main "$@"
