"""``DeepSpeedCPUAdam``: Adam/AdamW on CPU tensors for ZeRO optimizer offload.

Uses the SIMD + OpenMP kernel from ``CPUAdamBuilder().load()`` when a C++ compiler and ninja are
present; otherwise (or for params off the CPU) a pure-torch implementation, with one log line.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch

from deepspeed._foundation.logging import logger
from deepspeed.ops._optimizer_base import StatefulOptimizer, StepItem, group_items
from deepspeed.ops._torch_optim import AdamMode, AdamStep, adam_update

_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ids = itertools.count()
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def _fits(copy_out: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``copy_out`` can receive ``param``'s rounded values."""
    return (
        copy_out.device.type == "cpu"
        and copy_out.is_contiguous()
        and copy_out.numel() == param.numel()
        and copy_out.dtype in _NATIVE_DTYPES
    )


def _load_kernel() -> ModuleType | None:
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builder = CPUAdamBuilder()
    if not builder.is_compatible():
        _log_once(f"DeepSpeedCPUAdam: using the torch implementation ({builder.error_log})")
        return None
    try:
        return builder.load()
    except Exception as err:  # noqa: BLE001 (keep training possible when the build breaks)
        _log_once(f"DeepSpeedCPUAdam: using the torch implementation (build failed: {err})")
        return None


@dataclasses.dataclass(frozen=True)
class CPUAdamPolicy:
    """Fixed choices of one DeepSpeedCPUAdam."""

    mode: AdamMode
    fp32_optimizer_states: bool


class DeepSpeedCPUAdam(StatefulOptimizer):
    """Adam (``adamw_mode=False``, L2 decay) or AdamW (default) over CPU params; upstream signature."""

    STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdam does not support amsgrad=True")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "amsgrad": amsgrad,
        }
        super().__init__(model_params, defaults)
        self.policy = CPUAdamPolicy(AdamMode.DECOUPLED if adamw_mode else AdamMode.L2, fp32_optimizer_states)
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        self.opt_id = next(_ids)
        self.ds_opt_adam = _load_kernel()
        if self.ds_opt_adam is not None:
            self.ds_opt_adam.create_adam(self.opt_id, lr, betas[0], betas[1], eps, weight_decay, adamw_mode, False)

    def __del__(self) -> None:
        kernel = getattr(self, "ds_opt_adam", None)
        if kernel is not None:
            kernel.destroy_adam(self.opt_id)

    def step_subgroup(self, subgroup_id: int, closure: Callable[[], Any] | None = None) -> Any:
        """Update only ``param_groups[subgroup_id]``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[subgroup_id]
        with torch.no_grad():
            self._step_group(group, self._prepare(group))
        return loss

    @torch.no_grad()
    def step_scaled(self, grad: torch.Tensor, grad_scale: float = 1.0, copy_out: torch.Tensor | None = None) -> bool:
        """One step of the single parameter of the single group with gradient ``grad``, kept in its own dtype and
        multiplied by ``grad_scale`` as the kernel loads it; with ``copy_out``, the updated values rounded into it
        as well.

        With an fp32 parameter and fp32 states: the same result, bit for bit, as converting the gradient to fp32,
        multiplying it by ``grad_scale``, :meth:`step` and ``copy_out.copy_(param)``, in one pass over memory.
        With a bf16 parameter and bf16 states (16-bit offloaded states; a bf16 or fp32 gradient, a bf16
        ``copy_out``): that fp32 computation on the same values, each result rounded once to bf16; the gradient is
        scaled in fp32, not rounded to bf16 first as :meth:`step` on a scaled bf16 gradient would. Returns
        ``False``, changing nothing, where the kernel cannot do it (no native kernel, a parameter off the host,
        other dtypes): the caller then takes that longer route.
        """
        if self.ds_opt_adam is None or len(self.param_groups) != 1 or len(self.param_groups[0]["params"]) != 1:
            return False
        group = self.param_groups[0]
        (p,) = group["params"]
        grad_dtypes = _NATIVE_DTYPES if p.dtype == torch.float32 else (torch.bfloat16, torch.float32)
        if (
            grad.numel() != p.numel()
            or grad.device.type != "cpu"
            or p.device.type != "cpu"
            or p.dtype not in (torch.float32, torch.bfloat16)
            or self._state_dtype(p) != p.dtype
            or grad.dtype not in grad_dtypes
            or (copy_out is not None and p.dtype == torch.bfloat16 and copy_out.dtype != torch.bfloat16)
        ):
            return False  # (the kernel's bf16 form writes a bf16 copy only)
        state = self.state[p]
        if state and any(state[key].dtype != p.dtype for key in self.STATE_KEYS):
            return False
        if copy_out is not None and not _fits(copy_out, p):
            raise ValueError(
                f"step_scaled: copy_out must be a contiguous CPU tensor of {p.numel()} elements in float32, bfloat16 "
                f"or float16; got {tuple(copy_out.shape)} {copy_out.dtype} on {copy_out.device}"
            )
        if not state:
            state["step"] = 0
            for key in self.STATE_KEYS:
                state[key] = torch.zeros_like(p, dtype=p.dtype, memory_format=torch.contiguous_format)
        state["step"] = int(state["step"]) + 1
        self.ds_opt_adam.adam_update_scaled(
            *self._kernel_scalars(group, state["step"]),
            p.data,
            grad.contiguous(),
            state["exp_avg"],
            state["exp_avg_sq"],
            float(grad_scale),
            copy_out,
        )
        return True

    def _kernel_scalars(self, group: dict[str, Any], step: int) -> tuple:
        """The kernel's leading arguments: optimizer id, step, lr, betas, eps, weight decay, bias correction."""
        hp = self._hyper(group, step)
        return (self.opt_id, hp.step, hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.bias_correction)

    def _hyper(self, group: dict[str, Any], step: int) -> AdamStep:
        beta1, beta2 = group["betas"]
        return AdamStep(
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            self.policy.mode,
            group["bias_correction"],
            step,
        )

    def _step_group(self, group: dict[str, Any], items: list[StepItem]) -> None:
        fallback = []
        for item in items:
            p, grad, state = item
            if self.ds_opt_adam is None or p.device.type != "cpu" or p.dtype not in _NATIVE_DTYPES:
                fallback.append(item)
                continue
            self.ds_opt_adam.adam_update(
                *self._kernel_scalars(group, state["step"]),
                p.data,
                grad,
                state["exp_avg"],
                state["exp_avg_sq"],
            )
        for (_, _, _, step), members in group_items(fallback).items():
            adam_update(
                [m[0] for m in members],
                [m[1] for m in members],
                [m[2]["exp_avg"] for m in members],
                [m[2]["exp_avg_sq"] for m in members],
                self._hyper(group, step),
            )
