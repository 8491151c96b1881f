"""ZeRO-3 host overhead on the CPU: a 36-layer Qwen-shaped model so small that Python dominates the step.

    PYTHONPATH=. python benchmarks/zero3_hook_overhead.py                    # ours, fp32, one rank
    PYTHONPATH=. python benchmarks/zero3_hook_overhead.py --dtype bf16 --world-size 8 --impl fsdp2
    PYTHONPATH=. python benchmarks/zero3_hook_overhead.py --dtype bf16 --zero '{"lean_gather_from_master": false}'
    PYTHONPATH=. python benchmarks/zero3_hook_overhead.py --dtype bf16 --profile 25   # + cProfile, top 25 by own time

Not a timed test. It isolates the per-step Python cost of the parameter side (fetch, prefetch decisions, gather
bookkeeping, release) and of the optimizer step, which on a GPU is paid on the host while the device waits. One
rank runs a real one-process group; ``--world-size N > 1`` runs rank 0 of PyTorch's fake group, where collectives
cost nothing, so the figure is overhead only (the same protocol as the S3 fake-group rows). ``--impl fsdp2`` runs
the same model under ``fully_shard`` per decoder layer for a same-machine ratio. Prints the median and minimum of
``--steps`` steps after two warm-ups (a small shared CPU is noisy: the minimum is the steadier figure).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
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


def _trainer(args: argparse.Namespace, model: torch.nn.Module, shape) -> _harness.Trainer:
    spec = {"impl": args.impl, "stage": 3, "world_size": args.world_size, "dtype": args.dtype}
    if args.impl == "fsdp2":
        from baselines.fsdp2 import FSDP2Trainer

        if args.dtype != "bf16":
            raise SystemExit("--impl fsdp2 runs bf16 only (its mixed-precision recipe)")
        return FSDP2Trainer(model, spec)
    cfg = _harness.hf_auto_config(spec, shape.hidden)
    if args.dtype == "fp32":
        cfg.pop("bf16")
    cfg["zero_optimization"].update(json.loads(args.zero))
    return _harness.DeepSpeedTrainer(model, spec, config=cfg)


def main() -> None:
    """Build, warm up, time ``--steps`` steps, print the median and the minimum (and a profile if asked)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=("ours", "fsdp2"), default="ours")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--world-size", type=int, default=1, help="> 1: rank 0 of PyTorch's fake process group")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--zero", default="{}", help="JSON merged into zero_optimization (ours)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the timed steps; print this many rows")
    args = ap.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(0)
    shape = replace(MODELS["quick-qwen"], layers=args.layers)
    MODELS["hook-overhead"] = shape
    _harness.init_process_group(args.impl, args.world_size)
    model = build_model("hook-overhead", torch.device("cpu"), torch.float32)
    trainer = _trainer(args, model, shape)
    ids, labels = random_batch(shape, 1, torch.device("cpu"))

    def step() -> None:
        trainer.backward(trainer.loss(ids, labels))
        trainer.step()

    for _ in range(2):
        step()
    prof = cProfile.Profile() if args.profile else None
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        if prof is not None:
            prof.enable()
        step()
        if prof is not None:
            prof.disable()
        times.append(time.perf_counter() - start)
    times.sort()
    sys.stdout.write(
        f"{args.impl} {args.dtype} N={args.world_size} zero={args.zero}: median step s {times[len(times) // 2]:.4f}"
        f"  min {times[0]:.4f}  ({args.steps} steps)\n"
    )
    if prof is not None:
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown (a fake group can be slow to destroy)


if __name__ == "__main__":
    main()
