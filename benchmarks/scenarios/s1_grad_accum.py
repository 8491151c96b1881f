"""S1: does peak memory grow with gradient accumulation?

One worker = one (implementation, ZeRO stage, dtype, GAS, world size). Protocol:
1. build the model on the GPU in its working dtype, wrap it (``deepspeed.initialize`` / ``fully_shard``);
2. warm-up optimizer step (allocates the optimizer state; fp16 retries up to 3 times if the step was skipped);
3. measured step: peak counters reset, then GAS micro-steps (forward, backward, ``step``); we record allocated
   memory after every micro-step, the peak allocated and reserved over the whole step, and the step time;
4. a third step, to compare allocated memory at the same point of consecutive steps (steady state).
Step times come from workers that may share the GPU with other workers (run_all --jobs > 1): read the solo
throughput scenario for speed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import device, mem, reset_peak, sync, worker_main
from models import random_batch
from trainers import make_trainer


def _one_step(trainer, batches) -> list[float]:
    after_micro = []
    for ids, labels in batches:
        loss = trainer.loss(ids, labels)
        trainer.backward(loss)
        trainer.step()
        after_micro.append(mem()["alloc"])
    return after_micro


def run(spec: dict) -> dict:
    """Measure one configuration (see the module docstring)."""
    gas = int(spec.get("gas", 1))
    trainer, cfg, n_params = make_trainer(spec["model"], spec)
    after_init = mem()
    batches = [random_batch(cfg, int(spec.get("micro_batch", 1)), device(), seed=m) for m in range(gas)]
    warm = 0
    for _ in range(4):
        _one_step(trainer, batches)
        warm += 1
        if trainer.info().get("skipped_steps", 0) < warm:
            break  # a real (not skipped) step has happened: the optimizer state exists
    sync()
    before = mem()
    reset_peak()
    t0 = time.perf_counter()
    micro = _one_step(trainer, batches)
    sync()
    step_s = time.perf_counter() - t0
    measured = mem()
    third = _one_step(trainer, batches)
    sync()
    info = trainer.info()
    return {
        "params": n_params,
        "model_cfg": cfg.to_dict(),
        "tokens_per_step": gas * cfg.seq * int(spec.get("micro_batch", 1)),
        "alloc_after_init_gib": after_init["alloc"],
        "reserved_after_init_gib": after_init["reserved"],
        "warmup_steps": warm,
        "alloc_before_step_gib": before["alloc"],
        "peak_alloc_gib": measured["peak_alloc"],
        "peak_reserved_gib": measured["peak_reserved"],
        "alloc_after_micro_gib": micro,
        "alloc_between_micro_max_gib": max(micro[:-1]) if gas > 1 else None,
        "alloc_after_step_gib": micro[-1],
        "alloc_after_next_step_gib": third[-1],
        "steady_drift_gib": third[-1] - micro[-1],
        "step_time_s": step_s,
        "alloc_retries": measured["alloc_retries"],
        **info,
    }


if __name__ == "__main__":
    worker_main("s1_grad_accum", run)
