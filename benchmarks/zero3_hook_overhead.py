"""ZeRO-3 hook overhead on the CPU: a 36-layer Qwen-shaped model so small that Python dominates the step.

    PYTHONPATH=. python benchmarks/zero3_hook_overhead.py      # median and min of 15 steps after 2 warm-ups

Not a timed test. It isolates the parameter manager's per-hook Python cost (fetch, prefetch decisions,
release), which on a GPU is paid on the CPU while the device waits; one rank, fp32, HF's "auto" ZeRO-3 config.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29912")

import torch

import _harness
from models import MODELS, build_model, random_batch

STEPS = 15  # a small shared CPU is noisy: the minimum is the steadier figure of the two


def main() -> None:
    """Build, warm up, time ``STEPS`` steps, print the median and the minimum."""
    import deepspeed

    torch.set_num_threads(2)
    shape = replace(MODELS["quick-qwen"], layers=36)
    MODELS["hook-overhead"] = shape
    model = build_model("hook-overhead", torch.device("cpu"), torch.float32)
    cfg = _harness.hf_auto_config({"impl": "ours", "stage": 3, "world_size": 1}, shape.hidden)
    cfg.pop("bf16")
    engine, *_ = deepspeed.initialize(model=model, optimizer=_harness.make_optimizer(model.parameters()), config=cfg)
    ids, labels = random_batch(shape, 1, torch.device("cpu"))

    def step() -> None:
        engine.backward(engine(ids, labels))
        engine.step()

    for _ in range(2):
        step()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    sys.stdout.write(f"median step s {times[STEPS // 2]:.3f}  min {times[0]:.3f}  ({STEPS} steps)\n")


if __name__ == "__main__":
    main()
