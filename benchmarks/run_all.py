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
``not_run`` with the reason), and at most ``--offload-jobs`` optimizer-offload workers at once. Jobs are taken in
priority order; when one does not fit, it gets a reservation (the time the running jobs' estimated ends free
enough for it) and a later job that fits now is started only if it ends by then or fits beside it then (backfill;
an offload row gets no reservation: it waits for the running one). No job is started that would not finish before
``--deadline-s`` (minus the solo phase's estimate); whatever is left is recorded ``status: not_run``. Throughput
workers run alone afterwards. ``--plan`` prints the job list and the schedule the estimates predict (the last line:
when each phase ends, and what would be not_run), and runs nothing.

Workers. ``--prelaunch`` (default 5; one during the solo phase) workers are started ahead of their turn: they
import torch and the scenario and construct a CPU AdamW (torch._dynamo's import), touch nothing on the GPU, and wait
for a gate file; admission releases them (``job_wall_s`` is counted from the release; ``prelaunched_s`` says how
long the process existed before it, the worker's ``startup_s`` how long its start-up took). CPU threads
(``OMP_NUM_THREADS``, recorded as ``omp_threads``): cores // ``--jobs`` per shared worker, all cores for a solo
one, and ``--offload-threads`` (default half the cores) for an offload worker: those are CPU-bound (Adam over 3 B
fp32 parameters on the host; upstream's host-side build), and measured 16.5 s per step for ours at 3 threads
against 9-10 s at 4-5 threads.

Default job list (``--world-sizes 1,8``, the device command), in priority order; estimates are (cold seconds
when sharing the GPU, device GiB, host GiB) from ``_s3_estimate`` / ``_estimate`` and ``calibration.json``:
 1. S3 qwen2-3b (3.09 B) N=1, optimizer offloaded to pinned CPU memory: ours, upstream, fsdp2, and ours with the
    parameters offloaded too (63-77 s, 9-17 GiB, host 45-62 GiB): one at a time, the longest chain (~280 s).
 2. S3 qwen2-3b N=1 without offload: ours, upstream, fsdp2, ours_leanoff (15-30 s, 50-56 GiB) and the ZeRO-2
    row (ours), the "ZeRO-3 peak <= ZeRO-2 peak" comparison.
 3. S1 N=1 bf16 GAS 1 and 16 (stages 1/2 x ours/lean-off/upstream + FSDP2: 14 jobs, 12-27 s, 24-36 GiB); S2 N=1
    (7 jobs, 13-19 s, 41-60 GiB); S1 N=1 fp16 GAS 1/16 (12); S1 N=1 GAS 4, bf16 and fp16 (13).
 4. The fake-group ranks, small on the device (6-32 GiB), last so that they fill what the large ones leave:
    S3 qwen2-3b and qwen2.5-7b (7.62 B: its 28-layer gathered counts) N=8: ours, upstream, fsdp2; the 7.6B shape
    at N=8 with the optimizer offloaded (report 3's own scenario, per rank: 16-21 GiB of host memory each, so
    ordinary jobs rather than one-at-a-time offload rows; their time estimate is not calibrated yet); S2 N=8 (7);
    S1 N=8 bf16 GAS 1/16 (14).
 5. S3 qwen2.5-7b N=1, optimizer offloaded: ours, upstream, fsdp2. Host memory: ours 14.5 B/param = 106 GiB,
    upstream 20.5 and FSDP2 20 B/param (148 / 145 GiB): all above the 100 GiB host budget of a 128 GiB machine,
    so they are recorded not_run with that reason (force ours alone with ``--only s3 --host-budget-gib 120``).
    Without offload the 7.6B shape needs 16 B/param = 113 GiB at N=1, a solo run: not in the list; item 4 gives
    its gathered-layer counts.
 6. Throughput, solo, at the end: stages 0-3 x ours/lean-off/upstream + FSDP2 (12 jobs, 12-27 s; 2 warm-up and
    5 timed steps, ~0.2 s each: the timed steps are ~1 s of a row's ~12 s).
Upstream's S3 rows (and its ZeRO-3 throughput row) run reentrant activation checkpointing by default
(``_harness.default_checkpoint_reentrant``): its ZeRO-3 fails under torch's non-reentrant checkpoint on the H200
image. ``--s3-extra '{"checkpoint_reentrant": false}'`` (or ``true``) sets one form for every S3 row; every record
carries ``checkpoint_reentrant``.

Arithmetic. Seconds: cold job walls (process start to exit) calibrated on the measured ``job_wall_s`` of the
one-call suite run that followed gpu_run7 (--jobs 5, 3 threads per worker, 529 s: 13 rows not_run by the
deadline, every upstream S3 row failed for want of reentrant checkpointing); the formulas are 3-6 % above those
walls per scenario. Offload rows and throughput rows recalibrated on two later suite runs (S3 rows now add two
plain timed steps, see ``_s3_estimate``); upstream's reentrant S3 rows from earlier runs. A prelaunched
worker's estimate is ``STARTUP_S`` (4 s) shorter. Device GiB: the largest measured peak reserved of the
configuration (``calibration.json``, ``--calibrate``) + 1 GiB (the CUDA context, outside the allocator's counters,
and slack), else the formulas. With the defaults (``--jobs 6 --mem-budget-gib 125 --deadline-s 510``) ``--plan``
predicts that every job but the three 7.6B N=1 offload rows runs, the shared phase ending at ~337 s and the solo
phase at ~455 s; the last two one-call runs, with one timed S3 step, took 383 s and 303 s of device wall time,
so the estimates run long. One call's wall time: ``device_run.sh`` ~20 s (wheel installs, environment lines),
run_all ≤ ``--deadline-s`` + 20 s (kill grace) + ~5 s (report) = 555 s < the 600 s limit of one command.

Outputs: ``DIR/results.jsonl``, ``DIR/summary.json`` (one row per scenario and engine, ``summary.py``; its run
is ``--run-name``, default the folder's name), ``DIR/run_log.txt`` (each worker's output tail), ``DIR/benchmarks.md``
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

from _harness import default_checkpoint_reentrant  # noqa: E402 - importable once BENCH is on sys.path
from models import MODELS  # noqa: E402

SCRIPTS = {
    "s1": BENCH / "scenarios" / "s1_grad_accum.py",
    "s2": BENCH / "scenarios" / "s2_init.py",
    "throughput": BENCH / "scenarios" / "throughput.py",
    "s3": BENCH / "scenarios" / "s3_zero3.py",
}
DS_IMPLS = ("ours", "ours_leanoff", "upstream")
GiB = float(1 << 30)
HOST_BASE_GIB = 4.0  # RSS of one worker without offload (torch, CUDA context, the engine): measured 1.2-1.8 GiB
# A prelaunched worker waiting at its gate holds ~0.5 GiB (torch imported, no CUDA context, nothing allocated):
# covered by the slack in HOST_BASE_GIB of the running workers.
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
    started: float = 0.0  # perf_counter when released (cold: launched)
    spawned: float | None = None  # run-clock seconds when its process was started
    gate: str = ""  # prelaunched: the file whose creation releases the worker
    threads: int = 0
    end_est: float = 0.0  # run-clock time its estimate says it ends (set when released)
    result_file: str = ""
    log_file: str = ""
    record: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- estimates
# Seconds are *cold* job walls (process start to exit, GPU shared with up to four other workers), calibrated on
# the measured ``job_wall_s`` of "run 8", the one-call full-suite run after gpu_run7 (--jobs 5, 3 CPU threads per
# worker, 529 s; its results.jsonl belongs in results/ as gpu_run8.jsonl), and for the S3 offload rows and
# upstream's reentrant S3 rows on gpu_run4/6/7 (4-5 threads: the offload rows are CPU-bound, see ``_threads``).
# A worker launched early (``--prelaunch``) has done its interpreter start, imports and torch._dynamo import
# (``STARTUP_S``; measured ``job_wall_s - worker_wall_s`` = 3.3-5 s, plus the dynamo import, ~1.5-2 s, which used
# to be inside ``worker_wall_s``) before it is released, so that part is not counted once it has had time to happen.
STARTUP_S = 4.0


def _floor_gib(stage: int | None, n: int, params: int) -> float:
    """Model-state floor (bf16/fp16 params and grads, fp32 Adam) in GiB (FSDP2: everything sharded)."""
    if stage is None:
        return 16 * params / n / GiB
    per = {0: 16.0, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]
    return per * params / GiB


# S1: base + per-GAS seconds (run 8: ours 10-16 s at GAS 1, 17-21 at 16; lean-off 15-18 / 21-26; upstream
# 16-21 / 23-29; FSDP2 9-12 / 22-23; N=8 rows as fast as N=1). S2: N=1 / N>1 (ours 13-15 / 10, lean-off 18-19
# (host round trip) / 18, upstream 19 / 15-17, FSDP2 13 / 11). Throughput (solo, prelaunched): job walls after
# release in gpu_run10/11 ours 2.2-4.6 s, lean-off 5.2-11.6, upstream 6.0-10.0 (ZeRO-3, reentrant: 11.2-13.1),
# FSDP2 3.2-3.9; the cold figures below are those maxima + STARTUP_S + ~1.5 s.
_S1_SECONDS = {"ours": (12.5, 0.45), "ours_leanoff": (16.0, 0.5), "upstream": (17.5, 0.6), "fsdp2": (11.5, 0.7)}
_S2_SECONDS = {"ours": (14.5, 10.5), "ours_leanoff": (19.0, 19.0), "upstream": (19.0, 18.0), "fsdp2": (13.5, 11.0)}
_TP_SECONDS = {"ours": 10.0, "ours_leanoff": 17.0, "upstream": 15.5, "fsdp2": 9.5}
_TP_UPSTREAM_Z3_S = 19.0


def _estimate(spec: dict, quick: bool) -> tuple[float, float, float]:
    """(cold seconds, device GiB, host GiB) of an S1/S2/throughput job (see the table comments above)."""
    params = MODELS[spec["model"]].num_params()
    # Peak reserved over the floor, measured in gpu_run4 (S1 N=1: ours 22.9, lean-off 27.7, upstream 34.3, FSDP2
    # 25.2 GiB over a 21.1 GiB floor), plus the 3 GiB margin below.
    factor = {"ours": 1.1, "ours_leanoff": 1.35, "upstream": 1.65, "fsdp2": 1.2}[spec["impl"]]
    gib = factor * _floor_gib(spec.get("stage"), int(spec.get("world_size", 1)), params) + 3.0
    host = HOST_BASE_GIB + (4 * params / GiB if spec["scenario"] == "s2" and spec["impl"] == "ours_leanoff" else 0)
    if quick:
        return 8.0 + 0.1 * int(spec.get("gas") or 1), gib, host
    impl, n = spec["impl"], int(spec.get("world_size", 1))
    if spec["scenario"] == "s1":
        base, per_gas = _S1_SECONDS[impl]
        seconds = base + per_gas * int(spec.get("gas") or 1)
    elif spec["scenario"] == "s2":
        seconds = _S2_SECONDS[impl][0 if n == 1 else 1]
    elif impl == "upstream" and spec.get("stage") == 3:
        seconds = _TP_UPSTREAM_Z3_S
    else:
        seconds = _TP_SECONDS[impl]
    return seconds, gib, host


# Per implementation: device peak as a multiple of the per-rank floor (N = 1, N > 1: the working set and the
# logits weigh more against a small floor), from the measured peak reserved (3B N=1: ours 49.1, lean-off 54.8,
# upstream 52.9, FSDP2 51.4 GiB over a 46.0 GiB floor; N=8: ours 9.3 / 18.7 (3B / 7.6B), upstream 12.6 / 24.4,
# FSDP2 11.0 / 30.8 GiB), with room to spare; ZeRO-2 row 48.9 GiB.
_S3_PEAK = {"ours": (1.12, 1.4), "ours_leanoff": (1.2, 1.6), "upstream": (1.2, 2.3), "fsdp2": (1.1, 2.4)}
_S3_Z2_PEAK = 1.15
# Optimizer offloaded: device bytes per parameter at N=1 (measured peak reserved: ours 8.9 GiB = 3.1 B/param,
# with offload_param 8.3 = 2.9, upstream 10.8 = 3.7, FSDP2 14.7 = 5.1) and host bytes per parameter (measured:
# ours 14.2, with offload_param 17.1, upstream 20.2, FSDP2 19.8).
_S3_OFFLOAD_DEV_BPP = {"ours": 3.5, "ours_leanoff": 3.5, "upstream": 4.0, "fsdp2": 5.5}
_S3_HOST_BPP = {"ours": 14.5, "ours_leanoff": 14.5, "upstream": 20.5, "fsdp2": 20.0}
# Cold seconds of a qwen2-3b job: (N=1, N>1) without offload (run 8; upstream with reentrant checkpointing,
# gpu_run6: 29.6 / 24.0 / 20.6 s), and with the optimizer offloaded (gpu_run4/6/7 at 4-5 CPU threads: ours 68-74,
# with offload_param 60-77, upstream 75, FSDP2 62; at 3 threads, run 8, ours took 84 and 88 s and upstream's
# build alone 74 s). A fake-group rank of the 7.6B shape runs as fast as the 3B one (its shard is smaller).
# Offloaded rows now run one at a time with 8 threads; their job walls in gpu_run10/11 (single timed step):
# ours 43.9-48.6 s, with offload_param 39.0-52.8, upstream 53.6-68.1, FSDP2 54.9-59.3; the constants below are
# those maxima plus 5-20 %, the plain timed steps being added separately in _s3_estimate.
_S3_SECONDS = {"ours": (19.0, 18.0), "ours_leanoff": (19.0, 18.0), "upstream": (30.0, 25.0), "fsdp2": (15.0, 15.0)}
_S3_Z2_SECONDS = 15.0
_S3_OFFLOAD_SECONDS = {"ours": 58.0, "ours_leanoff": 58.0, "upstream": 72.0, "fsdp2": 63.0}
_S3_OFFLOAD_PARAM_SECONDS = 60.0


def _s3_estimate(spec: dict, quick: bool) -> tuple[float, float, float]:
    """(cold seconds, device GiB, host GiB) of an S3 job (see the table comments above)."""
    cfg = MODELS[spec["model"]]
    params, n, impl = cfg.num_params(), int(spec["world_size"]), spec["impl"]
    if quick:
        return 12.0, 3.0, HOST_BASE_GIB
    scale = params / MODELS["qwen2-3b"].num_params()
    host = HOST_BASE_GIB
    stage = spec.get("stage")
    if spec.get("offload"):
        bpp = 3.0 if spec.get("offload_param") else _S3_OFFLOAD_DEV_BPP[impl]
        gib = bpp * params / n / GiB + 3.0
        host_bpp = _S3_HOST_BPP[impl] + (2.0 if spec.get("offload_param") else 0.0)
        host = host_bpp * params / n / GiB + 3.0
        seconds = (_S3_OFFLOAD_PARAM_SECONDS if spec.get("offload_param") else _S3_OFFLOAD_SECONDS[impl]) * scale
        if n > 1:
            # A fake-group rank steps only its shard on the host (1/n of the CPU Adam work) but builds and runs
            # the whole model: roughly 40 % of an N=1 row is that fixed part. Not yet calibrated (no such run).
            seconds = seconds / scale * (0.4 + 0.6 * scale / n)
    else:
        floor = _floor_gib(None if impl == "fsdp2" else stage, n, params)
        if stage == 2:
            gib, seconds = _S3_Z2_PEAK * floor + 2.0, _S3_Z2_SECONDS
        else:
            gib = _S3_PEAK[impl][0 if n == 1 else 1] * floor + 2.0
            seconds = _S3_SECONDS[impl][0 if n == 1 else 1]
        if n == 1:
            seconds *= 1.0 + 0.5 * (scale - 1)
    # The constants above predate the plain timed steps after the measured one (``timed_steps``, default 3):
    # a step took 2-7.5 s offloaded (3B at N=1 and 7.6B at N=8) and 0.3-1.6 s otherwise (gpu_run10/11, s3_solo).
    seconds += max(0, int(spec.get("timed_steps", 3)) - 1) * (5.0 if spec.get("offload") else 1.0)
    return seconds, gib, host


# ----------------------------------------------------------------------------------------------- job lists
# Device memory of configurations already measured: ``calibration.json`` holds the largest measured peak reserved
# per configuration (``--calibrate``); a job's estimate is that plus CALIBRATED_MARGIN_GIB (its CUDA context, ~0.5
# GiB outside the allocator's counters, and slack; the 125 GiB budget leaves another ~14 GiB of the H200's 139).
# Configurations never measured use the formulas above. calibration.json was written from gpu_run4-7 and run 8.
CALIBRATION = BENCH / "calibration.json"
CALIBRATED_MARGIN_GIB = 1.0


def calibration_key(r: dict) -> str:
    """The configuration of a spec or record (``report.config_key``) as a string."""
    import report

    return json.dumps(list(report.config_key(r)))


def measured_peak_gib(r: dict) -> float | None:
    """Largest reserved figure an ok record has: S2 initialise or first step, the others the measured step."""
    if r.get("status") != "ok":
        return None
    if r.get("scenario") == "s2":
        vals = [r.get("init_peak_reserved_gib"), r.get("first_step_peak_reserved_gib")]
    else:
        vals = [r.get("peak_reserved_gib")]
    vals = [v for v in vals if isinstance(v, (int, float)) and v > 0]
    return max(vals) if vals else None


def write_calibration(paths: list[Path], out: Path = CALIBRATION) -> dict:
    """``calibration.json`` from result files: per configuration the largest measured peak reserved."""
    peaks: dict[str, float] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                v = measured_peak_gib(r)
                if v is not None:
                    k = calibration_key(r)
                    peaks[k] = round(max(v, peaks.get(k, 0.0)), 2)
    data = {
        "about": "largest measured peak reserved GiB per configuration; written by run_all.py --calibrate",
        "sources": [Path(p).name for p in paths],
        "peak_reserved_gib": dict(sorted(peaks.items())),
    }
    out.write_text(json.dumps(data, indent=1) + "\n")
    return data


def _load_calibration() -> dict[str, float]:
    try:
        return json.loads(CALIBRATION.read_text())["peak_reserved_gib"]
    except (OSError, ValueError, KeyError):
        return {}


class _Jobs:
    """Collects jobs (priority = order of ``add``) with their estimates."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.jobs: list[Job] = []
        self.measured = {} if quick else _load_calibration()

    def add(self, scenario: str, solo: bool = False, **spec: object) -> None:
        spec = {"scenario": scenario, **spec}
        est_s, est_gib, est_host = (_s3_estimate if scenario == "s3" else _estimate)(spec, self.quick)
        peak = self.measured.get(calibration_key(spec))
        if peak is not None:
            est_gib = peak + CALIBRATED_MARGIN_GIB
        self.jobs.append(Job(spec=spec, est_s=est_s, est_gib=est_gib, est_host_gib=est_host, solo=solo))


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


def _s3(
    jobs: _Jobs,
    args: argparse.Namespace,
    impls: list[str],
    model: str,
    ws: int,
    offload: bool = False,
    offload_param: bool = False,
    stage: int = 3,
) -> None:
    """S3 jobs; the checkpoint form is ``_harness.default_checkpoint_reentrant`` (reentrant for upstream, whose
    ZeRO-3 fails under torch's non-reentrant checkpoint on the H200 image; non-reentrant for ours and FSDP2)
    unless ``--s3-extra`` sets ``checkpoint_reentrant`` for every implementation."""
    trace_png = set(args.trace_png.split(",")) if args.trace_png else set()
    extra = json.loads(args.s3_extra) if args.s3_extra else {}
    for impl in impls:
        png = impl in trace_png and ws == 1 and not offload and stage == 3 and model != "qwen2.5-7b"
        spec = dict(
            impl=impl,
            stage=None if impl == "fsdp2" else stage,
            dtype="bf16",
            gas=1,
            world_size=ws,
            model=model,
            offload=offload,
            offload_param=offload_param,
            warmup=1 if offload else 2,
            trace_png=png,
            out_dir=str(Path(args.out).resolve()),
            **extra,
        )
        spec["checkpoint_reentrant"] = default_checkpoint_reentrant(spec)
        jobs.add("s3", **spec)


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
    n1, wide = 1 in wss, [w for w in wss if w > 1]
    # 1. The S3 offload rows: one at a time (--offload-jobs, host memory), the longest chain of the list.
    if "s3" in only and n1:
        _s3(jobs, args, big, q3, 1, offload=True)
        if "ours" in impls:
            _s3(jobs, args, ["ours"], q3, 1, offload=True, offload_param=True)
    # 2. The jobs with large device footprints (N=1), the most needed first: S3, S1 bf16, S2, S1 fp16, S1 GAS 4.
    if "s3" in only and n1:
        _s3(jobs, args, [i for i in ("ours", "upstream", "fsdp2", "ours_leanoff") if i in impls], q3, 1)
        if "ours" in impls:
            _s3(jobs, args, ["ours"], q3, 1, stage=2)
    if "s1" in only and n1 and "bf16" in dtypes:
        _s1_jobs(jobs, impls, 1, "bf16", ends, s1_model)
    if "s2" in only and n1:
        _s2_jobs(jobs, impls, 1, s2_model)
    if "s1" in only and n1:
        for dtype in (d for d in dtypes if d != "bf16"):
            _s1_jobs(jobs, impls, 1, dtype, ends, s1_model)
        for dtype in dtypes:
            _s1_jobs(jobs, impls, 1, dtype, middle, s1_model)
    # 3. The small ones (fake-group ranks, 6-32 GiB) last: they fill what the large ones leave free.
    if "s3" in only:
        for model in (m for m in (q3, q7) if m):
            for ws in wide:
                _s3(jobs, args, big, model, ws)
        if q7:  # report 3's own scenario per rank: the 7.6B shape with the optimizer offloaded
            for ws in wide:
                _s3(jobs, args, big, q7, ws, offload=True)
    if "s2" in only:
        for ws in wide:
            _s2_jobs(jobs, impls, ws, s2_model)
    if "s1" in only:
        for ws in wide:  # fp16 at N > 1 would skip every step (fake group: overflow)
            _s1_jobs(jobs, impls, ws, "bf16", ends, s1_model)
    # 4. Recorded not_run by the host budget (see the module docstring), unless the budget is raised.
    if "s3" in only and q7 and n1:
        _s3(jobs, args, big, q7, 1, offload=True)
    if "throughput" in only:
        for stage in (0, 1, 2, 3):
            for impl in (i for i in impls if i in DS_IMPLS):
                if stage == 0 and impl == "ours_leanoff":
                    continue  # the lean switches act on ZeRO-1/2/3 only
                # Upstream's ZeRO-3 fails under the non-reentrant checkpoint on the H200 image (see S3).
                reentrant = default_checkpoint_reentrant({"impl": impl, "stage": stage})
                jobs.add(
                    "throughput",
                    solo=True,
                    impl=impl,
                    stage=stage,
                    dtype="bf16",
                    gas=1,
                    world_size=1,
                    model=s1_model,
                    warmup=2,
                    steps=args.tp_steps,
                    checkpoint_reentrant=reentrant,
                )
        if "fsdp2" in impls:
            jobs.add(
                "throughput",
                solo=True,
                impl="fsdp2",
                stage=None,
                dtype="bf16",
                gas=1,
                world_size=1,
                model=s1_model,
                warmup=2,
                steps=args.tp_steps,
                checkpoint_reentrant=False,
            )
    return jobs.jobs


# ----------------------------------------------------------------------------------------------- workers
def _threads(job: Job, args: argparse.Namespace, cores: int) -> int:
    """CPU threads (``OMP_NUM_THREADS``) of a worker: all cores for a solo job; an equal share of ``--jobs`` for a
    shared one, except the optimizer-offload rows, which are CPU-bound (CPU Adam over 3 B fp32 parameters, and
    upstream's host-side build): they get ``--offload-threads`` (default half the cores). The host budget runs at
    most one of them at a time, and the other workers mostly wait on the GPU."""
    if job.solo:
        return cores
    base = max(1, cores // args.jobs)
    if host_heavy(job.spec):
        return max(base, args.offload_threads or cores // 2)
    return base


def host_heavy(spec: dict) -> bool:
    """An optimizer-offload row of one rank: CPU Adam over the whole model and tens of GiB of host memory. These
    run ``--offload-jobs`` at a time with ``--offload-threads``; a fake-group rank's offload row (1/N of that) is
    an ordinary job."""
    return bool(spec.get("offload")) and int(spec.get("world_size", 1)) == 1


def _env(spec: dict, args: argparse.Namespace, port: int, threads: int) -> dict:
    env = dict(os.environ)
    extra = [args.extra_site] if args.extra_site else []
    root = args.upstream_target if spec["impl"] == "upstream" else str(REPO)
    env["PYTHONPATH"] = os.pathsep.join([root] + extra)
    env.update(
        PYTHONUNBUFFERED="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        OMP_NUM_THREADS=str(threads),
        DS_BUILD_OPS="0",
    )
    return env


def _spawn(job: Job, args: argparse.Namespace, tmp: str, index: int, threads: int, now: float, gated: bool) -> None:
    """Start the worker's process; ``gated``: it imports, then waits for ``job.gate`` to exist (``_release``)."""
    job.result_file = os.path.join(tmp, f"r{index}.json")
    job.log_file = os.path.join(tmp, f"l{index}.txt")
    job.gate = os.path.join(tmp, f"g{index}") if gated else ""
    job.threads = threads
    spec = {k: v for k, v in job.spec.items() if k != "scenario"}
    cmd = [sys.executable, str(SCRIPTS[job.spec["scenario"]]), "--spec", json.dumps(spec), "--result", job.result_file]
    if gated:
        cmd += ["--gate", job.gate]
    with open(job.log_file, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        job.proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd="/tmp",
            env=_env(job.spec, args, PORT_BASE + index, threads),
            start_new_session=False,
        )
    job.spawned = now


def _release(job: Job) -> None:
    """Let a prelaunched worker go on (or note the start of a cold one)."""
    if job.gate:
        Path(job.gate).touch()
    job.started = time.perf_counter()


def _collect(job: Job, killed: str | None, shared: bool, prelaunched_s: float) -> None:
    rc = job.proc.wait() if job.proc is not None else None
    wall = time.perf_counter() - job.started
    tail = Path(job.log_file).read_text(errors="replace")[-3000:] if job.log_file else ""
    if killed is None and os.path.exists(job.result_file):
        job.record = json.loads(Path(job.result_file).read_text())
    else:
        why = killed or f"worker exited with code {rc} and wrote no result"
        job.record = {**job.spec, "status": "error", "error": why, "traceback": tail}
    job.record["scenario"] = job.spec["scenario"]
    job.record["job_wall_s"] = round(wall, 2)  # from the release (the launch, for a cold start) to the exit
    job.record["prelaunched_s"] = round(prelaunched_s, 2)  # how long the process existed before its release
    job.record["omp_threads"] = job.threads
    job.record["ran_beside_others"] = not job.solo and shared
    job.record["est"] = {"s": round(job.est_s, 1), "gib": round(job.est_gib, 1), "host_gib": round(job.est_host_gib, 1)}


# ----------------------------------------------------------------------------------------------- scheduling
def _not_run(job: Job, why: str) -> dict:
    job.record = {
        **job.spec,
        "status": "not_run",
        "error": why,
        "est": {"s": round(job.est_s, 1), "gib": round(job.est_gib, 1), "host_gib": round(job.est_host_gib, 1)},
    }
    return job.record


def _duration(job: Job, now: float, warm: dict[int, float]) -> float:
    """Estimated seconds from a release at ``now`` to the exit: the cold estimate less the start-up that a
    prelaunched process (in ``warm``: id -> run-clock time of its launch) has had time to do."""
    since = warm.get(id(job))
    return job.est_s if since is None else job.est_s - min(STARTUP_S, max(0.0, now - since))


def _solo_reserve(jobs: list[Job], args: argparse.Namespace) -> float:
    """Seconds kept free for the solo phase: its estimates, less the start-ups hidden by prelaunching."""
    solo = [j for j in jobs if j.solo]
    hidden = STARTUP_S * max(0, len(solo) - 1) if args.prelaunch else 0.0
    return sum(j.est_s for j in solo) - hidden


@dataclass
class _Load:
    """What a set of running jobs holds (device GiB, host GiB, slots, offload workers)."""

    gib: float = 0.0
    host: float = 0.0
    busy: int = 0
    offloading: int = 0

    def add(self, job: Job, sign: int = 1) -> None:
        self.gib += sign * job.est_gib
        self.host += sign * job.est_host_gib
        self.busy += sign
        self.offloading += sign * host_heavy(job.spec)

    def fits(self, job: Job, args: argparse.Namespace, width: int) -> bool:
        if self.busy >= width or (host_heavy(job.spec) and self.offloading >= args.offload_jobs):
            return False
        return not self.busy or (
            self.gib + job.est_gib <= args.mem_budget_gib and self.host + job.est_host_gib <= args.host_budget_gib
        )


def _reservation(
    head: Job, running: list[Job], load: _Load, now: float, args: argparse.Namespace, width: int
) -> tuple[float, _Load]:
    """When ``head`` (the first job that does not fit now) will fit, by the running jobs' predicted ends, and the
    load it will then add to: a later job may start before it only if it ends by then or fits beside it."""
    after = _Load(load.gib, load.host, load.busy, load.offloading)
    for job in sorted(running, key=lambda j: j.end_est):
        after.add(job, -1)
        if after.fits(head, args, width):
            after.add(head)
            return max(now, job.end_est), after
    after.add(head)
    return now, after


def _admit(
    pending: list[Job],
    running: list[Job],
    now: float,
    args: argparse.Namespace,
    width: int,
    reserve: float,
    warm: dict[int, float],
) -> tuple[list[Job], list[tuple[Job, str]]]:
    """Which pending jobs to start now and which can never run (with why); sets ``end_est`` of those started.

    Priority order with backfill: the first job that does not fit gets a reservation (when the running jobs'
    predicted ends free enough for it); a later job starts before it only if it fits now and either ends by that
    time or fits beside it then. Pure apart from that: used by the real loop and by the ``--plan`` simulation.
    Removes both kinds from ``pending``.
    """
    start: list[Job] = []
    dropped: list[tuple[Job, str]] = []
    load = _Load()
    for job in running:
        load.add(job)
    shadow: float | None = None
    later = _Load()  # the load at the reserved time (head included)
    for job in list(pending):
        if job.est_host_gib > args.host_budget_gib:
            pending.remove(job)
            why = (
                f"host memory: needs ~{job.est_host_gib:.0f} GiB > --host-budget-gib {args.host_budget_gib:.0f} "
                "(the GPU machine has 128 GiB)"
            )
            dropped.append((job, why))
            continue
        duration = _duration(job, now, warm)
        if now + duration > args.deadline_s - reserve:
            pending.remove(job)
            dropped.append((job, "time budget (--deadline-s) reached"))
            continue
        if not load.fits(job, args, width):
            # No reservation for an offload row: it waits for the running one (--offload-jobs) for a minute or
            # more, and the device memory it needs (10-16 GiB) frees up often.
            if shadow is None and not host_heavy(job.spec):
                shadow, later = _reservation(job, running + start, load, now, args, width)
            continue
        if shadow is not None and now + duration > shadow:
            if not later.fits(job, args, width):
                continue
            later.add(job)
        pending.remove(job)
        start.append(job)
        job.end_est = now + duration
        load.add(job)
    return start, dropped


def _to_prelaunch(upcoming: list[Job], warm: dict[int, float], depth: int) -> list[Job]:
    """The first ``depth`` jobs still to start (this phase's pending, then the later phases') not yet launched."""
    return [j for j in upcoming[:depth] if id(j) not in warm]


def _depth(args: argparse.Namespace, phase_solo: bool) -> int:
    """Processes kept prelaunched: ``--prelaunch`` beside the shared phase, one during the solo phase."""
    return min(args.prelaunch, 1) if phase_solo else args.prelaunch


def plan(jobs: list[Job], args: argparse.Namespace) -> list[tuple[Job, float | None, float | None, str]]:
    """Simulate the schedule with the estimates: (job, predicted start or None, predicted end, note) in start
    order (prelaunching included)."""
    out: list[tuple[Job, float | None, float | None, str]] = []
    now = 0.0
    reserve = _solo_reserve(jobs, args)
    warm: dict[int, float] = {}
    phases = [[j for j in jobs if not j.solo], [j for j in jobs if j.solo]]
    for k, phase_jobs in enumerate(phases):
        phase_solo = k == 1
        pending = list(phase_jobs)
        width = 1 if phase_solo else args.jobs
        running: list[tuple[Job, float]] = []  # (job, end)
        while pending or running:
            start, dropped = _admit(
                pending, [j for j, _ in running], now, args, width, 0.0 if phase_solo else reserve, warm
            )
            out += [(j, None, None, why) for j, why in dropped]
            for job in start:
                running.append((job, job.end_est))
                out.append((job, now, job.end_est, ""))
            later = [j for p in phases[k + 1 :] for j in p]
            for job in _to_prelaunch(pending + later, warm, _depth(args, phase_solo)):
                warm[id(job)] = now
            if running:
                now = min(end for _, end in running)
                running = [(j, e) for j, e in running if e > now]
    return out


def print_plan(jobs: list[Job], args: argparse.Namespace) -> None:
    """The ``--plan`` output: every job with its estimates and predicted start/end, then the predicted ends."""
    rows = plan(jobs, args)
    for job, t, end, note in rows:
        sp = job.spec
        what = (
            f"{sp['scenario']:<10} {sp['impl']:<12} st={sp.get('stage')!s:<4} {sp.get('model')} "
            f"ws={sp.get('world_size')} gas={sp.get('gas', '-')} {sp.get('dtype')}"
            f"{' offload' if sp.get('offload') else ''}{'+param' if sp.get('offload_param') else ''}"
            f"{' reentrant' if sp.get('checkpoint_reentrant') else ''}"
        )
        when = f"{t:6.0f} -> {end:6.0f} s" if t is not None else f"not_run ({note})"
        print(f"{what:<82} est {job.est_s:5.0f} s {job.est_gib:6.1f} GiB host {job.est_host_gib:5.1f}  {when}")
    shared_end = max((e for j, t, e, _ in rows if t is not None and not j.solo), default=0.0)
    solo_end = max((e for j, t, e, _ in rows if t is not None and j.solo), default=shared_end)
    skipped = [n for _, t, _, n in rows if t is None]
    print(
        f"plan: {len(rows) - len(skipped)} of {len(rows)} jobs run; shared phase ends at {shared_end:.0f} s, "
        f"solo phase at {solo_end:.0f} s (--deadline-s {args.deadline_s:.0f}); not_run: {len(skipped)}"
        + (
            f" ({sum('host memory' in n for n in skipped)} host memory, "
            f"{sum('time budget' in n for n in skipped)} time budget)"
            if skipped
            else ""
        )
    )


def run_jobs(jobs: list[Job], args: argparse.Namespace, log_path: Path) -> list[dict]:
    """Run ``jobs`` (shared phase, then solo phase) within the deadline; returns one record per job."""
    t_start = time.perf_counter()
    reserve = _solo_reserve(jobs, args)
    cores = os.cpu_count() or 2
    tmp = tempfile.mkdtemp(prefix="bench_")
    records: list[dict] = []
    counter = iter(range(1, 10**6))
    warm: dict[int, float] = {}  # id -> run-clock launch time of the processes started (prelaunched or cold)
    log = open(log_path, "w")  # closed at the end of run_jobs
    phases = [[j for j in jobs if not j.solo], [j for j in jobs if j.solo]]

    def clock() -> float:
        return time.perf_counter() - t_start

    def finish(job: Job, killed: str | None = None) -> None:
        prelaunched = (job.started - t_start) - job.spawned if job.gate and job.spawned is not None else 0.0
        _collect(job, killed, args.jobs > 1, prelaunched)
        records.append(job.record)
        log.write(f"===== {json.dumps(job.spec)} -> {job.record.get('status')} ({job.record['job_wall_s']} s)\n")
        log.write(Path(job.log_file).read_text(errors="replace")[-6000:] + "\n")
        log.flush()
        _progress(job.record, clock())

    def drop_warm(job: Job) -> None:
        if job.proc is not None and job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()

    try:
        for k, phase_jobs in enumerate(phases):
            phase_solo = k == 1
            pending = list(phase_jobs)
            width = 1 if phase_solo else args.jobs
            running: list[Job] = []
            while pending or running:
                now = clock()
                for job in list(running):
                    over = time.perf_counter() - job.started > args.job_timeout_s
                    late = now > args.deadline_s + 20
                    if job.proc.poll() is not None or over or late:
                        if job.proc.poll() is None:
                            job.proc.kill()
                            finish(
                                job,
                                f"killed: {'job timeout' if over else 'run deadline'} after "
                                f"{time.perf_counter() - job.started:.0f} s",
                            )
                        else:
                            finish(job)
                        running.remove(job)
                start, dropped = _admit(pending, running, now, args, width, 0.0 if phase_solo else reserve, warm)
                for job, why in dropped:
                    drop_warm(job)
                    records.append(_not_run(job, why))
                    _progress(job.record, now)
                for job in start:
                    if job.proc is None:
                        _spawn(job, args, tmp, next(counter), _threads(job, args, cores), now, gated=False)
                        warm[id(job)] = now
                    _release(job)
                    running.append(job)
                later = [j for p in phases[k + 1 :] for j in p]
                for job in _to_prelaunch(pending + later, warm, _depth(args, phase_solo)):
                    _spawn(job, args, tmp, next(counter), _threads(job, args, cores), now, gated=True)
                    warm[id(job)] = now
                time.sleep(0.05)
    finally:
        for job in jobs:  # prelaunched and never released (an exception above): do not leave them waiting
            if job.gate and not job.started:
                drop_warm(job)
        log.close()
    return records


def _progress(r: dict, t: float) -> None:
    extra = (
        f" {r.get('model')}{' offload' if r.get('offload') else ''}{'+param' if r.get('offload_param') else ''}"
        if r["scenario"] == "s3"
        else ""
    )
    print(
        f"[{t:6.1f}s] {r['scenario']:<10} {r.get('impl'):<12} st={r.get('stage')} "
        f"{r.get('dtype')} gas={r.get('gas', '-')} ws={r.get('world_size')}{extra} -> {r.get('status')} "
        f"{str(r.get('error', ''))[:160]}",
        flush=True,
    )


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
    ap.add_argument("--jobs", type=int, default=6, help="memory workers sharing the GPU at once")
    ap.add_argument(
        "--offload-threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS of the CPU-bound optimizer-offload workers (0: half the cores); the "
        "other shared workers get cores // --jobs, solo workers all cores (recorded as omp_threads)",
    )
    ap.add_argument(
        "--offload-jobs",
        type=int,
        default=1,
        help="optimizer-offload workers at once (each is CPU-bound and holds 45-62 GiB of host memory; "
        "two would leave the host budget to one other worker)",
    )
    ap.add_argument(
        "--prelaunch",
        type=int,
        default=5,
        help="workers started ahead of their turn, held after their imports until released "
        "(one during the solo phase; 0: every worker starts cold)",
    )
    ap.add_argument("--mem-budget-gib", type=float, default=125.0)
    ap.add_argument(
        "--host-budget-gib",
        type=float,
        default=100.0,
        help="sum of the running jobs' host-memory estimates (the GPU machine has 128 GiB)",
    )
    ap.add_argument("--deadline-s", type=float, default=510.0)
    ap.add_argument("--job-timeout-s", type=float, default=300.0)
    # One PNG: with env/stdout.txt, results/summary/run_log/benchmarks/plots that is the 8 files a device call returns
    ap.add_argument(
        "--trace-png",
        default="ours",
        help="implementations whose S3 qwen2-3b N=1 job writes its memory-timeline PNG into --out",
    )
    ap.add_argument(
        "--s3-extra",
        default="",
        help="JSON merged into every S3 spec, e.g. "
        "'{\"checkpoint_early_stop\": false}' or '{\"trace\": false}' (A/B runs: use another --out)",
    )
    ap.add_argument("--plan", action="store_true", help="print the jobs and the predicted schedule; run nothing")
    ap.add_argument("--upstream-target", default="/tmp/upstream_ds")
    ap.add_argument(
        "--extra-site",
        default=os.environ.get("BENCH_EXTRA_SITE", ""),
        help="site dir with pydantic/hjson (GPU machine: /tmp/site)",
    )
    ap.add_argument(
        "--rerun",
        default="",
        help="comma list of results.jsonl: run only their configurations that have no number (error / not_run)",
    )
    ap.add_argument("--command-line", default="", help="command recorded in the report (default: this one)")
    ap.add_argument("--run-name", default="", help="the run's name in summary.json (default: the --out folder's name)")
    ap.add_argument(
        "--calibrate",
        default="",
        help="comma list of results.jsonl: write benchmarks/calibration.json "
        "(largest measured peak reserved per configuration, used for the device-memory estimates) and exit",
    )
    args = ap.parse_args(argv)
    if args.calibrate:
        data = write_calibration([Path(p) for p in args.calibrate.split(",")])
        print(f"{CALIBRATION}: {len(data['peak_reserved_gib'])} configurations")
        return 0
    out = Path(args.out)
    jobs = _specs(args)
    if args.rerun:
        import report

        earlier = report.load([Path(p) for p in args.rerun.split(",")])
        redo = {report.config_key(r) for r in earlier if r.get("status") != "ok"}
        jobs = [j for j in jobs if report.config_key(j.spec) in redo]
    if args.plan:
        print_plan(jobs, args)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(jobs)} jobs; deadline {args.deadline_s:.0f} s", flush=True)
    records = run_jobs(jobs, args, out / "run_log.txt")
    with open(out / "results.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    import report
    import summary

    summary_path = summary.write_run(records, out / "summary.json", args.run_name or out.resolve().name)
    command = args.command_line or "python benchmarks/run_all.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    report.write_report(
        [out / "results.jsonl"], out / "benchmarks.md", command=command, plots_dir=out, summary=summary_path
    )
    print(report.short_table(records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
