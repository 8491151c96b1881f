"""Pure-torch optimizer math shared by the ops' fallbacks and the torch-only optimizers.

Every function updates lists of same-dtype tensors in place with ``torch._foreach_*`` ops and does
its arithmetic in the dtype of the optimizer states; low-precision params are upcast, updated and
written back. The operation order follows ``torch.optim.Adam/AdamW`` so results agree closely.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch

# What the ``torch._foreach_*`` ops accept (their stubs take lists or tuples, not any sequence).
TensorList = list[torch.Tensor] | tuple[torch.Tensor, ...]


class AdamMode(enum.Enum):
    """How weight decay enters Adam."""

    L2 = 0  # Adam: weight_decay * param is added to the gradient
    DECOUPLED = 1  # AdamW: param is scaled by (1 - lr * weight_decay)


@dataclasses.dataclass(frozen=True)
class AdamStep:
    """Scalars of one Adam step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    mode: AdamMode
    bias_correction: bool
    step: int

    @property
    def step_size(self) -> float:
        """``lr`` divided by the first-moment bias correction."""
        return self.lr / (1.0 - self.beta1**self.step if self.bias_correction else 1.0)

    @property
    def bias_corr2_sqrt(self) -> float:
        """Square root of the second-moment bias correction."""
        return math.sqrt(1.0 - self.beta2**self.step) if self.bias_correction else 1.0


def _as_state_dtype(tensors: TensorList, like: torch.Tensor) -> TensorList:
    return [t if t.dtype == like.dtype else t.to(like.dtype) for t in tensors]


def adam_update(
    params: TensorList, grads: TensorList, exp_avgs: TensorList, exp_avg_sqs: TensorList, hp: AdamStep
) -> None:
    """One Adam/AdamW step over same-dtype lists, in place."""
    if not params:
        return
    work = _as_state_dtype(params, exp_avgs[0])
    g = _as_state_dtype(grads, exp_avgs[0])
    if hp.mode is AdamMode.L2 and hp.weight_decay != 0:
        g = torch._foreach_add(g, work, alpha=hp.weight_decay)
    torch._foreach_lerp_(exp_avgs, g, 1.0 - hp.beta1)
    torch._foreach_mul_(exp_avg_sqs, hp.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1.0 - hp.beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, hp.bias_corr2_sqrt)
    torch._foreach_add_(denom, hp.eps)
    if hp.mode is AdamMode.DECOUPLED and hp.weight_decay != 0:
        torch._foreach_mul_(work, 1.0 - hp.lr * hp.weight_decay)
    torch._foreach_addcdiv_(work, exp_avgs, denom, value=-hp.step_size)
    _write_back(params, work)


def _write_back(params: TensorList, work: TensorList) -> None:
    changed = [(p, w) for p, w in zip(params, work, strict=True) if p is not w]
    if changed:
        torch._foreach_copy_([p for p, _ in changed], [w for _, w in changed])


def adagrad_update(
    params: TensorList, grads: TensorList, sums: TensorList, lr: float, eps: float, weight_decay: float
) -> None:
    """One Adagrad step (no lr decay), in place, matching ``torch.optim.Adagrad``."""
    if not params:
        return
    work = _as_state_dtype(params, sums[0])
    g = _as_state_dtype(grads, sums[0])
    if weight_decay != 0:
        g = torch._foreach_add(g, work, alpha=weight_decay)
    torch._foreach_addcmul_(sums, g, g, value=1.0)
    std = torch._foreach_sqrt(sums)
    torch._foreach_add_(std, eps)
    torch._foreach_addcdiv_(work, g, std, value=-lr)
    _write_back(params, work)


def lion_update(
    params: TensorList,
    grads: TensorList,
    exp_avgs: TensorList,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """One Lion step, in place: ``p -= lr * (sign(lerp(m, g, 1 - beta1)) + wd * p)``; ``m = lerp(m, g, 1 - beta2)``."""
    if not params:
        return
    work = _as_state_dtype(params, exp_avgs[0])
    g = _as_state_dtype(grads, exp_avgs[0])
    if weight_decay != 0:
        torch._foreach_mul_(work, 1.0 - lr * weight_decay)
    update = torch._foreach_lerp(exp_avgs, g, 1.0 - beta1)
    torch._foreach_sign_(update)
    torch._foreach_add_(work, update, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, g, 1.0 - beta2)
    _write_back(params, work)
