"""Global gradient norm and clipping, for whole or partitioned gradients.

With partitioned gradients (ZeRO) each rank holds a disjoint part of the gradient, so the global norm
is the square root of the sum of the ranks' squared local norms: one all-reduce of one scalar.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import torch

from deepspeed import comm as dist


class NormScope(enum.Enum):
    """Whether each rank holds whole gradients (``REPLICATED``) or a disjoint part (``PARTITIONED``)."""

    REPLICATED = "replicated"
    PARTITIONED = "partitioned"


def local_sq_norm(grads: Sequence[torch.Tensor], chunk_numel: int | None = None) -> torch.Tensor:
    """Sum of squares of ``grads`` in fp32, as a 0-d tensor on the grads' device (0 if empty).

    Low-precision gradients are upcast ``chunk_numel`` elements at a time (all at once when ``None``),
    so the norm never needs an fp32 copy of a whole gradient partition ([Note: chunked step]).
    """
    grads = [g for g in grads if g is not None and g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    pieces = []
    for g in grads:
        flat = g.reshape(-1)
        step = flat.numel() if chunk_numel is None or g.dtype == torch.float32 else max(1, chunk_numel)
        pieces.extend(flat[i : i + step] for i in range(0, flat.numel(), step))
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for piece in pieces:
        total += piece.float().square().sum() if piece.dtype != torch.float32 else piece.square().sum()
    return total


def global_norm(grads: Sequence[torch.Tensor], scope: NormScope, group: Any = None) -> float:
    """L2 norm of all ``grads``; for ``PARTITIONED`` gradients the squared sums are added across ``group``.

    Returns ``inf`` when any gradient holds inf or nan, so callers can treat it as an overflow.
    """
    sq = local_sq_norm(grads)
    if scope is NormScope.PARTITIONED and dist.is_initialized() and dist.get_world_size(group=group) > 1:
        dist.all_reduce(sq, group=group)
    value = float(sq.sqrt().item())
    return value if math.isfinite(value) else float("inf")


def clip_(grads: Sequence[torch.Tensor], total_norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place so their global norm is at most ``max_norm`` (no-op if ``max_norm <= 0``)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_([g for g in grads if g is not None], coef)
