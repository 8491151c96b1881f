"""Upstream ``deepspeed.runtime.zero.partition_parameters`` names over ``deepspeed._core.params``.

``Init`` and ``GatheredParameters`` accept upstream's arguments, resolve them once into plan objects and
delegate; the algorithms live in ``deepspeed/_core/params/`` (see ``docs/design/zero3.md``).
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from deepspeed import comm as dist
from deepspeed._core.params.gathered import (
    GatheredContext,
    ModifierRank,
    collect_states,
    register_external,
    unregister_external,
)
from deepspeed._core.params.init_context import InitPlan, ZeroInitContext, init_depth
from deepspeed._core.params.param import (
    MultipleAllGatherHandles,
    ShardGroup,
    ZeroParameter,
    ZeroParamStatus,
    ZeroParamType,
    is_zero_param,
    zero_state,
)
from deepspeed._core.params.placement import Pinning, ShardPlacement
from deepspeed.accelerator import get_accelerator

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

__all__ = [
    "GatheredParameters",
    "MultipleAllGatherHandles",
    "Init",
    "ZeroParamStatus",
    "ZeroParamType",
    "ZeroParameter",
    "free_param",
    "is_zero_param",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_init_depth",
]

_ALLOWED_DTYPES = (torch.half, torch.bfloat16, torch.float)

# transformers (``integrations/deepspeed.py`` ``prevent_arange_dtype_change``) swaps this module attribute around
# ``zero.Init`` and compares constructors against ``_orig_torch_arange``. Our Init does not retype tensor
# constructors, so the hook is the identity; the names exist so that code path runs.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Any, target_fp_dtype: torch.dtype, target_device: Any = None) -> Any:
    """Upstream hook for wrapping tensor constructors inside ``zero.Init``; deepspeed-lean returns ``fn`` unchanged."""
    return fn


def zero_init_depth() -> int:
    """Number of open ``zero.Init`` contexts (nesting counter)."""
    return init_depth()


def _resolve_dtype(dtype: torch.dtype | None, ds_config: Any) -> torch.dtype:
    """Upstream's rule: explicit dtype; else the config's precision; else fp16 if supported (bf16 otherwise)."""
    if dtype is None:
        if ds_config is not None:
            dtype = ds_config.plan.precision.param_dtype
        else:
            dtype = torch.half if get_accelerator().is_fp16_supported() else torch.bfloat16
    if dtype not in _ALLOWED_DTYPES:
        raise ValueError(f"zero.Init dtype must be one of {_ALLOWED_DTYPES}, got {dtype}")
    return dtype


def _resolve_group(data_parallel_group: Any, mpu: Any, zero_param_parallel_group: Any) -> ShardGroup:
    if zero_param_parallel_group is not None:
        return ShardGroup.resolve(zero_param_parallel_group)
    if data_parallel_group is None and mpu is not None:
        data_parallel_group = mpu.get_data_parallel_group()
    return ShardGroup.resolve(data_parallel_group)


def _placement(remote_device: str | None, pin_memory: bool, ds_config: Any) -> ShardPlacement:
    """Upstream: a config's ``offload_param`` block overrides the ``remote_device``/``pin_memory`` arguments."""
    if ds_config is not None and ds_config.plan.zero.offload_param.enabled:
        return ShardPlacement.from_policy(ds_config.plan.zero.offload_param)
    if remote_device in (None, "none"):
        return ShardPlacement()
    if remote_device != "cpu":
        raise ValueError(f"zero.Init remote_device={remote_device!r} is not supported; use None or 'cpu'")
    return ShardPlacement(torch.device("cpu"), Pinning.PINNED if pin_memory else Pinning.PAGEABLE)


class Init:
    """Partition parameters as modules are constructed inside ``with deepspeed.zero.Init(...)``.

    With ``module=`` an already-built model is partitioned immediately. Arguments are upstream's; those for
    features not implemented here (quantized weights, hpZ, NVMe swapping) are accepted and ignored.
    ``remote_device='cpu'`` (or a config's ``offload_param.device='cpu'``) keeps shards in host memory, pinned
    when ``pin_memory``; gathered parameters still live on the accelerator.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        """Resolve the config into an :class:`~deepspeed._core.params.init_context.InitPlan` and delegate."""
        self.enabled = enabled
        self._context: ZeroInitContext | None = None
        if not enabled:
            return
        if not dist.is_initialized():
            dist.init_distributed()
            get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
        source = config_dict_or_path if config_dict_or_path is not None else config
        ds_config = None
        if source is not None:
            from deepspeed.runtime.config import DeepSpeedConfig

            ds_config = DeepSpeedConfig(source, mpu)
        device = torch.device(get_accelerator().current_device_name())
        self.dtype = _resolve_dtype(dtype, ds_config)
        plan = InitPlan(
            _resolve_group(data_parallel_group, mpu, zero_param_parallel_group),
            self.dtype,
            device,
            _placement(remote_device, pin_memory, ds_config),
        )
        self._context = ZeroInitContext(plan)
        if module is not None:
            for sub in module.modules():
                self._context.partition_module(sub)

    def __enter__(self) -> Self:
        if self._context is not None:
            self._context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)


class GatheredParameters:
    """Gather ZeRO-3 parameters for a ``with`` block.

    Args:
        params: one parameter or an iterable of them; non-ZeRO parameters are ignored.
        modifier_rank: if set, that rank's (possibly modified) values become every rank's shards on exit; if
            ``None`` the gather is read-only and modifications are discarded.
        fwd_module: register ``params`` as external parameters of this module.
        enabled: ``False`` makes the context a no-op.

    Raises:
        RuntimeError: on entry, when a parameter is already gathered by an enclosing context.
    """

    def __init__(
        self, params: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None, enabled: bool = True
    ) -> None:
        """Collect the ZeRO states (sorted by ``ds_id``) and remember the modifier rank."""
        self._context: GatheredContext | None = None
        if not enabled:
            return
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        states = collect_states(params)
        if not states:
            return
        if fwd_module is not None:
            for param in params:
                if is_zero_param(param):
                    register_external(fwd_module, param)
        self._context = GatheredContext(states, ModifierRank(modifier_rank))

    def __enter__(self) -> Self:
        if self._context is not None:
            self._context.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._context is not None:
            self._context.__exit__(exc_type, exc, tb)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, owned by another module, so it is fetched with it.

    Raises:
        RuntimeError: ``parameter`` is not an ``nn.Parameter``.
    """
    register_external(module, parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`.

    Raises:
        RuntimeError: ``parameter`` is not an ``nn.Parameter``.
    """
    unregister_external(module, parameter)


def free_param(param: nn.Parameter) -> None:
    """Release ``param``'s gathered values if no module or context is using them."""
    state = zero_state(param)
    if state is not None:
        state.gatherer.release([state])
