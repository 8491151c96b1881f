"""The part of a sharded optimizer step every ZeRO stage shares: one scalar all-reduce decides overflow,
the global norm and the single coefficient (unscale × clip) applied to the local gradient shards."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed import comm as dist


@dataclass(frozen=True)
class StepDecision:
    """Outcome of the shared prologue: skip on overflow, else apply ``coef`` and record ``norm``."""

    overflow: bool
    norm: float | None
    coef: float


class ShardedStepMixin:
    """For ZeRO optimizers whose ranks hold disjoint gradient shards (stages 1-3)."""

    dp_group: Any
    world_size: int
    check_overflow: bool
    plan: Any
    stage_group: Any

    def _decide_step(self, local_sq: torch.Tensor) -> StepDecision:
        """All-reduce this rank's squared norm, then derive overflow, the unscaled norm and the coefficient."""
        if self.world_size > 1:
            dist.all_reduce(local_sq, group=self.dp_group)
        if self.stage_group is not None:  # pipeline: the other stages' shards ([Note: pipeline norm])
            dist.all_reduce(local_sq, group=self.stage_group)
        scale = self.cur_scale
        total = float(local_sq)
        norm = math.sqrt(total) / scale if math.isfinite(total) else float("inf")
        if self.check_overflow and not math.isfinite(norm):
            return StepDecision(True, None, 1.0)
        coef = 1.0 / scale
        clip = self.plan.grads.clip_norm
        if clip > 0 and norm > clip:
            coef *= clip / (norm + 1e-6)
        return StepDecision(False, norm, coef)

    def _skip_step(self) -> bool:
        """Overflow: drop this window's gradients everywhere and back the loss scale off."""
        self._global_grad_norm = None
        self._clear_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(True)
        return False
