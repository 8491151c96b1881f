#!/usr/bin/env bash
# Set up (idempotent), run the lint, format and type checks (scripts/lint.sh), then the whole CPU test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/lint.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider --timeout=600 "$@" tests
