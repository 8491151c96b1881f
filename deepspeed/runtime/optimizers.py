"""Build the inner ("basic") optimizer and the LR scheduler from client objects or the config.

This is façade-level code on purpose: it maps upstream config names (``"adam"``, ``"WarmupLR"``) to
public classes in ``deepspeed.ops`` and ``deepspeed.runtime.lr_schedules``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepspeed.utils.logging import logger

ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
ADAGRAD_OPTIMIZER = "adagrad"
LION_OPTIMIZER = "lion"
# Names upstream also recognises but this build does not implement (a clear error beats a silent swap).
UNSUPPORTED_DS_OPTIMIZERS = ("lamb", "onebitadam", "zerooneadam", "onebitlamb", "muadam", "muadamw", "musgd", "muon")

# Client optimizers ZeRO accepts without ``zero_allow_untested_optimizer`` (by class name, so that the
# check needs no import of every candidate).
ZERO_SUPPORTED_OPTIMIZERS = (
    "Adam",
    "AdamW",
    "Adagrad",
    "FusedAdam",
    "DeepSpeedCPUAdam",
    "DeepSpeedCPUAdagrad",
    "DeepSpeedCPULion",
    "FusedLion",
)


def build_basic_optimizer(client: Any, params: list, config: Any, module: torch.nn.Module) -> Any:
    """The optimizer the engine wraps: a client object, a client factory, the config's, or ``None``."""
    name = config.optimizer_name
    if client is not None and name is not None:
        raise ValueError(
            f"an optimizer was given both to deepspeed.initialize ({type(client).__name__}) and in the config "
            f"('optimizer.type': {name!r}); remove one of them"
        )
    if isinstance(client, torch.optim.Optimizer):
        optimizer = client
    elif callable(client):
        optimizer = client(params)
    elif name is not None:
        params_cfg = dict(config.optimizer_params or {})
        if _offloading(config) and _low_precision_states(config) and name.lower() in _CPU_OPTIMIZER_TYPES:
            _states_in_master_dtype(name, params_cfg)
        optimizer = _from_config(name, params_cfg, params, _offloading(config))
    else:
        return None
    _check_zero_compatible(optimizer, config, client_given=client is not None)
    _check_state_dtype(optimizer, config)
    return optimizer


_CPU_OPTIMIZER_TYPES = (ADAM_OPTIMIZER, ADAMW_OPTIMIZER, ADAGRAD_OPTIMIZER, LION_OPTIMIZER)
"""The config names built as a DeepSpeed CPU optimizer under ``offload_optimizer``."""


def _low_precision_states(config: Any) -> bool:
    """A 16-bit master whose optimizer states follow it: ``bf16.bf16_optimizer_states`` (with its master flag), or
    ``fp16.fp16_master_weights_and_grads`` (upstream keeps no fp32 states for an fp16 master either)."""
    bf16 = bool(config.bfloat16_enabled and config.bf16_master_weights_and_grads and config.bf16_optimizer_states)
    return bf16 or bool(config.fp16_enabled and config.fp16_master_weights_and_gradients)


def _states_in_master_dtype(name: str, params_cfg: dict) -> None:
    """A config-built CPU optimizer keeps its states in the 16-bit master's dtype: ``fp32_optimizer_states`` false."""
    if params_cfg.get("fp32_optimizer_states"):
        logger.warning(
            f"optimizer.params.fp32_optimizer_states true is overridden for {name!r}: with a 16-bit master "
            "(bf16.bf16_optimizer_states or fp16.fp16_master_weights_and_grads) and offload_optimizer the "
            "optimizer states are kept in the master's dtype"
        )
    params_cfg["fp32_optimizer_states"] = False


def _check_state_dtype(optimizer: Any, config: Any) -> None:
    """``bf16.bf16_optimizer_states`` asks for bf16 states: an optimizer that would keep fp32 ones is refused."""
    wants_bf16 = config.bfloat16_enabled and config.bf16_master_weights_and_grads and config.bf16_optimizer_states
    if wants_bf16 and getattr(optimizer, "fp32_optimizer_states", False):
        raise ValueError(
            f"bf16.bf16_optimizer_states is true but the {type(optimizer).__name__} given has "
            "fp32_optimizer_states=True, which would keep fp32 states; construct it with "
            "fp32_optimizer_states=False or set bf16.bf16_optimizer_states to false"
        )


