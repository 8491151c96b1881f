"""Run every benchmark scenario, each configuration in its own process, and write JSON lines + a markdown report.

    python benchmarks/run_all.py --out DIR [--quick] [--world-sizes 1,8] [--only s1,s2,s3,throughput] [--plan]

Scenarios (see each file's docstring): S1 gradient accumulation (``scenarios/s1_grad_accum.py``), S2
initialisation (``scenarios/s2_init.py``), S3 ZeRO-3 (``scenarios/s3_zero3.py``), throughput
(``scenarios/throughput.py``). Implementations: ``ours`` (lean switches on), ``ours_leanoff`` (lean switches off =
upstream behaviour per mechanism), ``upstream`` (DeepSpeed 0.19.8 from ``--upstream-target``, see
``baselines/upstream.py``), ``fsdp2`` (``baselines/fsdp2.py``). ``--with-s3`` is accepted and ignored (S3 is
in the default set now).

Scheduling: memory scenarios run up to ``--jobs`` workers at once on the one GPU (allocator statistics are per
process, so sharing the GPU does not change the memory figures), admitted while the sum of their estimated device
peaks stays under ``--mem-budget-gib`` and the sum of their estimated host needs under ``--host-budget-gib`` (the
GPU machine has 128 GiB of RAM; a job whose own host estimate exceeds the budget is never started and is recorded
``not_run`` with the reason). Jobs are taken in priority order; when the first waiting job does not fit, a later
one that fits is started (backfill). No job is started that would not finish before ``--deadline-s`` (minus the
solo phase's estimate); whatever is left is recorded ``status: not_run``. Throughput workers run alone afterwards.
``--plan`` prints the job list and the schedule the estimates predict, and runs nothing.

Default job list (``--world-sizes 1,8``, the device command), in priority order; estimates are (seconds when
sharing the GPU, device GiB, host GiB) from ``_s3_estimate`` / ``_estimate``:
 1. S3 qwen2-3b (3.09 B) N=1, no offload: ours, upstream, fsdp2, ours_leanoff (35-55 s, 53-64 GiB: two at a time).
 2. S3 qwen2-3b N=1, optimizer offloaded to pinned CPU memory: ours, upstream, fsdp2 (70-100 s, 5-17 GiB, host
    49-64 GiB: the host budget never lets two of them run together).
 3. S3 qwen2-3b N=8 (fake group): ours, upstream, fsdp2 (32-50 s, 10-20 GiB); S3 qwen2-3b N=1 ZeRO-2 (ours), the
    "ZeRO-3 peak <= ZeRO-2 peak" comparison (40 s, 62 GiB).
 4. S3 qwen2.5-7b (7.62 B) N=8 (fake): ours, upstream, fsdp2 (55-86 s, 22-46 GiB): the 7.6B shape's gathered-layer
    counts (28 layers).
 5. S1 N=1 bf16 GAS 1 and 16 (stages 1/2 x ours/lean-off/upstream + FSDP2: 14 jobs, 13-25 s).
 6. S2 N=1 and N=8 (14 jobs, 13-16 s).
 7. S3 qwen2-3b N=1 ours with parameters *and* optimizer offloaded (80 s, host 55 GiB).
 8. S1 N=8 bf16 GAS 1/16 (14 jobs); S1 N=1 fp16 GAS 1/16 (12); S1 N=1 GAS 4, bf16 and fp16 (13).
 9. S3 qwen2.5-7b N=1, optimizer offloaded: ours, upstream, fsdp2. Host memory: ours ~16 B/param (target 13.5) =
    113 GiB, upstream 20.5 and FSDP2 21.1 B/param (measured with upstream; 148 / 153 GiB): all above the 100 GiB
    host budget of a 128 GiB machine, so they are recorded not_run with that reason (force ours alone with
    ``--only s3 --host-budget-gib 120``). Without offload the 7.6B shape needs 16 B/param = 113 GiB at N=1, a
    solo run: not in the list; item 4 gives its gathered-layer counts.
10. Throughput, solo, at the end: stages 0-3 x ours/lean-off/upstream + FSDP2 (12 jobs, 12-15 s; upstream's
    ZeRO-3 row uses reentrant checkpointing, which it needs on the H200 image).
Arithmetic. Seconds, device and host estimates are calibrated on gpu_run4-7 (``job_wall_s`` with 4 workers
sharing the GPU; peak reserved; host bytes per parameter). In those calls the list took three device calls
(497 + 129 + 93 s of run_all). With the calibrated estimates, ``--plan`` with the defaults (``--jobs 5
--mem-budget-gib 125 --deadline-s 510``) predicts one call in which every runnable job but about nine S1 GAS-4
rows (the least needed: GAS 1 and 16 bound the growth) finishes inside the deadline; ``--rerun`` takes those. Five workers at once is one more than was measured, so per-job seconds may stretch; the
next device call checks it. One call's wall time: ``device_run.sh`` ~25 s (wheel installs, environment lines),
run_all ≤ ``--deadline-s`` + 20 s (kill grace) + ~5 s (report) = 560 s < the 600 s limit of one command.

Outputs: ``DIR/results.jsonl``, ``DIR/run_log.txt`` (each worker's output tail), ``DIR/benchmarks.md``
(+ ``DIR/plots.png`` when matplotlib is there, + one memory-timeline PNG per implementation named in
``--trace-png``: the device returns at most 8 files), and a short table on stdout.
"""
from __future__ import annotations

