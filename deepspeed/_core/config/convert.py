"""The one conversion from validated config blocks to the frozen run plan (``plan.py``).

Every place that needs a plan calls this module:

* ``DeepSpeedConfig.plan`` (the engine path): :func:`run_plan` on the validated root model;
* the façades that integrations construct without the engine, ``DeepSpeedZeroOptimizer`` and
  ``DeepSpeedZeRoOffload``: they first turn upstream's keyword arguments into the same validated
  ``zero_optimization`` block (``DeepSpeedZeroConfig``), then call :func:`zero_plan`, :func:`stage3_policy`,
  :func:`offload_policy`, :func:`precision_policy` and :func:`grad_policy` here, so the same settings give the same
  plan on both paths.

Fields that copy a key are filled by :func:`fill` from their metadata ([Note: plan keys]); only the values derived
from several keys (the working dtypes, the batch triangle, the timers switch) are computed by the functions below.
Keys that change nothing in this package have no plan field; what users are told about them is the config surface
(``surface.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING
from typing import Any, TypeVar

import torch
from pydantic import BaseModel

from deepspeed._core.config.base import submodel
from deepspeed._core.config.plan import (
    CONVERT,
    DERIVED,
    KEY,
    NESTED,
    BatchPlan,
    GradPolicy,
    LossScalePolicy,
    OffloadPolicy,
    PrecisionPolicy,
    ReduceOp,
    RunPlan,
    Stage3Policy,
    ZeroPlan,
)
from deepspeed._core.config.precision import DeepSpeedFP16Config, to_torch_dtype
from deepspeed._core.config.schema import RootConfig, mode_dtype
from deepspeed._core.config.zero import DeepSpeedZeroConfig

__all__ = [
    "fill",
    "run_plan",
    "zero_plan",
    "stage3_policy",
    "offload_policy",
    "precision_policy",
    "grad_policy",
    "loss_scale_policy",
]

_Policy = TypeVar("_Policy")


def read_key(model: BaseModel | None, path: str) -> Any:
    """The validated value at the dotted ``path`` below ``model`` (``""``: the model itself); ``None`` where a block
    on the way is absent."""
    value: Any = model
    for part in filter(None, path.split(".")):
        if value is None:
            return None
        value = getattr(value, part)
    return value


def fill(policy: type[_Policy], model: BaseModel | None, **computed: Any) -> _Policy:
    """``policy`` filled from the validated block ``model`` through its fields' metadata ([Note: plan keys]).

    A ``key`` field takes the key's value (converted); a ``nested`` field is filled from its sub-block, or keeps its
    default when the sub-block is absent; a ``derived`` field must be passed in ``computed`` (as may any field).
    A key the block does not model (a policy shared by blocks with different keys) keeps the field's default.
    ``model`` ``None`` (an absent optional block) gives the policy's defaults.

    Raises:
        TypeError: a derived field is not in ``computed``.
    """
    if model is None:
        return policy(**computed)
    values: dict[str, Any] = {}
    for item in dataclasses.fields(policy):  # type: ignore[arg-type]  # plan policies are dataclasses
        meta = item.metadata
        if item.name in computed:
            values[item.name] = computed[item.name]
        elif KEY in meta and meta[KEY].split(".")[0] in type(model).model_fields:
            value = read_key(model, meta[KEY])
            values[item.name] = meta[CONVERT](value) if meta[CONVERT] is not None else value
        elif NESTED in meta:
            block, nested_policy = meta[NESTED]
            sub = read_key(model, block)
            if sub is not None or item.default is MISSING:
                values[item.name] = fill(nested_policy, sub)
        elif DERIVED in meta:
            raise TypeError(f"{policy.__name__}.{item.name} is derived from {meta[DERIVED]}; pass it to fill()")
    return policy(**values)


def loss_scale_policy(fp16: DeepSpeedFP16Config) -> LossScalePolicy | None:
    """The fp16 block's loss scaling, or ``None`` when fp16 is off."""
    return fill(LossScalePolicy, fp16) if fp16.enabled else None


