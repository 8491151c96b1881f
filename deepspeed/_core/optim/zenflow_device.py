"""ZenFlow's every-step path stepped where the working weights live.

[Note: zenflow columns] With the every-step path on the host, each step gathers the selected elements of the
master and both moments out of the partition and scatters them back, and gathering a tenth of a weight's columns
touches most of its cache lines: the host does about as much work per step as the plain offloaded update
([Note: zenflow split]). So once columns are selected (and the optimizer is the host Adam with fp32 states), the
selected elements' master and moments are kept packed beside the working weights (:class:`DeviceColumns`,
12 bytes per selected element) and stepped there with the same rule; per step the host only packs the selected
gradient (sent over) and adds the rest into its accumulator, and the new values go into the working weights by
the split's indices without crossing back. The host copies of those elements are stale meanwhile:
:meth:`~deepspeed._core.optim.zenflow.ZenFlowUpdate.sync_columns` writes them back before anything reads the
whole master (a full publish, a new selection, a checkpoint, the ``safe_get_*`` helpers) and drops the columns
when the host copy is replaced (a load, ``safe_set_*``). The arithmetic is the host kernel's, in the same order,
on fp32; an accelerator may still round a fused multiply-add differently, so the two are close, not bit-equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamRule:
    """How weight decay enters the update: ``decoupled`` (AdamW) scales the master, else (Adam with L2) it is
    added to the gradient."""

    decoupled: bool


def adam_rule_of(optimizer: torch.optim.Optimizer) -> AdamRule | None:
    """The rule of a host Adam with fp32 states (``DeepSpeedCPUAdam``'s policy), which the columns can step the
    same way; ``None`` for any other optimizer (its every-step path stays on the host)."""
    policy = getattr(optimizer, "policy", None)
    mode = getattr(policy, "mode", None)
    if mode is None or not getattr(policy, "fp32_optimizer_states", False):
        return None
    return AdamRule(decoupled=mode.name == "DECOUPLED")


@dataclass
class DeviceColumns:
    """One group's every-step path, packed in the split's order, on the working weights' device."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int

    def step_(self, grad: torch.Tensor, group: dict, rule: AdamRule) -> None:
        """One Adam step with ``grad`` (packed, fp32, on this device) and ``group``'s hyperparameters."""
        self.step += 1
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        corrected = group.get("bias_correction", True)
        bias1 = 1.0 - beta1**self.step if corrected else 1.0
        bias2 = 1.0 - beta2**self.step if corrected else 1.0
        if decay and not rule.decoupled:
            grad = grad.add(self.master, alpha=decay)
        self.exp_avg.lerp_(grad, 1.0 - beta1)  # m + (1 - b1)(g - m), or g - b1 (g - m) for b1 < 0.5, as the kernel
        self.exp_avg_sq.mul_(beta2).add_(grad * grad, alpha=1.0 - beta2)
        denom = self.exp_avg_sq.sqrt().div_(math.sqrt(bias2)).add_(eps)
        if decay and rule.decoupled:
            self.master.mul_(1.0 - lr * decay)
        self.master.add_(self.exp_avg / denom, alpha=-lr / bias1)