import argparse
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
GiB = float(1 << 30)
HOST_BASE_GIB = 4.0  # RSS of one worker without offload (torch, CUDA context, the engine)
# One-rank groups still open a TCP store: give every worker its own port, away from the usual 29500.
PORT_BASE = 20000 + (os.getpid() % 400) * 100


@dataclass
class Job:
    """One worker to run."""

    spec: dict
    est_s: float
    est_gib: float
    est_host_gib: float = HOST_BASE_GIB
    solo: bool = False
    proc: subprocess.Popen | None = None
    started: float = 0.0
    result_file: str = ""
    log_file: str = ""
    record: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- estimates
def _floor_gib(stage: int | None, n: int, params: int) -> float:
    """Model-state floor (bf16/fp16 params and grads, fp32 Adam) in GiB (FSDP2: everything sharded)."""
    if stage is None:
        return 16 * params / n / GiB
    per = {0: 16.0, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]
    return per * params / GiB


def _estimate(spec: dict, quick: bool) -> tuple[float, float, float]:
    """(seconds, device GiB, host GiB) of an S1/S2/throughput job (seconds from gpu_run1/2's job_wall_s)."""
    params = MODELS[spec["model"]].num_params()
    # Peak reserved over the floor, measured in gpu_run4 (S1 N=1: ours 22.9, lean-off 27.7, upstream 34.3, FSDP2
    # 25.2 GiB over a 21.1 GiB floor), plus the 3 GiB margin below.
    factor = {"ours": 1.1, "ours_leanoff": 1.35, "upstream": 1.65, "fsdp2": 1.2}[spec["impl"]]
    gib = factor * _floor_gib(spec.get("stage"), int(spec.get("world_size", 1)), params) + 3.0
    host = HOST_BASE_GIB + (4 * params / GiB if spec["scenario"] == "s2" and spec["impl"] == "ours_leanoff" else 0)
    if quick:
        return 8.0 + 0.1 * int(spec.get("gas") or 1), gib, host
    slow = 3.0 if spec["impl"] == "upstream" else 0.0
    seconds = {"s1": 12.0 + 0.6 * int(spec.get("gas") or 1) + 2.0 * (spec["world_size"] > 1), "s2": 13.0,
               "throughput": 12.0}[spec["scenario"]]
    return seconds + slow, gib, host


