"""Upstream names of ``deepspeed.runtime.zero.config``: the ``zero_optimization`` block.

The implementation lives in ``deepspeed/_core/config/zero.py``. ``ZeroStageEnum`` pickles under this module's
path (upstream checkpoints store it), so ``torch.load`` resolves it here.
"""

from __future__ import annotations

from deepspeed._core.config.base import DeepSpeedConfigModel, pp_int
from deepspeed._core.config.offload import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)
from deepspeed._core.config.zero import (
    ZERO_OPTIMIZATION,
    DeepSpeedZeroConfig,
    ZeroStageEnum,
    get_zero_config,
    read_zero_config_deprecated,
)

__all__ = [
    "ZERO_OPTIMIZATION",
    "DeepSpeedConfigModel",
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "ZeroStageEnum",
    "get_zero_config",
    "pp_int",
    "read_zero_config_deprecated",
]
