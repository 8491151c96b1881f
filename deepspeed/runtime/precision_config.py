"""Upstream names of ``deepspeed.runtime.precision_config``: the ``fp16`` and ``bf16`` blocks.

The implementation lives in ``deepspeed/_core/config/precision.py``.
"""

from __future__ import annotations

from deepspeed._core.config.precision import (
    CONSECUTIVE_HYSTERESIS,
    DELAYED_SHIFT,
    INITIAL_LOSS_SCALE,
    MIN_LOSS_SCALE,
    SCALE_WINDOW,
    DeepSpeedBF16Config,
    DeepSpeedFP16Config,
    get_bfloat16_config,
    get_float16_config,
)

__all__ = [
    "CONSECUTIVE_HYSTERESIS",
    "DELAYED_SHIFT",
    "INITIAL_LOSS_SCALE",
    "MIN_LOSS_SCALE",
    "SCALE_WINDOW",
    "DeepSpeedBF16Config",
    "DeepSpeedFP16Config",
    "get_bfloat16_config",
    "get_float16_config",
]