# Per implementation: device peak as a multiple of the per-rank floor (N = 1, N > 1: the working set and the
# logits weigh more against a small floor; upstream and FSDP2 from the measured reserved figures), and
# host bytes per parameter with the optimizer offloaded (upstream 20.5 and FSDP2 21.1 measured; ours the target).
_S3_PEAK = {"ours": (1.12, 1.4), "ours_leanoff": (1.2, 1.6), "upstream": (1.35, 2.3), "fsdp2": (1.1, 3.1)}
# Host bytes per parameter and seconds per job: measured in gpu_run4-7 (job_wall_s, host_bytes_per_param).
_S3_HOST_BPP = {"ours": 14.5, "ours_leanoff": 14.5, "upstream": 20.5, "fsdp2": 20.0}
_S3_SECONDS = {"ours": 32.0, "ours_leanoff": 28.0, "upstream": 30.0, "fsdp2": 15.0}


def _s3_estimate(spec: dict, quick: bool) -> tuple[float, float, float]:
    """(seconds, device GiB, host GiB) of an S3 job; seconds and host bytes calibrated on gpu_run4-7."""
    cfg = MODELS[spec["model"]]
    params, n, impl = cfg.num_params(), int(spec["world_size"]), spec["impl"]
    if quick:
        return 12.0, 3.0, HOST_BASE_GIB
    scale = params / MODELS["qwen2-3b"].num_params()
    # Measured: a fake-group rank of the 7.6B shape runs as fast as the 3B one (its shard is smaller).
    seconds = _S3_SECONDS[impl] * (0.9 if n > 1 else 1.0 + 0.5 * (scale - 1))
    host = HOST_BASE_GIB
    if spec.get("offload"):
        per_dev = {"ours": 4.0 + 2.0 * (not spec.get("offload_param")) - 2.0, "upstream": 2.0,
                   "fsdp2": 0.5}.get(impl, 4.0)
        gib = 1.25 * per_dev * params / n / GiB + 3.0
        host_bpp = _S3_HOST_BPP[impl] + (2.0 if spec.get("offload_param") else 0.0)
        host = host_bpp * params / n / GiB + 3.0
        seconds = {"ours": 72.0, "upstream": 75.0, "fsdp2": 62.0}.get(impl, 80.0) * scale
        if spec.get("offload_param"):
            seconds += 5.0
    else:
        mult = _S3_PEAK[impl][0 if n == 1 else 1]
        stage = spec.get("stage")
        floor = _floor_gib(None if impl == "fsdp2" else stage, n, params)
        gib = (1.3 if stage == 2 else mult) * floor + 2.0
    return seconds, gib, host


