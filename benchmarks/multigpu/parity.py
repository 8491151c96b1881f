"""Parity of every ZeRO stage against a single-process reference, over the real backend (NCCL on GPUs).

Run through our launcher, which is part of what it checks:

    deepspeed --num_gpus 2 benchmarks/multigpu/parity.py --out results.jsonl

Each rank trains the same small model for every stage/precision case on its own micro-batches; rank 0
then trains the unsharded reference (fp32, one process, all micro-batches) and compares. On a machine
without GPUs the launcher starts CPU processes over gloo, so the script can be smoke-tested anywhere.
Writes one JSON line per case and exits non-zero if any case misses its tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index, reference_train

STEPS, GAS, LR = 8, 2, 1e-2
CASES = [(stage, prec) for stage in (0, 1, 2, 3) for prec in ("fp32", "bf16")]
CASES += [(2, "fp32+offload"), (3, "fp32+offload"), (3, "bf16+offload")]  # optimizer on the host: pinned D2H
# Even-sized embedding/head (912 elements): at world size 2 they need no padding, so ZeRO-3 reduce-scatters
# them straight from their gradients, and their flat all-gather buffers are the largest.
CASES += [(3, "fp32+even"), (3, "bf16+even")]
EVEN_MODEL = {"vocab": 38, "hidden": 24}
# Tied embedding/head: ZeRO-3 reduces each use's gradient on its own ([Note: routed grads]), also into host chunks.
CASES += [(3, "fp32+tied"), (3, "bf16+tied+offload")]
# One micro-step per window with the optimizer offloaded: gradients wait in the parameters' shards until the step
# ([Note: parked grads]).
CASES += [(3, "fp32+gas1+offload"), (3, "bf16+gas1+offload")]


def _gas(prec: str) -> int:
    return 1 if "+gas1" in prec else GAS


# Stage pairs that reduce the same way (0/1: fp32 accumulation, then all-reduce / reduce-scatter; 2/3: per
# micro-step reduce-scatter into bf16 shards) must match each other far more tightly than the reference.
SAME_PATH = {((0, "bf16"), (1, "bf16")): 1e-3, ((2, "bf16"), (3, "bf16")): 1e-3}


def _model(prec: str) -> torch.nn.Module:
    return make_model(0, tied="+tied" in prec, **(EVEN_MODEL if prec.endswith("+even") else {}))


def _config(stage: int, prec: str) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": _gas(prec),
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 400, "allgather_bucket_size": 600},
    }
    if prec.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    if prec.endswith("+offload"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return cfg


def _train(stage: int, prec: str, world: int) -> dict[str, torch.Tensor]:
    engine, *_ = deepspeed.initialize(model=_model(prec), config=_config(stage, prec))
    for step in range(STEPS):
        for m in range(_gas(prec)):
            tokens, labels = micro_batch(step, engine_micro_index(m, dist.get_rank(), world))
            engine.backward(engine(tokens.to(engine.device), labels.to(engine.device)))
            engine.step()
    if stage == 3:
        sd = engine._zero3_consolidated_16bit_state_dict()
    else:
        sd = {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return {k: v.float().cpu() for k, v in sd.items()} if sd is not None else {}


def _reference(world: int, prec: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The single-process reference, on ``device``: bf16 kernels round differently on CPU and GPU."""
    model = _model(prec)
    dtype = torch.bfloat16 if prec.startswith("bf16") else torch.float32  # offload cases train in fp32
    opt = lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01)  # noqa: E731
    reference_train(model, STEPS, world, _gas(prec), opt, clip=1.0, working_dtype=dtype, device=device)
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", default="parity.jsonl")
    args = parser.parse_args()
    deepspeed.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    failures = 0
    results: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for stage, prec in CASES:
        start = time.time()
        got = _train(stage, prec, world)
        if rank != 0:
            continue
        results[(stage, prec)] = got
        ref = _reference(world, prec, torch.device(get_accelerator().current_device_name()))
        worst = max(float((got[k] - v).norm() / v.norm()) for k, v in ref.items())
        # bf16: each micro-step's gradient is rounded to bf16 (on the wire or in the accumulator) in another
        # order than the reference's, and 8 Adam steps carry that on. Measured worst tensors: 5e-3 to 7e-3 over
        # gloo on CPU, 1.1e-2 (stages 0/1) and 1.6e-2 (2/3) over NCCL on the H200, 2.2e-2 for the even model
        # (5.3e-3 with fp32 wire and accumulation). A sharding bug errs by O(1); the stricter check for bf16
        # is that stages sharing a reduction path agree with each other (SAME_PATH below).
        tol = 3e-2 if prec.startswith("bf16") else 1e-5
        ok = worst < tol
        failures += not ok
        row = dict(
            stage=stage,
            precision=prec,
            world_size=world,
            reference_device=get_accelerator().device_name(),
            backend=dist.get_backend() if hasattr(dist, "get_backend") else "",
            worst_rel_err=worst,
            tol=tol,
            ok=ok,
            seconds=round(time.time() - start, 2),
        )
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    if rank == 0:
        for (a, b), tol in SAME_PATH.items():
            if a not in results or b not in results:
                continue
            diff = max(float((results[b][k] - v).norm() / v.norm()) for k, v in results[a].items())
            ok = diff < tol
            failures += not ok
            row = dict(
                check=f"stage {b[0]} vs stage {a[0]} ({a[1]})", world_size=world, max_rel_diff=diff, tol=tol, ok=ok
            )
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
