"""Upstream ``DeepSpeedZeRoOffload``: the ZeRO-3 parameter side as integrations (TRL) see it.

A façade over :class:`deepspeed._core.params.manager.ZeroParamManager`: the constructor turns upstream's keyword
arguments into the validated stage-3 ``zero_optimization`` block they stand for, converts it with the one
config-to-plan conversion (``deepspeed/_core/config/convert.py``) and delegates.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.comm.streams import SideStreams, StreamSet
from deepspeed._core.config.convert import offload_policy, stage3_policy
from deepspeed._core.config.plan import LeanPolicy
from deepspeed._core.config.zero import DeepSpeedZeroConfig
from deepspeed._core.params.manager import ParamStorage, ZeroParamManager
from deepspeed.runtime.zero.partitioned_param_coordinator import (
    PartitionedParameterCoordinator,
)


def _lean_policy(ds_config: Any) -> LeanPolicy:
    plan = getattr(ds_config, "plan", None)
    return plan.zero.lean if plan is not None else LeanPolicy()


def _stage3_block(ds_config: Any, offload_param_config: Any, **knobs: int) -> DeepSpeedZeroConfig:
    """The upstream keywords as the validated stage-3 ``zero_optimization`` block they stand for; the leaf-module
    selection comes from ``ds_config`` (a ``DeepSpeedConfig``) when given, as the keywords have none."""
    zero_config = getattr(ds_config, "zero_config", None)
    extra = {"leaf_module": zero_config.leaf_module} if zero_config is not None else {}
    return DeepSpeedZeroConfig(stage=3, offload_param=offload_param_config, **knobs, **extra)


class DeepSpeedZeRoOffload:
    """Partition ``module``'s parameters and fetch/release them around every submodule's forward and backward.

    Attributes read by integrations: ``module``, ``forward_hooks`` and ``backward_hooks`` (lists of hook
    handles; assignable), ``_register_deepspeed_module(module)``.
    """

    def __init__(
        self,
        module: nn.Module,
        timers: Any = None,
        ds_config: Any = None,
        zenflow: Any = None,
        overlap_comm: bool = True,
        prefetch_bucket_size: int = 50_000_000,
        max_reuse_distance: int = 1_000_000_000,
        max_live_parameters: int = 1_000_000_000,
        param_persistence_threshold: int = 100_000,
        model_persistence_threshold: int = sys.maxsize,
        dp_process_group: Any = None,
        offload_param_config: Any = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        zero_module_granularity_threshold: int = 0,
        log_trace_cache_warnings: bool = False,
    ) -> None:
        """Build the policies from upstream's arguments and start a :class:`ZeroParamManager`."""
        zero = _stage3_block(
            ds_config,
            offload_param_config,
            prefetch_bucket_size=int(prefetch_bucket_size),
            max_live_parameters=int(max_live_parameters),
            max_reuse_distance=int(max_reuse_distance),
            param_persistence_threshold=int(param_persistence_threshold),
            model_persistence_threshold=int(model_persistence_threshold),
            module_granularity_threshold=int(zero_module_granularity_threshold),
        )
        group = ShardGroup.resolve(
            zero_param_parallel_group if zero_param_parallel_group is not None else dp_process_group
        )
        streams = StreamSet(side=SideStreams.SEPARATE if overlap_comm else SideStreams.SHARED)
        self.manager = ZeroParamManager(
            module,
            group,
            stage3_policy(zero),
            _lean_policy(ds_config),
            streams,
            storage=ParamStorage(offload_param=offload_policy(zero.offload_param)),
        )
        self.module = module
        self.dp_process_group = dp_process_group
        self.timers = timers

    @classmethod
    def from_manager(cls, manager: ZeroParamManager, dp_process_group: Any = None) -> DeepSpeedZeRoOffload:
        """A view over a manager the engine already built (no second partitioning)."""
        view = cls.__new__(cls)
        view.manager = manager
        view.module = manager.module
        view.dp_process_group = dp_process_group
        view.timers = None
        return view

    @property
    def forward_hooks(self) -> list:
        """Handles of the fetch/release forward hooks."""
        return self.manager.hooks.forward_hooks

    @forward_hooks.setter
    def forward_hooks(self, handles: list) -> None:
        self.manager.hooks.forward_hooks = handles

    @property
    def backward_hooks(self) -> list:
        """Handles of the hooks that set up backward fetch/release."""
        return self.manager.hooks.backward_hooks

    @backward_hooks.setter
    def backward_hooks(self, handles: list) -> None:
        self.manager.hooks.backward_hooks = handles

    def _register_deepspeed_module(self, module: nn.Module, count: list | None = None) -> None:
        """(Re-)install the hooks on ``module``'s tree (TRL calls this after removing them)."""
        self.manager.register_module(module)

    def get_param_coordinator(self) -> PartitionedParameterCoordinator:
        """The fetch/release coordinator view."""
        return PartitionedParameterCoordinator(self.manager)

    def empty_partition_cache(self) -> None:
        """Release every gathered, non-persistent parameter."""
        self.manager.release_all()

    def partition_all_parameters(self) -> None:
        """Same as :meth:`empty_partition_cache`."""
        self.manager.release_all()

    def destroy(self) -> None:
        """Remove all hooks and free gathered memory."""
        self.manager.destroy()
