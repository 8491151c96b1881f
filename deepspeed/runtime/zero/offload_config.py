"""Upstream names of ``deepspeed.runtime.zero.offload_config``: the offload blocks and their enums.

The implementation lives in ``deepspeed/_core/config/offload.py``.
"""

from __future__ import annotations

from deepspeed._core.config.offload import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
)

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]
