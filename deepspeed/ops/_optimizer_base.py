"""Shared plumbing of the ops' optimizers: lazy state, per-param step counts, grouping.

State keys follow torch (``step``, ``exp_avg``, ``exp_avg_sq``) so checkpoints look familiar;
``step`` is a Python int per parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

StepItem = tuple[torch.Tensor, torch.Tensor, dict[str, Any]]


class StatefulOptimizer(torch.optim.Optimizer):
    """Base class: subclasses set ``STATE_KEYS`` and implement ``_step_group``."""

    STATE_KEYS: tuple[str, ...] = ()
    fp32_optimizer_states: bool = False

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        """fp32 states for low-precision params when ``fp32_optimizer_states``, else the param dtype."""
        if self.fp32_optimizer_states and p.dtype in (torch.float16, torch.bfloat16):
            return torch.float32
        return p.dtype

    def _prepare(self, group: dict[str, Any]) -> list[StepItem]:
        """(param, grad, state) for every param with a gradient; creates state and advances ``step``."""
        items = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = 0
                for key in self.STATE_KEYS:
                    state[key] = torch.zeros_like(p, dtype=self._state_dtype(p), memory_format=torch.contiguous_format)
            state["step"] = int(state["step"]) + 1
            grad = p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype)
            items.append((p, grad.contiguous(), state))
        return items

    def _step_group(self, group: dict[str, Any], items: list[StepItem]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter group; returns ``closure()``'s loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group, self._prepare(group))
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts loaded states to the param dtype; put fp32 states back to fp32 afterwards."""
        saved = {k: dict(v) for k, v in state_dict.get("state", {}).items()}
        super().load_state_dict(state_dict)
        if not self.fp32_optimizer_states:
            return
        index_to_param: dict[int, torch.Tensor] = {}
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups, strict=True):
            index_to_param.update(zip(saved_group["params"], group["params"], strict=True))
        for index, values in saved.items():
            p = index_to_param.get(index)
            if p is None:
                continue
            for key in self.STATE_KEYS:
                if torch.is_tensor(values.get(key)):
                    self.state[p][key] = values[key].to(device=p.device, dtype=self._state_dtype(p)).contiguous()


def group_items(items: list[StepItem]) -> dict[tuple[Any, ...], list[StepItem]]:
    """Items grouped by (device, param dtype, state dtype, step): what one foreach or kernel call needs."""
    groups: dict[tuple[Any, ...], list[StepItem]] = {}
    for item in items:
        p, _, state = item
        first_state = state[next(k for k in state if k != "step")]
        groups.setdefault((p.device, p.dtype, first_state.dtype, state["step"]), []).append(item)
    return groups
