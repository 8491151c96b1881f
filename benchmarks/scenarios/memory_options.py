"""Upstream's newer memory options, ours against upstream DeepSpeed 0.19.8 in the same run, on one GPU.

Three groups (``--only bf16,offload,compile``; all by default), every configuration in its own worker process run
alone on the GPU (so step times are solo timings), for ``ours`` and ``upstream``:

* ``bf16``: S1's model (``gpt1.3b``, ZeRO-2, bf16, GAS 1, checkpointing per block, S1's config and client
  AdamW) with fp32 master weights and optimizer states, then with ``bf16.bf16_master_weights_and_grads`` +
  ``bf16.bf16_optimizer_states``: peak allocated / reserved over one optimizer step after a warm-up step, and the
  step time (median of 3). Target: the bf16-state peak <= 0.65x the fp32-state peak at equal or better step time.
* ``offload``: ``qwen2-3b`` (3.09 B) at ZeRO-3 with S3's HF-"auto" config, N=1: 2 warm-up steps, then
  ``engine.offload_states()``; device memory still allocated (torch counter) against the model-state bytes
  (16 B/param: bf16 parameters and gradients, fp32 master and two Adam moments), offload and reload times
  (device synchronised), then 2 more steps. The same worker run without offload gives the reference losses;
  ``bit_exact`` says whether the losses after reload equal them bit for bit. Target: <= 2 % of model-state bytes.
* ``compile``: tokens/s of ``engine.compile()`` (inductor) against eager at 8192 tokens per step (``gpt1.3b``,
  micro-batch 4 x seq 2048), ZeRO-2 and ZeRO-3; 2 warm-up steps (the compile happens there), median of 5.

Usage (GPU machine, upstream installed as for run_all.py, ``/tmp/upstream_ds``):

    python benchmarks/scenarios/memory_options.py --out DIR [--only bf16,offload,compile] [--extra-site /tmp/site]

writes ``DIR/memory_options.jsonl`` (one record per worker, then one ``summary`` record per group with the
ratios and targets). ``--smoke`` runs the same protocol on CPU with tiny models in seconds (memory counters read 0
there; it checks the code paths, not the numbers). A worker is ``--spec JSON --result FILE`` (``_harness.worker_main``).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import models
from _harness import (
    DeepSpeedTrainer,
    GiB,
    default_checkpoint_reentrant,
    device,
    ds_config,
    hf_auto_config,
    mem,
    reset_peak,
    single_worker_env,
    sync,
    worker_main,
)
from models import MODELS, build_model, random_batch

REPO = Path(__file__).resolve().parents[2]
MODEL_STATE_BYTES_PER_PARAM = 16  # bf16 params + bf16 grads + fp32 master + 2 fp32 Adam moments
TARGET_BF16_PEAK_RATIO = 0.65
TARGET_OFFLOAD_HELD_FRACTION = 0.02


# ----------------------------------------------------------------------------------------------- worker side
def _bits(x: float) -> str:
    """The float32 bit pattern of a loss, so equality is exact and the JSON keeps it."""
    return struct.pack(">f", x).hex()


def _trainer(spec: dict) -> tuple[DeepSpeedTrainer, Any, int]:
    cfg = MODELS[spec["model"]]
    models.CHECKPOINT_USE_REENTRANT = default_checkpoint_reentrant(spec)
    ds = hf_auto_config(spec, cfg.hidden) if spec["group"] == "offload" else ds_config(spec)
    if spec.get("bf16_states"):
        ds["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    model = build_model(spec["model"], device(), torch.bfloat16)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    trainer = DeepSpeedTrainer(model, spec, config=ds)
    if spec.get("compiled"):
        backend = spec.get("backend")
        # Unset: each engine's own default (inductor on CUDA). Upstream's compile() hands its backend argument
        # straight to torch.compile, where an explicit None is not a backend, so it is left out.
        trainer.engine.compile(**({"backend": backend} if backend else {}))
    return trainer, cfg, n


def _step(trainer: DeepSpeedTrainer, batches: list) -> float:
    total = 0.0
    for ids, labels in batches:
        loss = trainer.loss(ids, labels)
        trainer.backward(loss)
        trainer.step()
        total += float(loss.detach())
    return total


def _timed_steps(trainer: DeepSpeedTrainer, batches: list, steps: int) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        losses.append(_step(trainer, batches))
        sync()
        times.append(time.perf_counter() - t0)
    return times, losses


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _run_bf16(spec: dict) -> dict:
    trainer, cfg, n = _trainer(spec)
    batches = [random_batch(cfg, int(spec.get("micro_batch", 1)), device(), seed=0)]
    _step(trainer, batches)  # creates the optimizer state
    sync()
    reset_peak()
    times, _ = _timed_steps(trainer, batches, 3)
    m = mem()
    return {
        "params": n,
        "peak_alloc_gib": m["peak_alloc"],
        "peak_reserved_gib": m["peak_reserved"],
        "step_times_s": times,
        "median_step_s": _median(times),
        **trainer.info(),
    }


def _offload_cycle(trainer: DeepSpeedTrainer) -> dict:
    sync()
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    t0 = time.perf_counter()
    trainer.engine.offload_states()
    sync()
    offload_s = time.perf_counter() - t0
    held = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    t0 = time.perf_counter()
    trainer.engine.reload_states()
    sync()
    return {
        "alloc_before_offload_gib": before / GiB,
        "alloc_after_offload_gib": held / GiB,
        "offload_s": offload_s,
        "reload_s": time.perf_counter() - t0,
        "held_bytes": held,
    }


def _run_offload(spec: dict) -> dict:
    trainer, cfg, n = _trainer(spec)
    batches = [random_batch(cfg, 1, device(), seed=s) for s in range(4)]
    losses = [_step(trainer, [batches[0]]), _step(trainer, [batches[1]])]
    record: dict[str, Any] = {"params": n, "model_state_bytes": MODEL_STATE_BYTES_PER_PARAM * n}
    if spec.get("offload_states"):
        record.update(_offload_cycle(trainer))
        record["held_fraction_of_model_states"] = record["held_bytes"] / record["model_state_bytes"]
    losses += [_step(trainer, [batches[2]]), _step(trainer, [batches[3]])]
    record["loss_bits"] = [_bits(x) for x in losses]
    record["losses"] = losses
    return {**record, **trainer.info()}


def _run_compile(spec: dict) -> dict:
    trainer, cfg, n = _trainer(spec)
    mb = int(spec.get("micro_batch", 1))
    batches = [random_batch(cfg, mb, device(), seed=0)]
    t0 = time.perf_counter()
    for _ in range(2):
        _step(trainer, batches)
    sync()
    warmup_s = time.perf_counter() - t0
    times, _ = _timed_steps(trainer, batches, int(spec.get("steps", 5)))
    counters = {}
    if spec.get("compiled"):
        from torch._dynamo.utils import counters as dynamo_counters

        counters = dict(dynamo_counters["stats"])
    tokens = mb * cfg.seq
    return {
        "params": n,
        "tokens_per_step": tokens,
        "warmup_s": warmup_s,
        "step_times_s": times,
        "median_step_s": _median(times),
        "tokens_per_s": tokens / _median(times),
        "dynamo_stats": counters,
        "peak_alloc_gib": mem()["peak_alloc"],
        **trainer.info(),
    }


def run(spec: dict) -> dict:
    """One worker: the protocol of ``spec['group']`` (see the module docstring)."""
    return {"bf16": _run_bf16, "offload": _run_offload, "compile": _run_compile}[spec["group"]](spec)


# ----------------------------------------------------------------------------------------------- driver side
def specs(groups: list[str], smoke: bool, impls: list[str]) -> list[dict]:
    """Every worker spec of the selected groups."""
    s1, s3 = ("quick", "quick-qwen") if smoke else ("gpt1.3b", "qwen2-3b")
    micro = 2 if smoke else 4  # 4 x seq 2048 = 8192 tokens per step on the GPU
    out = []
    for impl in impls:
        base = {"impl": impl, "world_size": 1, "dtype": "bf16"}
        if "bf16" in groups:
            out += [{**base, "group": "bf16", "model": s1, "stage": 2, "bf16_states": flag} for flag in (False, True)]
        if "offload" in groups:
            out += [
                {**base, "group": "offload", "model": s3, "stage": 3, "offload_states": flag} for flag in (False, True)
            ]
        if "compile" in groups:
            # The smoke run uses aot_eager: inductor's C++ code generation takes minutes on a small CPU.
            out += [
                {
                    **base,
                    "group": "compile",
                    "model": s1,
                    "stage": stage,
                    "micro_batch": micro,
                    "compiled": c,
                    "backend": "aot_eager" if smoke and c else None,
                    "steps": 2 if smoke else 5,
                }
                for stage in (2, 3)
                for c in (False, True)
            ]
    return out


def _env(impl: str, args: argparse.Namespace, port: int) -> dict:
    return single_worker_env(impl, args.upstream_target, args.extra_site, port, args.smoke)


def _run_worker(spec: dict, args: argparse.Namespace, tmp: str, index: int) -> dict:
    result = os.path.join(tmp, f"r{index}.json")
    cmd = [sys.executable, __file__, "--spec", json.dumps(spec), "--result", result]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            env=_env(spec["impl"], args, 29700 + index),
            cwd="/" if spec["impl"] == "upstream" else str(REPO),
            capture_output=True,
            text=True,
            timeout=args.job_timeout_s,
        )
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        return {**spec, "scenario": "memory_options", "status": "error", "error": "timeout"}
    if not os.path.exists(result):
        return {**spec, "scenario": "memory_options", "status": "error", "error": "no result", "log_tail": tail}
    with open(result) as f:
        record = json.load(f)
    record["driver_wall_s"] = round(time.perf_counter() - t0, 2)
    if record.get("status") == "error":
        record["log_tail"] = tail
    return record


def _find(records: list[dict], **match: Any) -> dict | None:
    for r in records:
        if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _judged(record: dict, verdict: bool) -> bool | None:
    """``verdict``, or ``None`` on CPU, where the memory counters read 0 and no target can be judged."""
    return None if record.get("device_name") == "cpu" else verdict


def summarize(records: list[dict], impls: list[str]) -> list[dict]:
    """Per implementation and group: the ratios against their targets (a group is left out where a worker
    failed; ``meets_target`` is ``None`` on CPU)."""
    out = []
    for impl in impls:
        fp32, low = (
            _find(records, impl=impl, group="bf16", bf16_states=False),
            _find(records, impl=impl, group="bf16", bf16_states=True),
        )
        if fp32 and low:
            ratio = low["peak_alloc_gib"] / fp32["peak_alloc_gib"] if fp32["peak_alloc_gib"] else None
            out.append(
                {
                    "summary": "bf16_states",
                    "impl": impl,
                    "peak_ratio": ratio,
                    "step_time_ratio": low["median_step_s"] / fp32["median_step_s"],
                    "meets_target": _judged(
                        low,
                        ratio is not None
                        and ratio <= TARGET_BF16_PEAK_RATIO
                        and low["median_step_s"] <= fp32["median_step_s"] * 1.02,
                    ),
                }
            )
        plain, cycled = (
            _find(records, impl=impl, group="offload", offload_states=False),
            _find(records, impl=impl, group="offload", offload_states=True),
        )
        if plain and cycled:
            frac = cycled["held_fraction_of_model_states"]
            out.append(
                {
                    "summary": "offload_states",
                    "impl": impl,
                    "held_fraction": frac,
                    "offload_s": cycled["offload_s"],
                    "reload_s": cycled["reload_s"],
                    "bit_exact": plain["loss_bits"] == cycled["loss_bits"],
                    "meets_target": _judged(cycled, frac <= TARGET_OFFLOAD_HELD_FRACTION),
                }
            )
        for stage in (2, 3):
            eager, comp = (
                _find(records, impl=impl, group="compile", stage=stage, compiled=False),
                _find(records, impl=impl, group="compile", stage=stage, compiled=True),
            )
            if eager and comp:
                out.append(
                    {
                        "summary": "compile",
                        "impl": impl,
                        "stage": stage,
                        "speedup": comp["tokens_per_s"] / eager["tokens_per_s"],
                        "tokens_per_s_eager": eager["tokens_per_s"],
                        "tokens_per_s_compiled": comp["tokens_per_s"],
                    }
                )
    return out


def main() -> None:
    """Driver: run every selected worker alone, write ``memory_options.jsonl`` into ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="bf16,offload,compile")
    ap.add_argument("--impls", default="ours,upstream")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models, seconds (checks the code paths)")
    ap.add_argument("--upstream-target", default="/tmp/upstream_ds")
    ap.add_argument("--extra-site", default=os.environ.get("BENCH_EXTRA_SITE", ""))
    ap.add_argument("--job-timeout-s", type=float, default=900.0)
    args = ap.parse_args()
    groups, impls = args.only.split(","), args.impls.split(",")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "memory_options.jsonl")
    records = []
    with tempfile.TemporaryDirectory() as tmp, open(path, "w") as sink:
        for index, spec in enumerate(specs(groups, args.smoke, impls)):
            record = _run_worker(spec, args, tmp, index)
            records.append(record)
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            print(f"[memory_options] {spec} -> {record.get('status')} {record.get('error', '')}", flush=True)
        for row in summarize(records, impls):
            sink.write(json.dumps(row) + "\n")
            print(f"[memory_options] {row}", flush=True)


if __name__ == "__main__":
    if "--spec" in sys.argv:
        worker_main("memory_options", run)
    else:
        main()
