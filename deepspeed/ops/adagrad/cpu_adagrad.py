"""``DeepSpeedCPUAdagrad``: Adagrad for offloaded params (pure-torch implementation; no native kernel)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deepspeed.ops._optimizer_base import StatefulOptimizer, StepItem, group_items
from deepspeed.ops._torch_optim import adagrad_update


class DeepSpeedCPUAdagrad(StatefulOptimizer):
    """Adagrad with L2 weight decay and no lr decay, matching ``torch.optim.Adagrad``; upstream signature."""

    STATE_KEYS = ("exp_avg_sq",)

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad does not support amsgrad=True")
        super().__init__(model_params, {"lr": lr, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad})
        self.fp32_optimizer_states = fp32_optimizer_states

    def _step_group(self, group: dict[str, Any], items: list[StepItem]) -> None:
        for members in group_items(items).values():
            adagrad_update(
                [m[0] for m in members],
                [m[1] for m in members],
                [m[2]["exp_avg_sq"] for m in members],
                group["lr"],
                group["eps"],
                group["weight_decay"],
            )
