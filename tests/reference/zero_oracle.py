"""The ground truth for parity tests: one process, no sharding, no DeepSpeed.

A step of the data-parallel engine over ``world_size`` ranks × ``gas`` micro-batches must equal one
step of this loop over the same micro-batches: the gradient of the mean of the micro-batch losses,
clipped to the global norm, then a plain torch optimizer step. Micro-batch ``i`` of step ``s`` is
``micro_batch(s, i)``; rank ``r`` at micro-step ``m`` of the engine uses index ``m * world_size + r``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tests.reference.models import micro_batch


def reference_train(
    model: torch.nn.Module,
    steps: int,
    world_size: int | Sequence[int],
    gas: int,
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    clip: float = 0.0,
    lr_lambda: Callable[[int], float] | None = None,
    working_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[float]:
    """Train ``model`` in place; returns the mean loss of every step.

    ``world_size`` may be a per-step sequence, for runs resumed at another data-parallel size: step ``s``
    then sees ``world_size[s] * gas`` micro-batches.

    With a low-precision ``working_dtype`` the model computes in that dtype while the optimizer steps
    on fp32 master copies (the textbook mixed-precision recipe), so the reference has the same
    rounding points as a correct engine. ``device`` is where the reference computes: a GPU engine's bf16
    results are compared with a reference on the same kind of device, since CPU and GPU bf16 kernels round
    differently.
    """
    model.to(
        device=device, dtype=working_dtype
    )  # masters start from the rounded weights, as in any engine that casts first
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = make_optimizer(masters)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda) if lr_lambda else None
    losses = []
    worlds = [world_size] * steps if isinstance(world_size, int) else list(world_size)
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        total = 0.0
        n = worlds[step] * gas
        for index in range(n):
            loss = model(*(t.to(device) for t in micro_batch(step, index))) / n
            loss.backward()
            total += float(loss.detach())
        for p, m in zip(params, masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
    return losses


def engine_micro_index(micro_step: int, rank: int, world_size: int) -> int:
    """Index of the micro-batch rank ``rank`` feeds at micro-step ``micro_step`` of a window."""
    return micro_step * world_size + rank
