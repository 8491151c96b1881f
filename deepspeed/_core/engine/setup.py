"""Engine set-up steps that need no public façade: device, module preparation, optimizer wrapping.

The façade (``deepspeed.runtime.engine``) composes these with the public factories (optimizers from
``deepspeed.ops``, schedulers from ``deepspeed.runtime.lr_schedules``) in one short, ordered function.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.comm.streams import SideStreams, StreamSet
from deepspeed._core.config.plan import OffloadDevice, RunPlan
from deepspeed._core.engine.data_parallel import DataParallelOptimizer
from deepspeed._core.engine.precision import cast_buffers, cast_module_params
from deepspeed._core.moe.params import ExpertGroup, check_zero_param_groups
from deepspeed._core.optim.base import EngineOptimizer
from deepspeed._core.optim.nvme import NvmeStage3Optimizer, warn_nvme_as_cpu
from deepspeed._core.optim.stage3 import Stage3Optimizer
from deepspeed._core.optim.stage12 import ZeroOptimizer
from deepspeed._core.params.gather import ParamTarget
from deepspeed._core.params.manager import ParamStorage, ShardAllocation, ZeroParamManager
from deepspeed._foundation.logging import logger
from deepspeed.accelerator import get_accelerator


def local_rank_from_env() -> int:
    """The process's local rank as the launcher (or mpirun) exported it."""
    for key in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def resolve_device(local_rank: int) -> torch.device:
    """The device this rank trains on; selects it on accelerators that have a current device."""
    acc = get_accelerator()
    name = acc.device_name(local_rank)
    if name.startswith("cpu"):
        return torch.device("cpu")
    acc.set_device(local_rank)
    return torch.device(name)


PARAM_OFFLOAD_IGNORED = (
    "zero_optimization.offload_param (device {device!r}) has no effect at ZeRO stage {stage}, as upstream: "
    "parameters are offloaded only at stage 3"
)


def warn_param_offload_ignored(plan: RunPlan) -> None:
    """Stages 0-2 keep the parameters whole on the device whatever ``offload_param`` says; say so once."""
    policy = plan.zero.offload_param
    if policy.enabled and plan.zero.stage != 3:
        logger.warning(PARAM_OFFLOAD_IGNORED.format(device=policy.device.value, stage=plan.zero.stage))


def prepare_module(module: torch.nn.Module, plan: RunPlan, device: torch.device | None) -> None:
    """Place the module on ``device`` (unless ``None``) in the working dtype, one tensor at a time.

    Buffers move here. Parameters move here for stages 0-2: each is cast where it lies first (a host-built fp32
    model crosses in the working dtype) and then moved alone, so the device never holds a parameter twice nor
    the host-built model whole in fp32. Stage 3 leaves parameters where they are: the partitioner copies each
    rank's slice straight into its shard ([Note: zero3-init]).
    """
    warn_param_offload_ignored(plan)
    if device is not None:
        _place_buffers(module, device)
    if plan.zero.stage == 3:
        cast_buffers(module, plan.precision)
        return
    if device is not None:
        _place_parameters(module, device, plan.precision.param_dtype)
    cast_module_params(module, plan.precision)


def _place_buffers(module: torch.nn.Module, device: torch.device) -> None:
    for owner in module.modules():
        for name, buf in owner.named_buffers(recurse=False):
            if buf is not None and buf.device != device:
                owner._buffers[name] = buf.to(device)


def _place_parameters(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    for param in module.parameters():
        data = param.data
        if data.device == device:
            continue
        if data.is_floating_point() and data.dtype != dtype:
            data = data.to(dtype)  # cast on the source side: fewer bytes cross, no fp32 copy on the device
        param.data = data.to(device)
        del data  # the source storage goes as soon as nothing else holds it


def check_trainable(module: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
    """Fail early, with a clear message, when there is nothing to train."""
    if not any(p.requires_grad for p in params):
        raise ValueError(
            f"the model {type(module).__name__} has no trainable parameters (every parameter has "
            "requires_grad=False); training needs at least one"
        )


def wrap_optimizer(
    basic: torch.optim.Optimizer,
    plan: RunPlan,
    loss_scaler: Any,
    dp_group: Any,
    dp_world_size: int,
    module: torch.nn.Module,
    manager: ZeroParamManager | None = None,
    zero12_factory: Callable[..., ZeroOptimizer] = ZeroOptimizer,
    expert_groups: Mapping[str, ExpertGroup] | None = None,
) -> EngineOptimizer:
    """Wrap the inner optimizer for the configured ZeRO stage (stage 3 needs the parameter ``manager``).

    ``zero12_factory(basic, plan, loss_scaler, dp_group, names, expert_groups)`` builds the ZeRO-1/2 optimizer;
    the engine façade passes the public class's constructor so ``engine.optimizer`` is an instance of it.
    ``expert_groups`` (MoE models) names the process groups expert gradients are reduced over.
    """
    stage = plan.zero.stage
    if stage == 3:
        if manager is None:
            raise ValueError("ZeRO stage 3 needs the parameter manager built by partition_parameters()")
        nvme = plan.zero.offload_optimizer.device is OffloadDevice.NVME
        return (NvmeStage3Optimizer if nvme else Stage3Optimizer)(basic, plan, loss_scaler, dp_group, manager)
    warn_nvme_as_cpu(plan)
    if stage == 0:
        return DataParallelOptimizer(basic, plan, loss_scaler, dp_group, dp_world_size, expert_groups)
    if stage in (1, 2):
        check_zero_param_groups(basic.param_groups, stage)
        names = {p: n for n, p in module.named_parameters()}
        return zero12_factory(basic, plan, loss_scaler, dp_group, names, expert_groups)
    raise ValueError(f"zero_optimization.stage={stage} is not valid; valid stages: 0, 1, 2, 3")


def partition_parameters(
    module: torch.nn.Module, plan: RunPlan, dp_group: Any, device: torch.device | None = None
) -> ZeroParamManager:
    """ZeRO-3: partition ``module``'s parameters over ``dp_group`` and install the fetch/release hooks.

    Parameters not yet partitioned get their shard on ``device`` (``None``: where each lies) in the working dtype.
    """
    side = SideStreams.SEPARATE if plan.zero.buckets.overlap_comm else SideStreams.SHARED
    # Shards the optimizer will not replace by master views stay for the run: one buffer holds them.
    shards = ShardAllocation.PER_PARAMETER if plan.zero.shards_are_master_views else ShardAllocation.ARENA
    manager = ZeroParamManager(
        module,
        ShardGroup.resolve(dp_group),
        plan.zero.stage3,
        plan.zero.lean,
        StreamSet(side=side),
        storage=ParamStorage(plan.zero.offload_param, shards=shards, aio=plan.aio),
        target=ParamTarget(device, plan.precision.param_dtype),
    )
    if device is not None and device.type != "cpu":
        # Partitioning frees whole parameters of many sizes; hand their cached blocks back once, here, so the
        # first step starts with reserved memory equal to what is allocated ([Note: zero3-init]).
        get_accelerator().empty_cache()
    return manager
