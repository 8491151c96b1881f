"""Compare two ``run_all.py`` result files row by row: device memory must match, step times within noise.

    python benchmarks/compare_runs.py BEFORE/results.jsonl AFTER/results.jsonl [--mem-tol-gib 0.01]
        [--time-tol 0.10] [--json OUT.json]

For checking that a change meant to preserve behaviour (a refactor) leaves the suite's figures where they were.
Rows are matched on their configuration (scenario, implementation, stage, dtype, GAS, world size, model, offload
switches); only rows that ran in both files are compared. Memory counters (peak, before/after step, after init,
init peak) are allocator figures and deterministic, so any difference above ``--mem-tol-gib`` is reported as a
mismatch. Step times and tokens/s move between runs; their ratio is reported, and flagged when it is worse than
``--time-tol`` — meaningful only when both files come from the same device call (the same warm machine, one run
after the other). Exit status 1 when any memory
figure differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# The fields that tell one configuration from another (a run's ``tag`` names a variant).
KEY_FIELDS = (
    "scenario",
    "impl",
    "stage",
    "dtype",
    "gas",
    "world_size",
    "model",
    "offload",
    "offload_param",
    "micro_batch",
    "seq",
    "tag",
)
MEMORY_FIELDS = (
    "peak_alloc_gib",
    "peak_reserved_gib",
    "alloc_before_step_gib",
    "alloc_after_step_gib",
    "alloc_after_init_gib",
    "init_peak_alloc_gib",
    "first_step_peak_alloc_gib",
)
TIME_FIELDS = ("step_time_s",)
RATE_FIELDS = ("tokens_per_s",)


def config_key(r: dict) -> tuple:
    """The configuration of a record (offload switches absent = off)."""
    return tuple(bool(r.get(f)) if f.startswith("offload") else r.get(f) for f in KEY_FIELDS)


def load(path: Path) -> dict[tuple, dict[str, Any]]:
    """The ``status: ok`` rows of a results file, by configuration."""
    rows: dict[tuple, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("status") != "ok":
            continue
        rows[config_key(record)] = record
    return rows


def compare(before: dict[tuple, dict], after: dict[tuple, dict], mem_tol: float, time_tol: float) -> dict[str, Any]:
    """Per-row differences, the rows whose memory moved and the rows slower than ``time_tol``."""
    rows, mem_moved, slower = [], [], []
    for key in sorted(set(before) & set(after), key=str):
        b, a = before[key], after[key]
        row: dict[str, Any] = {"config": dict(zip(KEY_FIELDS, key, strict=True))}
        for field in MEMORY_FIELDS:
            if b.get(field) is None or a.get(field) is None:
                continue
            delta = a[field] - b[field]
            row[field] = {"before": round(b[field], 4), "after": round(a[field], 4), "delta": round(delta, 4)}
            if abs(delta) > mem_tol:
                mem_moved.append((key, field, delta))
        for field in TIME_FIELDS + RATE_FIELDS:
            if not b.get(field) or not a.get(field):
                continue
            # > 1 means the after run is slower, for times and rates alike.
            ratio = a[field] / b[field] if field in TIME_FIELDS else b[field] / a[field]
            row[field] = {"before": round(b[field], 4), "after": round(a[field], 4), "slowdown": round(ratio, 3)}
            if ratio > 1 + time_tol:
                slower.append((key, field, ratio))
        rows.append(row)
    return {
        "rows": rows,
        "only_before": len(set(before) - set(after)),
        "only_after": len(set(after) - set(before)),
        "memory_moved": mem_moved,
        "slower": slower,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--mem-tol-gib", type=float, default=0.01)
    parser.add_argument("--time-tol", type=float, default=0.10)
    parser.add_argument("--json", type=Path, default=None, help="write the full comparison here")
    args = parser.parse_args(argv)
    result = compare(load(args.before), load(args.after), args.mem_tol_gib, args.time_tol)
    for row in result["rows"]:
        c = row["config"]
        name = f"{c['scenario']:<10} {c['impl']:<12} st={c['stage']} gas={c['gas']} ws={c['world_size']} {c['model']}"
        name += " off" if c["offload"] else ""
        name += "+p" if c["offload_param"] else ""
        peak = row.get("peak_alloc_gib")
        mem = f"peak {peak['before']:.3f} -> {peak['after']:.3f}" if peak else ""
        speed = row.get("step_time_s") or row.get("tokens_per_s")
        timing = f"slowdown {speed['slowdown']:.3f}" if speed else ""
        print(f"{name:<58} {mem:<26} {timing}")
    print(
        f"{len(result['rows'])} rows compared ({result['only_before']} only before, {result['only_after']} only "
        f"after); memory moved > {args.mem_tol_gib} GiB: {len(result['memory_moved'])}; slower than "
        f"{1 + args.time_tol:.2f}x: {len(result['slower'])}"
    )
    for key, field, delta in result["memory_moved"]:
        print(f"  MEMORY {dict(zip(KEY_FIELDS, key, strict=True))} {field} {delta:+.4f} GiB")
    for key, field, ratio in result["slower"]:
        print(f"  SLOWER {dict(zip(KEY_FIELDS, key, strict=True))} {field} {ratio:.3f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 1 if result["memory_moved"] else 0


if __name__ == "__main__":
    sys.exit(main())
