"""What every ZeRO stage (1-3) optimizer shares: the step prologue and the checkpoint entry points.

The step prologue is one scalar all-reduce that decides overflow, the global norm and the single coefficient
(unscale × clip) applied to the local gradient shards. A checkpoint is this rank's shard in upstream's format;
each stage names the module that writes and reads its keys (:attr:`ShardedOptimizer.checkpoint_format`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any

import torch

from deepspeed._core.comm.collectives import sum_over
from deepspeed._core.optim.base import EngineOptimizer


def package_version() -> str:
    """The installed distribution's version (what checkpoints record as ``ds_version``)."""
    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "0.0.0"


@dataclass(frozen=True)
class StepDecision:
    """Outcome of the shared prologue: skip on overflow, else apply ``coef`` and record ``norm``."""

    overflow: bool
    norm: float | None
    coef: float


class ShardedOptimizer(EngineOptimizer):
    """Base of the ZeRO optimizers whose ranks hold disjoint gradient shards (stages 1-3).

    Subclasses set ``checkpoint_format``: a module with ``shard_state_dict(opt, version)`` and
    ``load_shards(opt, shards, load_optimizer_states, load_from_fp32_weights)``.
    """

    checkpoint_format: ModuleType
    dp_group: Any
    world_size: int
    check_overflow: bool
    plan: Any

    def _decide_step(self, local_sq: torch.Tensor) -> StepDecision:
        """All-reduce this rank's squared norm, then derive overflow, the unscaled norm and the coefficient."""
        if self.world_size > 1:
            sum_over(local_sq, self.dp_group)
        if self.stage_group is not None:  # pipeline: the other stages' shards ([Note: pipeline norm])
            sum_over(local_sq, self.stage_group)
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

    def _clear_grads(self) -> None:
        """Drop this window's gradients (each stage's buffers)."""
        raise NotImplementedError

    # --- checkpoints (interface: deepspeed._core.checkpoint.save_load.ShardedCheckpointOptimizer) ---------
    def state_dict(self) -> dict:
        """This rank's shard with upstream's keys for its stage."""
        return self.checkpoint_format.shard_state_dict(self, package_version())

    def load_state_dict(  # type: ignore[override]  # upstream's ZeRO signature: every saved rank's shard
        self, state_dict_list: list, load_optimizer_states: bool = True, load_from_fp32_weights: bool = True
    ) -> None:
        """Restore from every saved rank's shard; the saved world size may differ from the live one."""
        if isinstance(state_dict_list, dict):
            state_dict_list = [state_dict_list]
        self.checkpoint_format.load_shards(self, state_dict_list, load_optimizer_states, load_from_fp32_weights)
