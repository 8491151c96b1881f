"""Factors around a sum-reduction of gradients over data-parallel ranks (``prescale_gradients`` and
``gradient_predivide_factor`` semantics), shared by every stage's reducer."""

from __future__ import annotations

from dataclasses import dataclass

from deepspeed._core.config.plan import GradPolicy, ReduceOp


@dataclass(frozen=True)
class ReduceScaling:
    """Factors applied before and after the sum-reduction (``prescale`` / ``predivide_factor`` semantics)."""

    pre: float
    post: float

    @staticmethod
    def from_policy(policy: GradPolicy, world_size: int) -> ReduceScaling:
        """Derive the factors so that the result is the mean (or sum) over ``world_size`` ranks."""
        if policy.reduce_op is ReduceOp.SUM:
            return ReduceScaling(1.0, 1.0)
        if policy.prescale:
            return ReduceScaling(1.0 / policy.predivide_factor, policy.predivide_factor / world_size)
        return ReduceScaling(1.0, 1.0 / world_size)
