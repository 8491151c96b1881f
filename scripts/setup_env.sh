#!/usr/bin/env bash
# Idempotent set-up shared by run_main.sh and run_tests.sh: installs this package (editable) with its test extra
# (pytest, ruff and mypy, and the pinned HF transformers / accelerate for tests/integration) into the current
# Python. If no torch is importable yet, the CPU build is pinned so that a CPU-only machine (CI) never downloads
# multi-GB CUDA wheels; a machine that already has a torch (for example a CUDA build on a GPU box) keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==${DS_CI_TORCH_VERSION:-2.13.0}"
fi
if ! "$PY" -c "import deepspeed, hjson, pytest, pytest_timeout, psutil, cpuinfo, ninja, transformers, accelerate, matplotlib, tensorboard, ruff, mypy" >/dev/null 2>&1 \
   || [ "$("$PY" -c 'import deepspeed,os;print(os.path.dirname(deepspeed.__file__))' 2>/dev/null)" != "$PWD/deepspeed" ]; then
  "$PY" -m pip install -q -e ".[test]"
fi
