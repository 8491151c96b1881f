"""``DeepSpeedCPULion`` and ``FusedLion``: the Lion optimizer in pure torch (``torch._foreach_*``).

Update: ``p = p * (1 - lr * wd) - lr * sign(beta1 * m + (1 - beta1) * g)``, then
``m = beta2 * m + (1 - beta2) * g``. No native kernel is built for either class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepspeed.ops._optimizer_base import StatefulOptimizer, StepItem, group_items
from deepspeed.ops._torch_optim import lion_update


class _Lion(StatefulOptimizer):
    STATE_KEYS = ("exp_avg",)

    def _step_group(self, group: dict[str, Any], items: list[StepItem]) -> None:
        beta1, beta2 = group["betas"]
        for members in group_items(items).values():
            lion_update(
                [m[0] for m in members],
                [m[1] for m in members],
                [m[2]["exp_avg"] for m in members],
                group["lr"],
                beta1,
                beta2,
                group["weight_decay"],
            )


class DeepSpeedCPULion(_Lion):
    """Lion for offloaded params; upstream signature."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})
        self.fp32_optimizer_states = fp32_optimizer_states


class FusedLion(_Lion):
    """Lion for device params (foreach implementation); upstream signature."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients; ``set_grad_none`` (constructor) decides unless ``set_to_none`` is given."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Lion step over every group."""
        return super().step(closure)
