"""S2: what does initialisation cost in device memory, reserved memory, host memory and time?

One worker = one (implementation, ZeRO stage, world size). The model (a 2-6 GB bf16 decoder) is built directly
on the GPU in bf16 before the clock starts (FSDP2: in fp32, its parameter dtype); then we reset the peak
counters and time ``deepspeed.initialize`` (or ``fully_shard`` + optimizer construction) while a thread samples
the process's resident set size. Recorded: device peak during initialise, allocated and reserved right after,
reserved − allocated (the memory the allocator keeps but nobody uses), host RSS
growth (end and peak), wall time. Then one training step shows where the first step starts from.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from _harness import (
    DTYPES,
    DeepSpeedTrainer,
    RssSampler,
    device,
    mem,
    reset_peak,
    sync,
    worker_main,
)
from models import MODELS, build_model, random_batch


def _wrap(model: torch.nn.Module, spec: dict):
    if spec["impl"] == "fsdp2":
        from baselines.fsdp2 import FSDP2Trainer

        return FSDP2Trainer(model, spec)
    return DeepSpeedTrainer(model, spec)


def run(spec: dict) -> dict:
    """Measure one initialisation (see the module docstring)."""
    cfg = MODELS[spec["model"]]
    dtype = torch.float32 if spec["impl"] == "fsdp2" else DTYPES[spec.get("dtype", "bf16")]
    model = build_model(spec["model"], device(), dtype)
    n_params = sum(p.numel() for p in model.parameters())
    sync()
    before = mem()
    reset_peak()
    with RssSampler() as rss:
        t0 = time.perf_counter()
        trainer = _wrap(model, spec)
        sync()
        init_s = time.perf_counter() - t0
    after = mem()
    ids, labels = random_batch(cfg, 1, device())
    reset_peak()
    trainer.backward(trainer.loss(ids, labels))
    trainer.step()
    sync()
    first = mem()
    return {
        "params": n_params,
        "model_cfg": cfg.to_dict(),
        "param_dtype_bytes": torch.finfo(dtype).bits // 8,
        "alloc_before_init_gib": before["alloc"],
        "reserved_before_init_gib": before["reserved"],
        "init_peak_alloc_gib": after["peak_alloc"],
        "init_peak_reserved_gib": after["peak_reserved"],
        "alloc_after_init_gib": after["alloc"],
        "reserved_after_init_gib": after["reserved"],
        "reserved_minus_alloc_after_init_gib": after["reserved"] - after["alloc"],
        "host_rss_before_gib": rss.start_rss / 2**30,
        "host_rss_growth_gib": (rss.end_rss - rss.start_rss) / 2**30,
        "host_rss_peak_growth_gib": (rss.peak - rss.start_rss) / 2**30,
        "init_wall_s": init_s,
        "first_step_peak_alloc_gib": first["peak_alloc"],
        "first_step_peak_reserved_gib": first["peak_reserved"],
        "alloc_retries": first["alloc_retries"],
        **trainer.info(),
    }


if __name__ == "__main__":
    worker_main("s2_init", run)
