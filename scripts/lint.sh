#!/usr/bin/env bash
# Lint, format and type checks (configured in pyproject.toml); fails on the first tool that reports a finding.
# scripts/run_tests.sh runs it before pytest; .pre-commit-config.yaml runs the same three on a commit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy
