"""Run chosen S3 configurations one after the other, each alone on the GPU, into one results file.

    python benchmarks/diag/run_s3_rows.py --out DIR --specs SPECS.jsonl [--deadline-s 500] [--extra-site /tmp/site]

``SPECS.jsonl`` holds one S3 spec per line (``scenarios/s3_zero3.py``: ``impl``, ``stage``, ``model``,
``world_size``, ``micro_batch``, ``seq``, ``offload``; ours only: ``zero`` overrides with a ``tag``); missing keys
get the suite's defaults (bf16, GAS 1, HF "auto" ZeRO-3 values, the engine's default checkpoint form, 2 warm-up
steps, no memory-history trace). Every worker runs by itself, in the listed order, so the step-time ratios of one
call compare like with like; a row that would start after ``--deadline-s`` is recorded ``not_run``. Writes
``DIR/results.jsonl`` (raw records), ``DIR/run_log.txt`` and ``DIR/summary_rows.json`` (``summary.py``'s rows).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

from _harness import default_checkpoint_reentrant, single_worker_env  # noqa: E402

DEFAULTS = {"dtype": "bf16", "gas": 1, "world_size": 1, "warmup": 2, "trace": False, "trace_png": False}


def full_spec(spec: dict, out: Path) -> dict:
    """``spec`` with the suite's defaults filled in."""
    full = {**DEFAULTS, **spec, "out_dir": str(out.resolve())}
    if full["impl"] in ("fsdp2", "plain"):
        full["stage"] = None
    else:
        full.setdefault("stage", 3)
    if full.get("offload"):
        full["warmup"] = spec.get("warmup", 1)
    full.setdefault("checkpoint_reentrant", default_checkpoint_reentrant(full))
    return full


def run_one(spec: dict, out: Path, args: argparse.Namespace, index: int, log) -> dict:
    """One worker process; its record (or an error record)."""
    result = out / f"row_{index}.json"
    env = single_worker_env(spec["impl"], args.upstream_target, args.extra_site, 29600 + index, cpu_only=False)
    worker = str(BENCH / "scenarios" / "s3_zero3.py")
    cmd = [sys.executable, worker, "--spec", json.dumps(spec), "--result", str(result)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.job_timeout_s)
        log.write(f"--- row {index}: {json.dumps(spec)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}\n")
    except subprocess.TimeoutExpired:
        return {"scenario": "s3", **spec, "status": "error", "error": f"timeout after {args.job_timeout_s} s"}
    if result.exists():
        record = json.loads(result.read_text())
        result.unlink()
    else:
        record = {"scenario": "s3", **spec, "status": "error", "error": f"no record (rc {proc.returncode})"}
    record["scenario"] = "s3"  # the suite's name for the scenario (the worker writes its module's)
    record["run_wall_s"] = round(time.perf_counter() - t0, 2)
    return record


def main() -> int:
    """Entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--specs", required=True, help="JSON lines, one S3 spec each")
    ap.add_argument("--deadline-s", type=float, default=500.0)
    ap.add_argument("--job-timeout-s", type=float, default=150.0)
    ap.add_argument("--upstream-target", default="/tmp/upstream_ds")
    ap.add_argument("--extra-site", default="")
    ap.add_argument("--run-name", default="", help="the run's name in summary_rows.json (default: --out's name)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = [full_spec(json.loads(line), out) for line in Path(args.specs).read_text().splitlines() if line.strip()]
    start = time.perf_counter()
    records = []
    with open(out / "run_log.txt", "w") as log:
        for i, spec in enumerate(specs):
            if time.perf_counter() - start > args.deadline_s:
                records.append({"scenario": "s3", **spec, "status": "not_run", "reason": "call deadline"})
                continue
            record = run_one(spec, out, args, i, log)
            records.append(record)
            print(
                f"row {i} {spec['impl']} {spec.get('tag', '')} N={spec['world_size']} stage={spec['stage']}: "
                f"{record.get('status')} step {record.get('step_time_s')} peak {record.get('peak_alloc_gib')} "
                f"{record.get('error', '')[:300]}",
                flush=True,
            )
            log.flush()
    with open(out / "results.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    import summary

    rows = summary.rows_of(records, args.run_name or out.name)
    (out / "summary_rows.json").write_text(json.dumps(rows, indent=1))
    for row in rows:
        print(row["scenario"], row["engine"], row["step_s"], row["peak_alloc_gib"], row["tokens_per_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
