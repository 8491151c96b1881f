"""Step time of one configuration on several source trees, interleaved round by round in one device call.

For finding which of several commits moved a step time: each tree (a directory holding a checkout, e.g. from
``git archive <commit> | tar -x -C DIR``; ``.`` for this one) runs the same ``throughput`` worker in its own process,
alone on the GPU, and the rounds interleave the trees so that drift of the machine hits every tree alike.

    python benchmarks/diag/bisect_trees.py --out DIR --rounds 2 TREE [TREE ...] [--spec JSON]

Writes ``DIR/bisect.jsonl`` (one record per run: tree, round, step samples, median) and prints the median of the
medians per tree. The default spec is the suite's ZeRO-3 throughput row (``gpt1.3b``, bf16, N=1, GAS 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

from _harness import single_worker_env  # noqa: E402

DEFAULT_SPEC = {
    "impl": "ours",
    "stage": 3,
    "dtype": "bf16",
    "gas": 1,
    "world_size": 1,
    "model": "gpt1.3b",
    "warmup": 2,
    "steps": 8,
    "checkpoint_reentrant": False,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec", default=json.dumps(DEFAULT_SPEC))
    ap.add_argument("--extra-site", default=os.environ.get("BENCH_EXTRA_SITE", "/tmp/site"))
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args()
    spec = json.loads(args.spec)
    os.makedirs(args.out, exist_ok=True)
    medians: dict[str, list[float]] = {t: [] for t in args.trees}
    with open(os.path.join(args.out, "bisect.jsonl"), "a") as sink, tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for index, tree in enumerate(args.trees):
                root = Path(tree).resolve()
                env = single_worker_env("ours", "", args.extra_site, 29800 + index + 10 * rnd, False)
                env["PYTHONPATH"] = os.pathsep.join([str(root), args.extra_site])
                env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
                result = os.path.join(tmp, f"r{rnd}_{index}.json")
                cmd = [sys.executable, str(root / "benchmarks/scenarios/throughput.py"), "--spec", json.dumps(spec)]
                try:
                    proc = subprocess.run(
                        [*cmd, "--result", result],
                        env=env,
                        cwd=str(root),
                        capture_output=True,
                        text=True,
                        timeout=args.timeout_s,
                    )
                    tail = (proc.stdout + proc.stderr)[-1500:]
                except subprocess.TimeoutExpired:
                    tail = "timeout"
                record: dict = {"tree": tree, "round": rnd}
                if os.path.exists(result):
                    with open(result) as f:
                        worker = json.load(f)
                    record.update(
                        status=worker.get("status"),
                        step_times_s=worker.get("step_times_s"),
                        median_step_s=worker.get("median_step_s"),
                        peak_alloc_gib=worker.get("peak_alloc_gib"),
                        peak_reserved_gib=worker.get("peak_reserved_gib"),
                        error=worker.get("error"),
                    )
                    if worker.get("median_step_s"):
                        medians[tree].append(worker["median_step_s"])
                else:
                    record.update(status="error", error=tail)
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                print(json.dumps(record), flush=True)
    for tree, values in medians.items():
        shown = statistics.median(values) if values else None
        print(f"{tree}: median of medians {shown} over {values}")


if __name__ == "__main__":
    main()
