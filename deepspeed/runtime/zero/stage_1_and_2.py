"""``DeepSpeedZeroOptimizer``: upstream's ZeRO-1/2 optimizer constructor over the lean core.

The engine builds the core optimizer (:class:`deepspeed._core.optim.stage12.ZeroOptimizer`) straight
from its run plan. This façade exists for code that constructs the optimizer itself with upstream's
keyword list: the ZeRO keywords become the validated ``zero_optimization`` block they stand for, and that block,
the working dtype and the gradient keywords go through the one config-to-plan conversion
(``deepspeed/_core/config/convert.py``) into a frozen :class:`~deepspeed._core.config.plan.RunPlan`; everything else
is the core class. Stage 1 is ``partition_grads=False``, stage 2 ``partition_grads=True``, as upstream.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from deepspeed import comm as dist
from deepspeed._core.config.convert import grad_policy, precision_policy, zero_plan
from deepspeed._core.config.enforce import enforce_block_surface
from deepspeed._core.config.plan import BatchPlan, LossScalePolicy, OffloadDevice, PrecisionPolicy, ReduceOp, RunPlan
from deepspeed._core.config.zero import DeepSpeedZeroConfig
from deepspeed._core.moe.params import ExpertGroup, check_zero_param_groups, is_moe_param_group
from deepspeed._core.optim.hp_mapping import attach_hp_mapping
from deepspeed._core.optim.loss_scaling import (
    CreateLossScaler,
    LossScalerBase,
    from_policy,
)
from deepspeed._core.optim.nvme import NVME_AS_CPU_WARNING
from deepspeed._core.optim.sharded import (
    OPTIMIZER_ALLGATHER_TIMER,
    OPTIMIZER_GRADIENTS_TIMER,
    OPTIMIZER_STEP_TIMER,
    OPTIMIZER_TIMERS,
)
from deepspeed._core.optim.stage12 import ZeroOptimizer
from deepspeed._foundation.logging import logger

__all__ = [
    "OPTIMIZER_ALLGATHER_TIMER",
    "OPTIMIZER_GRADIENTS_TIMER",
    "OPTIMIZER_STEP_TIMER",
    "OPTIMIZER_TIMERS",
    "DeepSpeedZeroOptimizer",
]


def _unsupported(argument: str, value: Any, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"DeepSpeedZeroOptimizer({argument}={value!r}) is not supported by deepspeed-lean: {why}"
    )


def _working_dtype(optimizer: torch.optim.Optimizer) -> torch.dtype:
    """dtype of the parameters handed to the optimizer (the model's working precision)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.dtype
    raise ValueError("DeepSpeedZeroOptimizer(init_optimizer=...) has no parameters")


def _loss_scaler(
    dtype: torch.dtype, static_loss_scale: float, dynamic_loss_scale: bool, dynamic_loss_args: Mapping[str, Any] | None
) -> LossScalerBase | None:
    """The fp16 loss scaler (None for bf16/fp32, which the core runs unscaled)."""
    if dtype != torch.float16:
        return None
    if dynamic_loss_scale and dynamic_loss_args is None:
        return from_policy(LossScalePolicy())
    return CreateLossScaler(dtype, static_loss_scale, dynamic_loss_scale, dynamic_loss_args)


def _precision(dtype: torch.dtype, kw: Mapping[str, Any], scaler: LossScalerBase | None) -> PrecisionPolicy:
    scale = None
    if scaler is not None:
        scale = LossScalePolicy(dynamic=bool(getattr(scaler, "dynamic", False)), static_scale=float(scaler.cur_scale))
    return precision_policy(
        dtype,
        grad_accum_dtype=kw["gradient_accumulation_dtype"],
        comm_dtype=kw["communication_data_type"],
        loss_scale=scale,
        fp16_master_weights_and_grads=bool(kw["fp16_master_weights_and_gradients"]),
        bf16_master_weights_and_grads=bool(kw["bf16_master_weights_and_gradients"]),
        check_grad_overflow=bool(kw["check_grad_overflow"]),
    )


def _zero_block(kw: Mapping[str, Any]) -> DeepSpeedZeroConfig:
    """The upstream keywords as the validated ``zero_optimization`` block they stand for (same checks and
    no-effect warnings as in a config)."""
    block = DeepSpeedZeroConfig(
        stage=2 if kw["partition_grads"] else 1,
        reduce_bucket_size=int(kw["reduce_bucket_size"]),
        allgather_bucket_size=int(kw["allgather_bucket_size"]),
        overlap_comm=bool(kw["overlap_comm"]),
        reduce_scatter=bool(kw["reduce_scatter"]),
        contiguous_gradients=bool(kw["contiguous_gradients"]),
        use_multi_rank_bucket_allreduce=bool(kw["use_multi_rank_bucket_allreduce"]),
        round_robin_gradients=bool(kw["round_robin_gradients"]),
        ignore_unused_parameters=bool(kw["ignore_unused_parameters"]),
        elastic_checkpoint=bool(kw["elastic_checkpoint"]),
        offload_optimizer=kw["offload_optimizer_config"],
    )
    offload = block.offload_optimizer
    if offload is not None and OffloadDevice(offload.device) is OffloadDevice.NVME:
        logger.warning(NVME_AS_CPU_WARNING.format(stage=int(block.stage) if int(block.stage) in (1, 2) else "1/2"))
    enforce_block_surface(block, "zero_optimization.")
    return block


def _check_supported(kw: Mapping[str, Any]) -> None:
    """Reject the upstream features this build does not implement, naming the argument."""
    if kw["zenflow_config"] is not None:
        raise _unsupported("zenflow_config", kw["zenflow_config"], "ZenFlow is not implemented")
    if kw["bf16_master_weights_and_gradients"] and not kw["bf16_optimizer_states"]:
        # Optimizer states follow the master dtype, so bf16 masters come with bf16 states.
        raise _unsupported(
            "bf16_master_weights_and_gradients",
            True,
            "bf16 masters with fp32 optimizer states are not implemented; pass bf16_optimizer_states=True as well",
        )


def _expert_groups(init_optimizer: torch.optim.Optimizer, kw: Mapping[str, Any]) -> dict[str, ExpertGroup]:
    """``has_moe_layers=True``: the expert groups, from upstream's ``{name: group}`` dictionaries."""
    if not kw["has_moe_layers"]:
        return {}
    ep, edp = kw["expert_parallel_group"], kw["expert_data_parallel_group"]
    if not isinstance(ep, Mapping) or not isinstance(edp, Mapping) or set(ep) != set(edp):
        raise ValueError(
            "DeepSpeedZeroOptimizer(has_moe_layers=True) needs expert_parallel_group and expert_data_parallel_group "
            "as {name: group} dicts with the same names (deepspeed.utils.groups._get_expert_parallel_group_dict() "
            "and _get_expert_data_parallel_group_dict())"
        )
    if not any(is_moe_param_group(g) for g in init_optimizer.param_groups):
        raise ValueError(
            "DeepSpeedZeroOptimizer(has_moe_layers=True): no optimizer parameter group is marked 'moe'; build the "
            "optimizer over deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(...)"
        )
    check_zero_param_groups(init_optimizer.param_groups, 2 if kw["partition_grads"] else 1)
    return {name: ExpertGroup(name, ep[name], edp[name]) for name in sorted(ep)}


def build_plan(init_optimizer: torch.optim.Optimizer, dp_group: Any, kw: Mapping[str, Any]) -> tuple[RunPlan, Any]:
    """Convert the upstream keyword arguments into ``(RunPlan, loss_scaler)``, once.

    The batch entry only records ``gradient_accumulation_steps`` and the data-parallel size (the
    optimizer never sees micro-batches); the micro batch is recorded as 1.
    """
    _check_supported(kw)
    dtype = _working_dtype(init_optimizer)
    scaler = _loss_scaler(dtype, kw["static_loss_scale"], kw["dynamic_loss_scale"], kw["dynamic_loss_args"])
    world = dist.get_world_size(group=dp_group)
    gas = int(kw["gradient_accumulation_steps"])
    grads = grad_policy(
        clip_norm=kw["clip_grad"],
        prescale=not kw["postscale_gradients"],
        predivide_factor=kw["gradient_predivide_factor"],
        reduce_op=ReduceOp.MEAN if kw["gradient_average"] else ReduceOp.SUM,
    )
    plan = RunPlan(
        batch=BatchPlan(gas * world, 1, gas, world),
        precision=_precision(dtype, kw, scaler),
        grads=grads,
        zero=zero_plan(_zero_block(kw)),
    )
    return plan, scaler


class DeepSpeedZeroOptimizer(ZeroOptimizer):
    """ZeRO stage 1/2 optimizer with upstream's constructor (see ``docs/compat.md`` for accepted values).

    ``timers`` (a ``SynchronizedWallClockTimer``, a ``NoopTimer`` or None) receives the ``optimizer_*`` phase
    timers; ``verbose`` and ``optimizer_params`` are accepted and ignored; ``mpu`` supplies the
    data-parallel group when ``dp_process_group`` is None. With ``has_moe_layers=True`` the groups marked
    ``moe`` are partitioned over ``expert_data_parallel_group[name]`` (``{name: group}`` dicts, as upstream).
    ``zenflow_config``, ``bf16_master_weights_and_gradients=True`` without ``bf16_optimizer_states=True`` (states
    follow the master dtype) and NVMe optimizer offload raise
    ``NotImplementedError`` naming the argument.
    """

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        param_names: dict | None,
        timers: Any,
        optimizer_params: Any,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict | None = None,
        verbose: bool = True,
        contiguous_gradients: bool = True,
        reduce_bucket_size: int = 500000000,
        use_multi_rank_bucket_allreduce: bool = True,
        allgather_bucket_size: int = 5000000000,
        dp_process_group: Any = None,
        expert_parallel_group: Any = None,
        expert_data_parallel_group: Any = None,
        reduce_scatter: bool = True,
        overlap_comm: bool = False,
        offload_optimizer_config: Any = None,
        zenflow_config: Any = None,
        mpu: Any = None,
        clip_grad: float = 0.0,
        gradient_accumulation_dtype: torch.dtype = torch.float32,
        communication_data_type: torch.dtype = torch.float16,
        postscale_gradients: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average: bool = True,
        gradient_accumulation_steps: int = 1,
        ignore_unused_parameters: bool = True,
        partition_grads: bool = True,
        round_robin_gradients: bool = False,
        has_moe_layers: bool = False,
        fp16_master_weights_and_gradients: bool = False,
        bf16_master_weights_and_gradients: bool = False,
        bf16_optimizer_states: bool = False,
        elastic_checkpoint: bool = False,
        check_grad_overflow: bool = True,
    ) -> None:
        kw = dict(locals())
        for name in ("self", "__class__", "init_optimizer", "param_names", "dp_process_group", "mpu"):
            kw.pop(name, None)
        if dp_process_group is None and mpu is not None:
            dp_process_group = mpu.get_data_parallel_group()
        plan, scaler = build_plan(init_optimizer, dp_process_group, kw)
        experts = _expert_groups(init_optimizer, kw)
        super().__init__(init_optimizer, plan, scaler, dp_process_group, param_names, experts)
        self.timers = timers
        attach_hp_mapping(self)

    @classmethod
    def from_plan(
        cls,
        init_optimizer: torch.optim.Optimizer,
        plan: RunPlan,
        loss_scaler: Any,
        dp_group: Any,
        param_names: dict | None,
        expert_groups: Mapping[str, ExpertGroup] | None = None,
    ) -> DeepSpeedZeroOptimizer:
        """Build from an already validated run plan (what ``deepspeed.initialize`` does).

        The engine's ZeRO-1/2 optimizer is this class, so integrations that check
        ``isinstance(engine.optimizer, DeepSpeedZeroOptimizer)`` and read its upstream attributes work;
        the upstream keyword list above is only for code that constructs the optimizer itself.
        """
        self = cls.__new__(cls)
        ZeroOptimizer.__init__(self, init_optimizer, plan, loss_scaler, dp_group, param_names, expert_groups)
        return self

    # --- upstream attribute names, read-only views over the groups ------------------------------------
    @property
    def bit16_groups(self) -> list[list[torch.nn.Parameter]]:
        """Trainable working parameters per group, in flat order."""
        return [g.params for g in self.groups]

    @property
    def single_partition_of_fp32_groups(self) -> list[torch.nn.Parameter]:
        """This rank's fp32 master partition of each group."""
        return [g.master.param for g in self.groups]

    @property
    def dp_process_group(self) -> Any:
        """The data-parallel process group (None = world)."""
        return self.dp_group

    @property
    def partition_count(self) -> list[int]:
        """Partitions per group (the data-parallel size; an MoE group's expert-data-parallel size)."""
        return [g.flat.layout.world_size for g in self.groups]

    @property
    def partition_gradients(self) -> bool:
        """True for ZeRO-2 (gradients partitioned), False for ZeRO-1."""
        return self.plan.zero.stage >= 2