# ----------------------------------------------------------------------------------------------- job lists
class _Jobs:
    """Collects jobs (priority = order of ``add``) with their estimates."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.jobs: list[Job] = []

    def add(self, scenario: str, solo: bool = False, **spec: object) -> None:
        spec = {"scenario": scenario, **spec}
        est = (_s3_estimate if scenario == "s3" else _estimate)(spec, self.quick)
        self.jobs.append(Job(spec=spec, est_s=est[0], est_gib=est[1], est_host_gib=est[2], solo=solo))


def _s1_jobs(jobs: _Jobs, impls: list[str], ws: int, dtype: str, gas_values: list[int], model: str) -> None:
    for gas in gas_values:
        for stage in (1, 2):
            for impl in (i for i in impls if i in DS_IMPLS):
                jobs.add("s1", impl=impl, stage=stage, dtype=dtype, gas=gas, world_size=ws, model=model)
        if "fsdp2" in impls and dtype == "bf16":
            jobs.add("s1", impl="fsdp2", stage=None, dtype=dtype, gas=gas, world_size=ws, model=model)


def _s2_jobs(jobs: _Jobs, impls: list[str], ws: int, model: str) -> None:
    for stage in (1, 2):
        for impl in (i for i in impls if i in DS_IMPLS):
            jobs.add("s2", impl=impl, stage=stage, dtype="bf16", world_size=ws, model=model)
    if "fsdp2" in impls:
        jobs.add("s2", impl="fsdp2", stage=None, dtype="bf16", world_size=ws, model=model)


def _s3(jobs: _Jobs, args: argparse.Namespace, impls: list[str], model: str, ws: int, offload: bool = False,
        offload_param: bool = False, stage: int = 3) -> None:
    trace_png = set(args.trace_png.split(",")) if args.trace_png else set()
    extra = json.loads(args.s3_extra) if args.s3_extra else {}
    for impl in impls:
        png = impl in trace_png and ws == 1 and not offload and stage == 3 and model != "qwen2.5-7b"
        jobs.add("s3", impl=impl, stage=None if impl == "fsdp2" else stage, dtype="bf16", gas=1, world_size=ws,
                 model=model, offload=offload, offload_param=offload_param,
                 warmup=1 if offload else 2, trace_png=png, out_dir=str(Path(args.out).resolve()), **extra)


def _specs(args: argparse.Namespace) -> list[Job]:
    """Every job, in priority order (see the module docstring)."""
    quick = args.quick
    s1_model, s2_model = ("quick", "quick-s2") if quick else ("gpt1.3b", "gpt2.6b")
    q3, q7 = ("quick-qwen", None) if quick else ("qwen2-3b", "qwen2.5-7b")
    impls = [i for i in args.impls.split(",") if i]
    wss = [int(w) for w in args.world_sizes.split(",")]
    only = set(args.only.split(",")) if args.only else {"s1", "s2", "s3", "throughput"}
    dtypes = args.dtypes.split(",")
    gas_list = sorted(int(g) for g in args.gas.split(","))
    ends = sorted({gas_list[0], gas_list[-1]})
    middle = [g for g in gas_list if g not in ends]
    jobs = _Jobs(quick)
    big = [i for i in ("ours", "upstream", "fsdp2") if i in impls]
    if "s3" in only and 1 in wss:
        _s3(jobs, args, [i for i in ("ours", "upstream", "fsdp2", "ours_leanoff") if i in impls], q3, 1)
        _s3(jobs, args, big, q3, 1, offload=True)
    if "s3" in only:
        for ws in (w for w in wss if w > 1):
            _s3(jobs, args, big, q3, ws)
        if 1 in wss and "ours" in impls:
            _s3(jobs, args, ["ours"], q3, 1, stage=2)
    if "s3" in only and q7:
        for ws in (w for w in wss if w > 1):
            _s3(jobs, args, big, q7, ws)
    if "s1" in only and 1 in wss and "bf16" in dtypes:
        _s1_jobs(jobs, impls, 1, "bf16", ends, s1_model)
    if "s2" in only:
        for ws in wss:
            _s2_jobs(jobs, impls, ws, s2_model)
    if "s3" in only and 1 in wss and "ours" in impls:
        _s3(jobs, args, ["ours"], q3, 1, offload=True, offload_param=True)
    if "s1" in only:
        for ws in (w for w in wss if w > 1):  # fp16 at N > 1 would skip every step (fake group: overflow)
            _s1_jobs(jobs, impls, ws, "bf16", ends, s1_model)
        if 1 in wss:
            for dtype in (d for d in dtypes if d != "bf16"):
                _s1_jobs(jobs, impls, 1, dtype, ends, s1_model)
            for dtype in dtypes:
                _s1_jobs(jobs, impls, 1, dtype, middle, s1_model)
    if "s3" in only and q7 and 1 in wss:
        _s3(jobs, args, big, q7, 1, offload=True)
    if "throughput" in only:
        for stage in (0, 1, 2, 3):
            for impl in (i for i in impls if i in DS_IMPLS):
                if stage == 0 and impl == "ours_leanoff":
                    continue  # the lean switches act on ZeRO-1/2/3 only
                # Upstream's ZeRO-3 fails under the non-reentrant checkpoint on the H200 image (see S3).
                extra = {"checkpoint_reentrant": True} if stage == 3 and impl == "upstream" else {}
                jobs.add("throughput", solo=True, impl=impl, stage=stage, dtype="bf16", gas=1, world_size=1,
                         model=s1_model, warmup=2, steps=args.tp_steps, **extra)
        if "fsdp2" in impls:
            jobs.add("throughput", solo=True, impl="fsdp2", stage=None, dtype="bf16", gas=1, world_size=1,
                     model=s1_model, warmup=2, steps=args.tp_steps)
    return jobs.jobs


# ----------------------------------------------------------------------------------------------- workers
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


def _collect(job: Job, killed: str | None, shared: bool) -> None:
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
    job.record["ran_beside_others"] = not job.solo and shared
    job.record["est"] = {"s": round(job.est_s, 1), "gib": round(job.est_gib, 1), "host_gib": round(job.est_host_gib, 1)}


# ----------------------------------------------------------------------------------------------- scheduling
def _not_run(job: Job, why: str) -> dict:
    job.record = {**job.spec, "status": "not_run", "error": why,
                  "est": {"s": round(job.est_s, 1), "gib": round(job.est_gib, 1), "host_gib": round(job.est_host_gib, 1)}}
    return job.record


def _admit(pending: list[Job], running: list[Job], now: float, args: argparse.Namespace, width: int,
           reserve: float) -> tuple[list[Job], list[tuple[Job, str]]]:
    """Which pending jobs to start now (priority order, with backfill) and which can never run (with why).

    Pure: used by the real loop and by the ``--plan`` simulation. Removes both kinds from ``pending``.
    """
    start: list[Job] = []
    dropped: list[tuple[Job, str]] = []
    used = sum(j.est_gib for j in running)
    host = sum(j.est_host_gib for j in running)
    busy = len(running)
    for job in list(pending):
        if job.est_host_gib > args.host_budget_gib:
            pending.remove(job)
            why = (f"host memory: needs ~{job.est_host_gib:.0f} GiB > --host-budget-gib {args.host_budget_gib:.0f} "
                   "(the GPU machine has 128 GiB)")
            dropped.append((job, why))
            continue
        if now + job.est_s > args.deadline_s - reserve:
            pending.remove(job)
            dropped.append((job, "time budget (--deadline-s) reached"))
            continue
        if busy >= width:
            continue
        if busy and (used + job.est_gib > args.mem_budget_gib or host + job.est_host_gib > args.host_budget_gib):
            continue
        pending.remove(job)
        start.append(job)
        used, host, busy = used + job.est_gib, host + job.est_host_gib, busy + 1
    return start, dropped


def plan(jobs: list[Job], args: argparse.Namespace) -> list[tuple[Job, float | None, str]]:
    """Simulate the schedule with the estimates: (job, predicted start or None, note) in start order."""
    out: list[tuple[Job, float | None, str]] = []
    now = 0.0
    solo_reserve = sum(j.est_s for j in jobs if j.solo)
    for phase_solo in (False, True):
        pending = [j for j in jobs if j.solo == phase_solo]
        width = 1 if phase_solo else args.jobs
        running: list[tuple[Job, float]] = []  # (job, end)
        while pending or running:
            start, dropped = _admit(pending, [j for j, _ in running], now, args, width,
                                    0.0 if phase_solo else solo_reserve)
            out += [(j, None, why) for j, why in dropped]
            for job in start:
                running.append((job, now + job.est_s))
                out.append((job, now, ""))
            if running:
                now = min(end for _, end in running)
                running = [(j, e) for j, e in running if e > now]
    return out


def print_plan(jobs: list[Job], args: argparse.Namespace) -> None:
    """The ``--plan`` output: every job with its estimates and predicted start/end."""
    for job, t, note in plan(jobs, args):
        sp = job.spec
        what = (f"{sp['scenario']:<10} {sp['impl']:<12} st={sp.get('stage')!s:<4} {sp.get('model')} "
                f"ws={sp.get('world_size')} gas={sp.get('gas', '-')} {sp.get('dtype')}"
                f"{' offload' if sp.get('offload') else ''}{'+param' if sp.get('offload_param') else ''}")
        when = f"{t:6.0f} -> {t + job.est_s:6.0f} s" if t is not None else f"not_run ({note})"
        print(f"{what:<72} est {job.est_s:5.0f} s {job.est_gib:6.1f} GiB host {job.est_host_gib:5.1f}  {when}")


def run_jobs(jobs: list[Job], args: argparse.Namespace, log_path: Path) -> list[dict]:
    """Run ``jobs`` (shared phase, then solo phase) within the deadline; returns one record per job."""
    t_start = time.perf_counter()
    solo_reserve = sum(j.est_s for j in jobs if j.solo)
    cores = os.cpu_count() or 2
    tmp = tempfile.mkdtemp(prefix="bench_")
    records: list[dict] = []
    counter = iter(range(1, 10**6))
    log = open(log_path, "w")  # noqa: SIM115 -- closed at the end of run_jobs

    def finish(job: Job, killed: str | None = None) -> None:
        _collect(job, killed, args.jobs > 1)
        records.append(job.record)
        log.write(f"===== {json.dumps(job.spec)} -> {job.record.get('status')} ({job.record['job_wall_s']} s)\n")
        log.write(Path(job.log_file).read_text(errors="replace")[-6000:] + "\n")
        log.flush()
        _progress(job.record, time.perf_counter() - t_start)

    for phase_solo in (False, True):
        pending = [j for j in jobs if j.solo == phase_solo]
        width = 1 if phase_solo else args.jobs
        threads = max(1, cores // width)
        running: list[Job] = []
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
            start, dropped = _admit(pending, running, now, args, width, 0.0 if phase_solo else solo_reserve)
            for job, why in dropped:
                records.append(_not_run(job, why))
                _progress(job.record, now)
            for job in start:
                _launch(job, args, tmp, next(counter), threads)
                running.append(job)
            time.sleep(0.2)
    log.close()
    return records


def _progress(r: dict, t: float) -> None:
    extra = (f" {r.get('model')}{' offload' if r.get('offload') else ''}{'+param' if r.get('offload_param') else ''}"
             if r["scenario"] == "s3" else "")
    print(f"[{t:6.1f}s] {r['scenario']:<10} {r.get('impl'):<12} st={r.get('stage')} "
          f"{r.get('dtype')} gas={r.get('gas', '-')} ws={r.get('world_size')}{extra} -> {r.get('status')} "
          f"{str(r.get('error', ''))[:160]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description="deepspeed-lean benchmark suite")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--quick", action="store_true", help="tiny models (CPU smoke test)")
    ap.add_argument("--world-sizes", default="1", help="comma list; sizes > 1 use the fake process group")
    ap.add_argument("--only", default="", help="comma list of scenarios: s1,s2,s3,throughput (default: all)")
    ap.add_argument("--with-s3", action="store_true", help="accepted for old command lines; S3 runs by default")
    ap.add_argument("--impls", default="ours,ours_leanoff,upstream,fsdp2")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--gas", default="1,4,16")
    ap.add_argument("--tp-steps", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=5, help="memory workers sharing the GPU at once")
    ap.add_argument("--mem-budget-gib", type=float, default=125.0)
    ap.add_argument("--host-budget-gib", type=float, default=100.0,
                    help="sum of the running jobs' host-memory estimates (the GPU machine has 128 GiB)")
    ap.add_argument("--deadline-s", type=float, default=510.0)
    ap.add_argument("--job-timeout-s", type=float, default=300.0)
    ap.add_argument("--trace-png", default="ours,upstream",
                    help="implementations whose S3 qwen2-3b N=1 job writes its memory-timeline PNG into --out")
    ap.add_argument("--s3-extra", default="", help='JSON merged into every S3 spec, e.g. '
                    '\'{"checkpoint_early_stop": false}\' or \'{"trace": false}\' (A/B runs: use another --out)')
    ap.add_argument("--plan", action="store_true", help="print the jobs and the predicted schedule; run nothing")
    ap.add_argument("--upstream-target", default="/tmp/upstream_ds")
    ap.add_argument("--extra-site", default=os.environ.get("BENCH_EXTRA_SITE", ""),
                    help="site dir with pydantic/hjson (GPU machine: /tmp/site)")
    ap.add_argument("--rerun", default="", help="comma list of results.jsonl: run only their configurations "
                    "that have no number (error / not_run)")
    ap.add_argument("--command-line", default="", help="command recorded in the report (default: this one)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    jobs = _specs(args)
    if args.rerun:
        import report

        redo = {report._key(r) for r in report.load([Path(p) for p in args.rerun.split(",")]) if r.get("status") != "ok"}
        jobs = [j for j in jobs if report._key(j.spec) in redo]
    if args.plan:
        print_plan(jobs, args)
        return 0
    out.mkdir(parents=True, exist_ok=True)
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
