"""Global gradient norm and clipping, for whole or partitioned gradients.

With partitioned gradients (ZeRO) each rank holds a disjoint part of the gradient, so the global norm
is the square root of the sum of the ranks' squared local norms: one all-reduce of one scalar.

[Note: batched norm] An offloaded ZeRO-3 step holds its device-side gradients in hundreds of small pieces
(one per persistent or parked parameter); a copy, a dot and an add for each was about 950 small kernels and
0.08 s of the 3B step on an H100. One multi-tensor norm reads every small piece in a few launches, upcasting
in registers (no scratch), and only the per-piece norms are squared and summed. On the host the per-piece
loop through one cache-sized block stays: the host has no launch cost to save.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import sum_over

NORM_CHUNK_NUMEL = 1 << 23
"""Largest piece of a narrow gradient upcast at once by :func:`local_sq_norm` (32 MiB in fp32): the norm's own
size, independent of the reducer's buckets and of the step's chunks."""
HOST_NORM_BLOCK_NUMEL = 1 << 20
"""On the host the upcast goes 4 MiB at a time through one reused buffer: the block stays in cache, and no
fresh host tensor is page-faulted in per piece (128M bf16 elements: 0.35 s that way, 0.04-0.05 s through one
cache-sized buffer, on the 2-core development CPU; ``norm_*`` in ``benchmarks/offload_step_cpu.py``)."""


class NormScope(enum.Enum):
    """Whether each rank holds whole gradients (``REPLICATED``) or a disjoint part (``PARTITIONED``)."""

    REPLICATED = "replicated"
    PARTITIONED = "partitioned"


def local_sq_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of ``grads`` in fp32, as a 0-d tensor on the first gradient's device (0 if empty).

    fp32 gradients are reduced with a dot product, which needs no temporary. Narrower ones are upcast
    at most :data:`NORM_CHUNK_NUMEL` elements at a time, so the norm's transient stays a few
    tens of MiB whatever the partition size (an upcast of a whole bucket cost 2x its fp32 size at the
    step peak on the H200: docs/benchmarks.md). Gradients on several devices (ZeRO-3 gradients parked in
    device shards beside host ones) are reduced where each lives and only the partial sums move: one upcast
    buffer on the first device made the offloaded 3B step 1.8 s slower on the H200 (S3 scenario).
    """
    grads = [g for g in grads if g is not None and g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    partials = [_sq_norm_on(device, same) for device, same in by_device.items()]
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial.to(total.device)
    return total


def _sq_norm_on(device: torch.device, grads: list[torch.Tensor]) -> torch.Tensor:
    step = min(NORM_CHUNK_NUMEL, HOST_NORM_BLOCK_NUMEL) if device.type == "cpu" else NORM_CHUNK_NUMEL
    total = torch.zeros((), dtype=torch.float32, device=device)
    if _batches_on(device):
        small = [g for g in grads if g.numel() <= step]
        if small:
            total += _foreach_sq_norm(small)
            grads = [g for g in grads if g.numel() > step]
    scratch: torch.Tensor | None = None  # one upcast buffer for every piece
    for g in grads:
        flat = g.reshape(-1)
        if flat.dtype == torch.float32:
            total += torch.dot(flat, flat)
            continue
        if scratch is None:
            widest = max(t.numel() for t in grads if t.dtype != torch.float32)
            scratch = torch.empty(min(step, widest), dtype=torch.float32, device=device)
        for start in range(0, flat.numel(), step):
            piece = scratch[: min(step, flat.numel() - start)]
            piece.copy_(flat[start : start + piece.numel()])
            total += torch.dot(piece, piece)
    return total


def _batches_on(device: torch.device) -> bool:
    """Whether the pieces up to one upcast block go through one multi-tensor norm on ``device`` ([Note: batched
    norm])."""
    return device.type != "cpu"


def _foreach_sq_norm(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of ``pieces`` (all on one device) from their fp32 norms, as a 0-d fp32 tensor."""
    norms = torch._foreach_norm(pieces, 2, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def global_norm(grads: Sequence[torch.Tensor], scope: NormScope, group: Any = None, stage_group: Any = None) -> float:
    """L2 norm of all ``grads``; for ``PARTITIONED`` gradients the squared sums are added across ``group``.

    ``stage_group`` (pipeline parallelism) adds the squared sums of the other stages, which hold other
    parameters ([Note: pipeline norm]). Returns ``inf`` when any gradient holds inf or nan, so callers can
    treat it as an overflow.
    """
    sq = local_sq_norm(grads)
    if scope is NormScope.PARTITIONED and dist.is_initialized() and dist.get_world_size(group=group) > 1:
        sum_over(sq, group)
    if stage_group is not None:
        sum_over(sq, stage_group)
    value = float(sq.sqrt().item())
    return value if math.isfinite(value) else float("inf")


def counts_in_norm(param: torch.Tensor) -> bool:
    """False for a pipeline stage's copy of a tied weight whose first holder is another stage.

    [Note: pipeline norm] Stages hold disjoint parameters, except tied weights, which every holding stage keeps
    (with the same summed gradient). The global norm counts each tied weight once: the pipeline engine marks
    the other copies with upstream's ``ds_pipe_replicated`` attribute.
    """
    return not getattr(param, "ds_pipe_replicated", False)


def clip_(grads: Sequence[torch.Tensor], total_norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place so their global norm is at most ``max_norm`` (no-op if ``max_norm <= 0``)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_([g for g in grads if g is not None], coef)


def global_norm_of_parts(parts: Sequence[tuple[Sequence[torch.Tensor], Any]], stage_group: Any = None) -> float:
    """L2 norm over several kinds of whole (unpartitioned) gradients.

    Each part is ``(grads, group)``: the squared sum of ``grads`` is added across ``group`` when it is not
    ``None`` (expert gradients: every expert-parallel rank holds different experts, so each expert counts
    once), and taken as is otherwise (shared gradients, identical on every rank). Every rank must pass the
    parts in the same order. Returns ``inf`` when any gradient holds inf or nan.
    """
    total = torch.zeros((), dtype=torch.float32)
    for grads, group in parts:
        sq = local_sq_norm(grads)
        if group is not None and dist.get_world_size(group=group) > 1:
            sum_over(sq, group)
        total = total + sq.to(total.device)
    if stage_group is not None:  # pipeline stages hold other parameters ([Note: pipeline norm])
        device = next((g.device for grads, _ in parts for g in grads), total.device)
        total = total.to(device)
        sum_over(total, stage_group)
    value = float(total.sqrt().item())
    return value if math.isfinite(value) else float("inf")
