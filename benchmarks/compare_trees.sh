#!/usr/bin/env bash
# One device call that checks a behaviour-preserving change: run the suite's lean-on and lean-off rows of ours on
# an earlier tree and on this one, one after the other on the same warm GPU, then compare them row by row.
#   device call: bash benchmarks/compare_trees.sh BEFORE_DIR [run_all.py arguments]   (carry: .whl_upstream, BEFORE_DIR)
# BEFORE_DIR holds the earlier tree, e.g. `mkdir .before_tree && git archive <commit> | tar -x -C .before_tree`.
# Writes $OUT/before/, $OUT/after/ (run_all.py outputs) and $OUT/compare.json; prints the comparison.
set -uo pipefail
cd "$(dirname "$0")/.."
BEFORE=${1:?usage: compare_trees.sh BEFORE_DIR [run_all.py arguments]}
shift
source benchmarks/carried_wheels.sh
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
install_site_wheels . || exit 1
export BENCH_EXTRA_SITE=/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext PYTHONUNBUFFERED=1
ARGS=(--world-sizes 1,8 --impls ours,ours_leanoff --extra-site /tmp/site "$@")
(cd "$BEFORE" && python3 benchmarks/run_all.py --out "$OUT/before" --command-line "compare_trees.sh before" "${ARGS[@]}") \
  > "$OUT/before_stdout.txt" 2>&1
python3 benchmarks/run_all.py --out "$OUT/after" --command-line "compare_trees.sh after" "${ARGS[@]}" \
  > "$OUT/after_stdout.txt" 2>&1
python3 benchmarks/compare_runs.py "$OUT/before/results.jsonl" "$OUT/after/results.jsonl" --json "$OUT/compare.json"
