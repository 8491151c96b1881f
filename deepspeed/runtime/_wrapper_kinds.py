"""Which of upstream's engine-optimizer wrappers an engine optimizer here stands for.

Upstream wraps the client optimizer in a different class per configuration: ``BF16_Optimizer`` for bf16 weights
with fp32 gradient accumulation under ZeRO stage 0 or 1 (stage 1 without optimizer offload), ``FP16_Optimizer``
for fp16 (or bf16 accumulating in bf16) without ZeRO when the client optimizer is ``FusedAdam``, and
``FP16_UnfusedOptimizer`` for the same without ZeRO and any other optimizer. Here every stage's optimizer derives
from the core's ``EngineOptimizer``; these classes answer ``isinstance`` for the optimizers whose configuration
upstream would have wrapped in them, so that code branching on the wrapper's type takes the same branch. They are
not constructed directly (``deepspeed.initialize`` builds the engine optimizer from the config).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

from deepspeed._core.config.plan import OffloadDevice, RunPlan
from deepspeed._core.optim.base import EngineOptimizer


def _plan(obj: Any) -> RunPlan | None:
    plan = getattr(obj, "plan", None) if isinstance(obj, EngineOptimizer) else None
    return plan if isinstance(plan, RunPlan) else None


def is_bf16_optimizer(obj: Any) -> bool:
    """bf16 weights, fp32 gradient accumulation, ZeRO stage 0, or 1 without optimizer offload."""
    plan = _plan(obj)
    if plan is None or not plan.precision.bf16 or plan.precision.grad_accum_dtype != torch.float32:
        return False
    offloaded = plan.zero.offload_optimizer.device is not OffloadDevice.NONE
    return plan.zero.stage == 0 or (plan.zero.stage == 1 and not offloaded)


def _fp16_family(obj: Any) -> bool:
    """No ZeRO, 16-bit weights accumulating gradients in their own dtype."""
    plan = _plan(obj)
    if plan is None or plan.zero.stage != 0:
        return False
    working = plan.precision.param_dtype
    return working in (torch.float16, torch.bfloat16) and plan.precision.grad_accum_dtype == working


def _fused(obj: Any) -> bool:
    from deepspeed.ops.adam import FusedAdam

    return isinstance(getattr(obj, "optimizer", None), FusedAdam)


def is_fp16_fused_optimizer(obj: Any) -> bool:
    """What upstream wraps in ``FP16_Optimizer``: the 16-bit family without ZeRO over ``FusedAdam``."""
    return _fp16_family(obj) and _fused(obj)


def is_fp16_unfused_optimizer(obj: Any) -> bool:
    """What upstream wraps in ``FP16_UnfusedOptimizer``: the 16-bit family without ZeRO over other optimizers."""
    return _fp16_family(obj) and not _fused(obj)


class UpstreamWrapperType(type):
    """Metaclass: ``isinstance(x, C)`` asks ``C.stands_for(x)`` besides the ordinary subclass check."""

    stands_for: Callable[[Any], bool]

    def __instancecheck__(cls, instance: Any) -> bool:
        return super().__instancecheck__(instance) or cls.stands_for(instance)


def refuse_construction(name: str) -> NoReturn:
    """The error for building one of upstream's wrappers by hand."""
    raise NotImplementedError(
        f"{name} is not constructed directly in deepspeed-lean: pass the client optimizer and the config "
        "(fp16/bf16 block, data_types.grad_accum_dtype, zero_optimization.stage) to deepspeed.initialize, whose "
        f"engine optimizer answers isinstance(..., {name}) for the configurations upstream wraps in it "
        "(docs/compat.md)"
    )
