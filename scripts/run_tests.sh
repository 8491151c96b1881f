#!/usr/bin/env bash
# Set up (idempotent) and run the whole CPU test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider --timeout=600 "$@" tests
