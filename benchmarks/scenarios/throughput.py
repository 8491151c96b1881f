"""Throughput: training tokens per second for ZeRO stage 0-3 (ours, upstream) and FSDP2, on the same model.

One worker = one (implementation, stage). run_all runs these workers one at a time (never beside another worker)
so the GPU is not shared. ``warmup`` optimizer steps are discarded, then ``steps`` steps are timed with the host
clock around a device synchronisation; tokens/s = steps × GAS × micro-batch × sequence / time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models
from _harness import (
    default_checkpoint_reentrant,
    device,
    mem,
    reset_peak,
    sync,
    worker_main,
)
from models import random_batch
from trainers import make_trainer


def run(spec: dict) -> dict:
    """Time ``spec['steps']`` optimizer steps after ``spec['warmup']`` warm-up steps."""
    gas, mb = int(spec.get("gas", 1)), int(spec.get("micro_batch", 1))
    models.CHECKPOINT_USE_REENTRANT = default_checkpoint_reentrant(spec)
    trainer, cfg, n_params = make_trainer(spec["model"], spec)
    batches = [random_batch(cfg, mb, device(), seed=m) for m in range(gas)]

    def one_step() -> None:
        for ids, labels in batches:
            trainer.backward(trainer.loss(ids, labels))
            trainer.step()

    for _ in range(int(spec.get("warmup", 2))):
        one_step()
    sync()
    reset_peak()
    steps = int(spec.get("steps", 5))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        one_step()
        sync()
        times.append(time.perf_counter() - t0)
    m = mem()
    tokens = gas * mb * cfg.seq
    times.sort()
    median = times[len(times) // 2]
    return {
        "params": n_params,
        "model_cfg": cfg.to_dict(),
        "step_times_s": times,
        "median_step_s": median,
        "tokens_per_s": tokens / median,
        "tflops_per_s": 8 * n_params * tokens / median / 1e12,  # 6·P·T plus the recompute forward (2·P·T)
        "peak_alloc_gib": m["peak_alloc"],
        "peak_reserved_gib": m["peak_reserved"],
        "checkpoint_reentrant": models.CHECKPOINT_USE_REENTRANT,
        **trainer.info(),
    }


if __name__ == "__main__":
    worker_main("throughput", run)
