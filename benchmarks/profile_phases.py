"""Where one training step's time goes: forward / backward / optimizer step, host vs device (a diagnostic).

Each spec runs in its own process (the S1 model unless ``spec["model"]`` says otherwise, N=1):

    python benchmarks/profile_phases.py --spec '{"impl": "ours", "stage": 2, "dtype": "bf16"}' --out DIR

After ``warmup`` steps it times ``steps`` steps with a device sync after each phase (so the phases add up to
more than an unsynchronised step), then profiles one more step with ``torch.profiler`` and keeps the
operators with the most device time and the most host time, and the number of kernel launches per phase.
Writes ``DIR/<impl>_z<stage>.json``. Not a timed test; figures come only from the run that wrote them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import models
from _harness import default_checkpoint_reentrant, device, init_process_group, sync
from models import random_batch
from trainers import make_trainer


def _top(events: list, key: str, n: int = 12) -> list[dict]:
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    return [
        {
            "name": e.key[:90],
            "calls": e.count,
            "self_device_ms": round(e.self_device_time_total / 1e3, 2),
            "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2),
        }
        for e in rows
    ]


def run(spec: dict) -> dict:
    init_process_group(spec["impl"], 1)
    models.CHECKPOINT_USE_REENTRANT = default_checkpoint_reentrant(spec)
    trainer, cfg, n_params = make_trainer(spec.get("model", "gpt1.3b"), spec)
    ids, labels = random_batch(cfg, 1, device(), seed=0)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": [], "unsynced_step": []}

    def step(timed: bool, synced: bool = True) -> None:
        t0 = time.perf_counter()
        loss = trainer.loss(ids, labels)
        if synced:
            sync()
        t1 = time.perf_counter()
        trainer.backward(loss)
        if synced:
            sync()
        t2 = time.perf_counter()
        trainer.step()
        sync()
        t3 = time.perf_counter()
        if timed and synced:
            phases["forward"].append(t1 - t0)
            phases["backward"].append(t2 - t1)
            phases["step"].append(t3 - t2)
        elif timed:
            phases["unsynced_step"].append(t3 - t0)

    for _ in range(int(spec.get("warmup", 3))):
        step(False)
    for _ in range(int(spec.get("steps", 8))):
        step(True)
        step(True, synced=False)
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("phase:forward"):
            loss = trainer.loss(ids, labels)
        with record_function("phase:backward"):
            trainer.backward(loss)
        with record_function("phase:step"):
            trainer.step()
        sync()
    events = prof.key_averages()
    launches = sum(
        e.count
        for e in events
        if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
    )
    phase_rows = {
        e.key: {"cpu_ms": round(e.cpu_time_total / 1e3, 2), "device_ms": round(e.device_time_total / 1e3, 2)}
        for e in events
        if e.key.startswith("phase:")
    }
    return {
        "spec": spec,
        "params": n_params,
        "torch_threads": torch.get_num_threads(),
        "median_s": {k: round(statistics.median(v), 4) for k, v in phases.items() if v},
        "all_s": {k: [round(x, 4) for x in v] for k, v in phases.items()},
        "profiled_phases": phase_rows,
        "kernel_launches": launches,
        "top_device": _top(list(events), "self_device_time_total"),
        "top_cpu": _top(list(events), "self_cpu_time_total"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.loads(args.spec)
    os.makedirs(args.out, exist_ok=True)
    result = run(spec)
    name = f"{spec['impl']}_z{spec.get('stage')}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=1)
    print(
        json.dumps(
            {
                "spec": spec,
                "median_s": result["median_s"],
                "launches": result["kernel_launches"],
                "phases": result["profiled_phases"],
            }
        )
    )


if __name__ == "__main__":
    main()
