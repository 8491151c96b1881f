"""Low-precision casts, fp32 master weights and overflow detection for the non-ZeRO path.

ZeRO stages keep their own flat fp32 partitions; this module serves stage 0, where every rank holds
whole parameters and the optimizer steps on per-parameter fp32 master copies.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from deepspeed._core.config.plan import PrecisionPolicy


def cast_module_params(module: torch.nn.Module, policy: PrecisionPolicy) -> None:
    """Cast floating parameters to the working dtype; buffers keep their dtype unless the policy names one.

    Only parameters are cast (upstream's behaviour since 0.19.2): norms' running statistics and
    similar buffers stay in the dtype the user loaded them in.
    """
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != policy.param_dtype:
            param.data = param.data.to(policy.param_dtype)
    cast_buffers(module, policy)


def cast_buffers(module: torch.nn.Module, policy: PrecisionPolicy) -> None:
    """Cast floating buffers to the policy's buffer dtype, when it names one."""
    if policy.buffer_dtype is not None:
        for buf_owner in module.modules():
            for name, buf in buf_owner.named_buffers(recurse=False):
                if buf is not None and buf.is_floating_point():
                    setattr(buf_owner, name, buf.to(policy.buffer_dtype))


def cast_inputs(value: Any, dtype: torch.dtype) -> Any:
    """Recursively cast floating tensors in ``value`` (tuples, lists, dicts) to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(cast_inputs(v, dtype) for v in value)
    if isinstance(value, list):
        return [cast_inputs(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: cast_inputs(v, dtype) for k, v in value.items()}
    return value


def has_inf_or_nan(tensors: Iterable[torch.Tensor]) -> bool:
    """True if any element of any tensor is inf or nan (one host sync for the whole set)."""
    flags = [torch.logical_not(torch.isfinite(t)).any() for t in tensors if t is not None and t.numel()]
    if not flags:
        return False
    return bool(torch.stack(flags).any().item())


class MasterWeights:
    """fp32 master copies of low-precision parameters, installed in the optimizer's param groups.

    The optimizer is handed the masters, so its state (moments) is fp32 too. After each step the
    masters are copied back into the working parameters.

    Args:
        optimizer: a freshly built optimizer whose groups hold the working parameters.
        master_dtype: dtype of the masters (fp32).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, master_dtype: torch.dtype) -> None:
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        for group in optimizer.param_groups:
            masters = []
            for param in group["params"]:
                master = torch.nn.Parameter(param.detach().to(master_dtype).clone(), requires_grad=param.requires_grad)
                self.pairs.append((param, master))
                masters.append(master)
            group["params"] = masters

    def working_params(self) -> list[torch.nn.Parameter]:
        """The model's own (low-precision) parameters, in optimizer order."""
        return [p for p, _ in self.pairs]

    def grads_to_masters(self, scale: float) -> None:
        """Move working gradients into the masters (fp32), dividing by ``scale``; frees working grads."""
        for param, master in self.pairs:
            if param.grad is None:
                master.grad = None
                continue
            master.grad = param.grad.to(master.dtype)
            if scale != 1.0:
                master.grad.mul_(1.0 / scale)
            param.grad = None

    def masters_to_working(self) -> None:
        """Copy updated master values back into the working parameters."""
        with torch.no_grad():
            for param, master in self.pairs:
                param.copy_(master)

    def drop_master_grads(self) -> None:
        """Release the fp32 gradients once the step has consumed them."""
        for _, master in self.pairs:
            master.grad = None
