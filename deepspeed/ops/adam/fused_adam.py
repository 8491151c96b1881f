"""``FusedAdam``: multi-tensor Adam/AdamW for GPU training.

CUDA params use the fused kernel from ``FusedAdamBuilder`` (JIT-built on the first step) when it
can be built; otherwise, and for params on other devices, a ``torch._foreach_*`` implementation
runs, with one log line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch

from deepspeed._foundation.logging import logger
from deepspeed.ops._optimizer_base import StatefulOptimizer, StepItem, group_items
from deepspeed.ops._torch_optim import AdamMode, AdamStep, adam_update

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_kernel_state: dict[str, Any] = {"tried": False, "module": None}
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def _load_kernel() -> ModuleType | None:
    if not _kernel_state["tried"]:
        _kernel_state["tried"] = True
        from deepspeed.ops.op_builder import FusedAdamBuilder

        builder = FusedAdamBuilder()
        if not builder.is_compatible():
            _log_once(f"FusedAdam: using the torch foreach implementation ({builder.error_log})")
            return None
        try:
            _kernel_state["module"] = builder.load()
        except Exception as err:  # noqa: BLE001 (keep training possible when the build breaks)
            _log_once(f"FusedAdam: using the torch foreach implementation (build failed: {err})")
    return _kernel_state["module"]


class FusedAdam(StatefulOptimizer):
    """Adam (``adam_w_mode=False``, L2 decay) or AdamW (default); upstream signature. States share the param dtype."""

    STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (amsgrad=True)")
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self._noop_flags: dict[torch.device, torch.Tensor] = {}

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients; ``set_grad_none`` (constructor) decides unless ``set_to_none`` is given."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: Any = None,
        grad_norms: Any = None,
        grad_scaler: Any = None,
    ) -> Any:
        """One step over every group. The legacy ``grads``/``output_params``/``scale`` arguments are rejected."""
        if any(arg is not None for arg in (grads, output_params, scale, grad_norms, grad_scaler)):
            raise RuntimeError("FusedAdam.step only takes a closure; the legacy arguments are not supported")
        return super().step(closure)

    def skips_on_found_inf(self) -> bool:
        """Whether :meth:`step` honours a device ``found_inf`` flag (set as an attribute, 1 skips the update, as
        torch's fused optimizers take it): every parameter is a CUDA tensor the fused kernel steps. The kernel
        then skips on the device; the per-parameter step counts stay on the host and are advanced regardless, so
        the caller that set the flag puts them back when it learns the step was skipped."""
        params = [p for group in self.param_groups for p in group["params"]]
        return (
            bool(params)
            and all(p.device.type == "cuda" and p.dtype in _KERNEL_DTYPES for p in params)
            and _load_kernel() is not None
        )

    def _noop(self, device: torch.device) -> torch.Tensor:
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:  # read by the kernel on the device: no host synchronisation
            return found_inf.to(device=device, dtype=torch.int32).reshape(1)
        if device not in self._noop_flags:
            self._noop_flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return self._noop_flags[device]

    def _step_group(self, group: dict[str, Any], items: list[StepItem]) -> None:
        beta1, beta2 = group["betas"]
        mode = AdamMode.DECOUPLED if self.adam_w_mode else AdamMode.L2
        for (device, dtype, _, step), members in group_items(items).items():
            ps, gs = [m[0] for m in members], [m[1] for m in members]
            ms, vs = [m[2]["exp_avg"] for m in members], [m[2]["exp_avg_sq"] for m in members]
            kernel = _load_kernel() if device.type == "cuda" and dtype in _KERNEL_DTYPES else None
            if kernel is None:
                if getattr(self, "found_inf", None) is not None:
                    raise RuntimeError("FusedAdam: a found_inf flag needs the fused CUDA kernel (skips_on_found_inf)")
                _log_once(f"FusedAdam: torch foreach step for {dtype} params on {device.type}")
                hp = AdamStep(
                    group["lr"], beta1, beta2, group["eps"], group["weight_decay"], mode, group["bias_correction"], step
                )
                adam_update(ps, gs, ms, vs, hp)
                continue
            kernel.multi_tensor_adam(
                65536,
                self._noop(device),
                [gs, ps, ms, vs],
                group["lr"],
                beta1,
                beta2,
                group["eps"],
                step,
                self.adam_w_mode,
                1 if group["bias_correction"] else 0,
                group["weight_decay"],
            )
