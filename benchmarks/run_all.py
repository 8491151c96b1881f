"""Run every benchmark scenario, each configuration in its own process, and write JSON lines + a markdown report.

    python benchmarks/run_all.py --out DIR [--quick] [--world-sizes 1,8] [--only s1,s2,throughput]

Scenarios (see each file's docstring): S1 gradient accumulation (``scenarios/s1_grad_accum.py``), S2
initialisation (``scenarios/s2_init.py``), throughput (``scenarios/throughput.py``), S3 ZeRO-3
(``scenarios/s3_zero3.py``, a slot until stage 3 lands; ``--with-s3``). Implementations: ``ours`` (lean switches
on), ``ours_leanoff`` (lean switches off = upstream behaviour per mechanism), ``upstream`` (DeepSpeed 0.19.8 from
``--upstream-target``, see ``baselines/upstream.py``), ``fsdp2`` (``baselines/fsdp2.py``).

Scheduling: memory scenarios run up to ``--jobs`` workers at once on the one GPU (allocator statistics are per
process, so sharing the GPU does not change the memory figures), admitted while the sum of their estimated peaks
stays under ``--mem-budget-gib``; throughput workers run alone afterwards. Jobs are launched in priority order
and no job is started that would not finish before ``--deadline-s`` (estimates per job); whatever is left is
recorded as ``status: not_run``. Outputs: ``DIR/results.jsonl``, ``DIR/run_log.txt`` (each worker's output
tail), ``DIR/benchmarks.md`` (+ ``DIR/plots.png`` when matplotlib is there), and a short table on stdout.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

from models import MODELS

SCRIPTS = {
    "s1": BENCH / "scenarios" / "s1_grad_accum.py",
    "s2": BENCH / "scenarios" / "s2_init.py",
    "throughput": BENCH / "scenarios" / "throughput.py",
    "s3": BENCH / "scenarios" / "s3_zero3.py",
}
DS_IMPLS = ("ours", "ours_leanoff", "upstream")
# One-rank groups still open a TCP store: give every worker its own port, away from the usual 29500.
PORT_BASE = 20000 + (os.getpid() % 400) * 100


@dataclass
class Job:
    """One worker to run."""

    spec: dict
    est_s: float
    est_gib: float
    solo: bool = False
    proc: subprocess.Popen | None = None
    started: float = 0.0
    result_file: str = ""
    log_file: str = ""
    record: dict = field(default_factory=dict)


def _floor_gib(stage: int | None, n: int, params: int) -> float:
    """Model-state floor (bf16/fp16 params and grads, fp32 Adam) in GiB (FSDP2: everything sharded)."""
    if stage is None:
        return 16 * params / n / 2**30
    per = {0: 16.0, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]
    return per * params / 2**30


def _estimate_gib(spec: dict) -> float:
    params = MODELS[spec["model"]].num_params()
    factor = {"ours": 1.25, "ours_leanoff": 1.6, "upstream": 1.8, "fsdp2": 1.3}[spec["impl"]]
    return factor * _floor_gib(spec.get("stage"), int(spec.get("world_size", 1)), params) + 3.0


def _specs(args: argparse.Namespace) -> list[Job]:
    """Every job, in priority order (the ones the acceptance figures need first)."""
    quick = args.quick
    s1_model, s2_model = ("quick", "quick-s2") if quick else ("gpt1.3b", "gpt2.6b")
    impls = [i for i in args.impls.split(",") if i]
    ds_impls = [i for i in impls if i in DS_IMPLS]
    wss = [int(w) for w in args.world_sizes.split(",")]
    only = set(args.only.split(",")) if args.only else {"s1", "s2", "throughput"} | ({"s3"} if args.with_s3 else set())
    dtypes = args.dtypes.split(",")
    gas_list = [int(g) for g in args.gas.split(",")]
    per_micro = 0.05 if quick else 0.4  # seconds per micro-step when workers share the GPU (2 warm + 2 measured)
    base_s = 8.0 if quick else 22.0
    jobs: list[Job] = []

    def add(scenario: str, est_s: float, solo: bool = False, **spec: object) -> None:
        spec = {"scenario": scenario, **spec}
        jobs.append(Job(spec=spec, est_s=est_s, est_gib=_estimate_gib(spec), solo=solo))

    if "s2" in only:
        for ws in wss:
            for stage in (1, 2):
                for impl in ds_impls:
                    add("s2", base_s, impl=impl, stage=stage, dtype="bf16", world_size=ws, model=s2_model)
            if "fsdp2" in impls:
                add("s2", base_s, impl="fsdp2", stage=None, dtype="bf16", world_size=ws, model=s2_model)
    if "s1" in only:
        for ws in wss:
            gas_here = gas_list if ws == 1 else [g for g in gas_list if g in (1, max(gas_list))]
            # fp16 at N > 1 would skip every step: the fake group leaves reduced gradients uninitialised (overflow).
            for dtype in (dtypes if ws == 1 else [d for d in dtypes if d != "fp16"]):
                for gas in sorted(gas_here, key=lambda g: (g not in (1, max(gas_here)), g)):
                    for stage in (1, 2):
                        for impl in ds_impls:
                            add("s1", base_s + 3 * gas * per_micro, impl=impl, stage=stage, dtype=dtype, gas=gas,
                                world_size=ws, model=s1_model)
                    if "fsdp2" in impls and dtype == "bf16":
                        add("s1", base_s + 3 * gas * per_micro, impl="fsdp2", stage=None, dtype=dtype, gas=gas,
                            world_size=ws, model=s1_model)
    if "s3" in only:
        add("s3", base_s, impl="ours", stage=3, dtype="bf16", gas=1, world_size=1, model=s1_model)
    if "throughput" in only:
        for stage in (0, 1, 2):
            for impl in ds_impls:
                if stage == 0 and impl == "ours_leanoff":
                    continue  # the lean switches act on ZeRO-1/2 only
                add("throughput", base_s * 0.8, solo=True, impl=impl, stage=stage, dtype="bf16", gas=1,
                    world_size=1, model=s1_model, warmup=2, steps=args.tp_steps)
        if "fsdp2" in impls:
            add("throughput", base_s * 0.8, solo=True, impl="fsdp2", stage=None, dtype="bf16", gas=1,
                world_size=1, model=s1_model, warmup=2, steps=args.tp_steps)
    return jobs


def _env(spec: dict, args: argparse.Namespace, port: int, threads: int) -> dict:
    env = dict(os.environ)
    extra = [args.extra_site] if args.extra_site else []
    root = args.upstream_target if spec["impl"] == "upstream" else str(REPO)
    env["PYTHONPATH"] = os.pathsep.join([root] + extra)
    env.update(PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", OMP_NUM_THREADS=str(threads), DS_BUILD_OPS="0")
    return env


def _launch(job: Job, args: argparse.Namespace, tmp: str, index: int, threads: int) -> None:
    job.result_file = os.path.join(tmp, f"r{index}.json")
    job.log_file = os.path.join(tmp, f"l{index}.txt")
    spec = {k: v for k, v in job.spec.items() if k != "scenario"}
    cmd = [sys.executable, str(SCRIPTS[job.spec["scenario"]]), "--spec", json.dumps(spec), "--result", job.result_file]
    with open(job.log_file, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        job.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd="/tmp",
                                    env=_env(job.spec, args, PORT_BASE + index, threads), start_new_session=False)
    job.started = time.perf_counter()


def _collect(job: Job, killed: str | None) -> None:
    rc = job.proc.wait() if job.proc is not None else None
    wall = time.perf_counter() - job.started
    tail = Path(job.log_file).read_text(errors="replace")[-3000:] if job.log_file else ""
    if killed is None and os.path.exists(job.result_file):
        job.record = json.loads(Path(job.result_file).read_text())
    else:
        why = killed or f"worker exited with code {rc} and wrote no result"
        job.record = {**job.spec, "status": "error", "error": why, "traceback": tail}
    job.record["scenario"] = job.spec["scenario"]
    job.record["job_wall_s"] = round(wall, 2)
    job.record["ran_beside_others"] = not job.solo and args_jobs_gt1


args_jobs_gt1 = False


def run_jobs(jobs: list[Job], args: argparse.Namespace, log_path: Path) -> list[dict]:
    """Run ``jobs`` (shared phase, then solo phase) within the deadline; returns one record per job."""
    global args_jobs_gt1
    args_jobs_gt1 = args.jobs > 1
    t_start = time.perf_counter()
    solo_reserve = sum(j.est_s for j in jobs if j.solo)
    cores = os.cpu_count() or 2
    tmp = tempfile.mkdtemp(prefix="bench_")
    records: list[dict] = []
    counter = itertools.count(1)
    log = open(log_path, "w")  # noqa: SIM115 -- closed at the end of run_jobs

    def finish(job: Job, killed: str | None = None) -> None:
        _collect(job, killed)
        records.append(job.record)
        log.write(f"===== {json.dumps(job.spec)} -> {job.record.get('status')} ({job.record['job_wall_s']} s)\n")
        log.write(Path(job.log_file).read_text(errors="replace")[-6000:] + "\n")
        log.flush()
        r = job.record
        print(f"[{time.perf_counter() - t_start:6.1f}s] {r['scenario']:<10} {r.get('impl'):<12} st={r.get('stage')} "
              f"{r.get('dtype')} gas={r.get('gas', '-')} ws={r.get('world_size')} -> {r.get('status')} "
              f"{r.get('error', '')[:160]}", flush=True)

    for phase_solo in (False, True):
        pending = [j for j in jobs if j.solo == phase_solo]
        width = 1 if phase_solo else args.jobs
        threads = max(1, cores // width)
        running: list[Job] = []
        reserve = 0.0 if phase_solo else solo_reserve
        while pending or running:
            now = time.perf_counter() - t_start
            for job in list(running):
                over = time.perf_counter() - job.started > args.job_timeout_s
                late = now > args.deadline_s + 20
                if job.proc.poll() is not None or over or late:
                    if job.proc.poll() is None:
                        job.proc.kill()
                        finish(job, f"killed: {'job timeout' if over else 'run deadline'} after "
                                    f"{time.perf_counter() - job.started:.0f} s")
                    else:
                        finish(job)
                    running.remove(job)
            used = sum(j.est_gib for j in running)
            while pending and len(running) < width:
                job = pending[0]
                if now + job.est_s > args.deadline_s - reserve:
                    pending.pop(0)
                    job.record = {**job.spec, "status": "not_run", "error": "time budget (--deadline-s) reached"}
                    records.append(job.record)
                    continue
                if running and (used + job.est_gib > args.mem_budget_gib):
                    break
                pending.pop(0)
                _launch(job, args, tmp, next(counter), threads)
                running.append(job)
                used += job.est_gib
            time.sleep(0.2)
    log.close()
    return records


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description="deepspeed-lean benchmark suite")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--quick", action="store_true", help="tiny models (CPU smoke test)")
    ap.add_argument("--world-sizes", default="1", help="comma list; sizes > 1 use the fake process group")
    ap.add_argument("--only", default="", help="comma list of scenarios: s1,s2,throughput,s3")
    ap.add_argument("--with-s3", action="store_true", help="include the ZeRO-3 slot")
    ap.add_argument("--impls", default="ours,ours_leanoff,upstream,fsdp2")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--gas", default="1,4,16")
    ap.add_argument("--tp-steps", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=3, help="memory workers sharing the GPU at once")
    ap.add_argument("--mem-budget-gib", type=float, default=118.0)
    ap.add_argument("--deadline-s", type=float, default=510.0)
    ap.add_argument("--job-timeout-s", type=float, default=240.0)
    ap.add_argument("--upstream-target", default="/tmp/upstream_ds")
    ap.add_argument("--extra-site", default=os.environ.get("BENCH_EXTRA_SITE", ""),
                    help="site dir with pydantic/hjson (GPU machine: /tmp/site)")
    ap.add_argument("--rerun", default="", help="comma list of results.jsonl: run only their configurations "
                    "that have no number (error / not_run)")
    ap.add_argument("--command-line", default="", help="command recorded in the report (default: this one)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = _specs(args)
    if args.rerun:
        import report

        redo = {report._key(r) for r in report.load([Path(p) for p in args.rerun.split(",")]) if r.get("status") != "ok"}
        jobs = [j for j in jobs if report._key(j.spec) in redo]
    print(f"{len(jobs)} jobs; deadline {args.deadline_s:.0f} s", flush=True)
    records = run_jobs(jobs, args, out / "run_log.txt")
    with open(out / "results.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    import report

    command = args.command_line or "python benchmarks/run_all.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    report.write_report([out / "results.jsonl"], out / "benchmarks.md", command=command, plots_dir=out)
    print(report.short_table(records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
