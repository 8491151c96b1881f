"""Gating and the dispatch/combine layer (upstream path ``deepspeed.moe.sharded_moe``)."""

from __future__ import annotations

import torch

from deepspeed._core.moe.gating import TopKGate, capacity, gumbel_rsample, multiplicative_jitter, top1gating, top2gating
from deepspeed._core.moe.layer import MOELayer, _AllToAll

__all__ = [
    "TopKGate",
    "MOELayer",
    "top1gating",
    "top2gating",
    "gumbel_rsample",
    "multiplicative_jitter",
    "_AllToAll",
    "_capacity",
]


def _capacity(gates: torch.Tensor, capacity_factor: torch.Tensor | float, min_capacity: torch.Tensor | int) -> int:
    """Slots per expert for ``gates`` of shape ``(tokens, experts)``."""
    return capacity(gates.shape[0], gates.shape[1], float(capacity_factor), int(min_capacity))