def precision_policy(
    param_dtype: torch.dtype,
    *,
    grad_accum_dtype: torch.dtype | None = None,
    comm_dtype: torch.dtype | None = None,
    buffer_dtype: torch.dtype | None = None,
    loss_scale: LossScalePolicy | None = None,
    auto_cast: bool = False,
    fp16_master_weights_and_grads: bool = False,
    bf16_master_weights_and_grads: bool = False,
    check_grad_overflow: bool = True,
) -> PrecisionPolicy:
    """Working dtypes from the working parameter dtype and the precision settings.

    Unset accumulation and communication dtypes follow ``param_dtype``. Master weights are fp32 unless the master
    flag of the working 16-bit dtype is set. ``check_grad_overflow`` matters under bf16 only (fp16 always checks,
    fp32 never), so it is recorded as true elsewhere.
    """
    low_precision_master = (param_dtype == torch.float16 and fp16_master_weights_and_grads) or (
        param_dtype == torch.bfloat16 and bf16_master_weights_and_grads
    )
    return PrecisionPolicy(
        param_dtype=param_dtype,
        grad_accum_dtype=grad_accum_dtype or param_dtype,
        comm_dtype=comm_dtype or param_dtype,
        buffer_dtype=buffer_dtype,
        loss_scale=loss_scale,
        auto_cast=auto_cast,
        master_dtype=param_dtype if low_precision_master else torch.float32,
        check_grad_overflow=bool(check_grad_overflow) if param_dtype == torch.bfloat16 else True,
    )


def grad_policy(*, clip_norm: float, prescale: bool, predivide_factor: float, reduce_op: ReduceOp | str) -> GradPolicy:
    """Gradient clipping, pre-division and reduction op, from upstream's ZeRO-optimizer keyword arguments."""
    return GradPolicy(
        clip_norm=float(clip_norm),
        prescale=bool(prescale),
        predivide_factor=float(predivide_factor),
        reduce_op=ReduceOp(reduce_op),
    )


def offload_policy(block: BaseModel | None) -> OffloadPolicy:
    """One validated offload block (``offload_param`` / ``offload_optimizer``), or ``None`` for no offload."""
    return fill(OffloadPolicy, block)


def stage3_policy(zero: DeepSpeedZeroConfig) -> Stage3Policy:
    """The ZeRO-3 fetch/release knobs of a validated ``zero_optimization`` block."""
    return fill(Stage3Policy, zero)


def zero_plan(zero: DeepSpeedZeroConfig) -> ZeroPlan:
    """Everything the ZeRO optimizers read, from a validated ``zero_optimization`` block."""
    return fill(ZeroPlan, zero)


def _root_precision(root: RootConfig) -> PrecisionPolicy:
    return precision_policy(
        mode_dtype(root),
        grad_accum_dtype=to_torch_dtype(root.data_types.grad_accum_dtype),
        comm_dtype=to_torch_dtype(root.communication_data_type),
        buffer_dtype=to_torch_dtype(root.data_types.buffer_dtype),
        loss_scale=loss_scale_policy(root.fp16),
        auto_cast=root.fp16.enabled and root.fp16.auto_cast,
        fp16_master_weights_and_grads=root.fp16.fp16_master_weights_and_grads,
        bf16_master_weights_and_grads=root.bf16.bf16_master_weights_and_grads,
        check_grad_overflow=root.bf16.check_grad_overflow,
    )


def run_plan(root: RootConfig, batch: BatchPlan) -> RunPlan:
    """The frozen :class:`RunPlan` of a validated root config and its resolved batch triangle."""
    return fill(
        RunPlan,
        root,
        batch=batch,
        precision=_root_precision(root),
        wall_clock_breakdown=root.wall_clock_breakdown or root.flops_profiler.enabled,
    )


@dataclasses.dataclass(frozen=True)
class PlanKey:
    """Where one plan field comes from: ``plan_path`` (attributes below ``RunPlan``) and the dotted config keys."""

    plan_path: str
    config_keys: tuple[str, ...]
    derived: bool


def plan_keys(
    policy: type = RunPlan, model: type[BaseModel] | None = RootConfig, plan_prefix: str = "", key_prefix: str = ""
) -> list[PlanKey]:
    """Every plan field below ``policy`` with the config keys it is filled or derived from ([Note: plan keys]).

    A ``key`` field of a policy shared by blocks (``OffloadPolicy``) is listed only where its block models the key.
    """
    found: list[PlanKey] = []
    for item in dataclasses.fields(policy):
        meta, plan_path = item.metadata, plan_prefix + item.name
        if KEY in meta:
            if model is not None and meta[KEY].split(".")[0] in model.model_fields:
                found.append(PlanKey(plan_path, (key_prefix + meta[KEY],), derived=False))
        elif DERIVED in meta:
            found.append(PlanKey(plan_path, tuple(key_prefix + path for path in meta[DERIVED]), derived=True))
        elif NESTED in meta:
            block, nested_policy = meta[NESTED]
            sub = model if not block or model is None else _block_model(model, block)
            sub_prefix = f"{key_prefix}{block}." if block else key_prefix
            found.extend(plan_keys(nested_policy, sub, f"{plan_path}.", sub_prefix))
        else:
            found.append(PlanKey(plan_path, (), derived=True))  # no metadata: reported by the plan-keys test
    return found


def _block_model(model: type[BaseModel], block: str) -> type[BaseModel] | None:
    info = model.model_fields.get(block)
    return submodel(info.annotation) if info is not None else None