def _offloading(config: Any) -> bool:
    offload = getattr(config.zero_config, "offload_optimizer", None)
    device = getattr(offload, "device", None) if offload is not None else None
    return str(getattr(device, "value", device)) in ("cpu", "nvme")


def _from_config(name: str, params_cfg: dict, params: list, offload: bool) -> torch.optim.Optimizer:
    if "max_grad_norm" in params_cfg:
        raise ValueError("'max_grad_norm' is not supported in optimizer.params; use the top-level 'gradient_clipping'")
    lower = name.lower()
    if lower in (ADAM_OPTIMIZER, ADAMW_OPTIMIZER):
        return _adam(lower, params_cfg, params, offload)
    if lower == ADAGRAD_OPTIMIZER:
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad(params, **params_cfg) if offload else torch.optim.Adagrad(params, **params_cfg)
    if lower == LION_OPTIMIZER:
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

        return (DeepSpeedCPULion if offload else FusedLion)(params, **params_cfg)
    if lower in UNSUPPORTED_DS_OPTIMIZERS:
        raise ValueError(
            f"optimizer.type {name!r} is not implemented in deepspeed-lean; use adam, adamw, adagrad, lion "
            "or a torch.optim class name"
        )
    if not hasattr(torch.optim, name):
        raise ValueError(
            f"optimizer.type {name!r} is unknown: valid are adam, adamw, adagrad, lion or a torch.optim class "
            "name (case-sensitive, e.g. 'SGD')"
        )
    return getattr(torch.optim, name)(params, **params_cfg)


def _adam(lower: str, params_cfg: dict, params: list, offload: bool) -> torch.optim.Optimizer:
    torch_adam = params_cfg.pop("torch_adam", False)
    adam_w_mode = params_cfg.pop("adam_w_mode", True) or lower == ADAMW_OPTIMIZER
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=adam_w_mode, **params_cfg)
    if torch_adam:
        params_cfg.pop("bias_correction", None)
        return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(params, **params_cfg)
    from deepspeed.ops.adam import FusedAdam

    return FusedAdam(params, adam_w_mode=adam_w_mode, **params_cfg)


def _check_zero_compatible(optimizer: Any, config: Any, client_given: bool) -> None:
    if not client_given or config.zero_optimization_stage == 0:
        return
    cls = type(optimizer).__name__
    if cls not in ZERO_SUPPORTED_OPTIMIZERS and not config.zero_allow_untested_optimizer:
        raise ValueError(
            f'{cls} has not been tested with ZeRO; set "zero_allow_untested_optimizer": true to use it '
            f"(tested: {', '.join(ZERO_SUPPORTED_OPTIMIZERS)})"
        )
    if (
        _offloading(config)
        and config.zero_force_ds_cpu_optimizer
        and cls not in ("DeepSpeedCPUAdam", "DeepSpeedCPULion")
    ):
        raise ValueError(
            f"optimizer offload needs DeepSpeedCPUAdam or DeepSpeedCPULion, got {cls}; pass one of those or set "
            '"zero_force_ds_cpu_optimizer": false'
        )


def build_lr_scheduler(client: Any, basic_optimizer: Any, config: Any) -> Any:
    """The config's scheduler if one is configured, else the client's (a factory is called with the inner optimizer)."""
    if basic_optimizer is not None and config.scheduler_name is not None:
        return _scheduler_from_config(config.scheduler_name, dict(config.scheduler_params or {}), basic_optimizer)
    if client is not None and callable(client):
        return client(basic_optimizer)
    return client


def _scheduler_from_config(name: str, params: dict, basic_optimizer: Any) -> Any:
    from deepspeed.runtime import lr_schedules

    if hasattr(lr_schedules, name):
        cls: Callable = getattr(lr_schedules, name)
    elif hasattr(torch.optim.lr_scheduler, name):
        cls = getattr(torch.optim.lr_scheduler, name)
    else:
        raise ValueError(
            f"scheduler.type {name!r} is unknown: valid are {', '.join(lr_schedules.VALID_LR_SCHEDULES)} "
            "or a torch.optim.lr_scheduler class name"
        )
    logger.info(f"using configured LR scheduler {name}")
    return cls(basic_optimizer, **params)
