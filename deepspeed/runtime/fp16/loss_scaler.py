"""fp16 loss scalers at upstream's import path.

Checkpoints written by DeepSpeed pickle ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` and
``DynamicLossScaler``; unpickling resolves those names here. The classes live in
``deepspeed._core.optim.loss_scaling`` (the engine core needs them without importing a façade) and
declare this module as their ``__module__``, so our own pickles record this path too.
"""

from __future__ import annotations

from deepspeed._core.optim.loss_scaling import (
    CONSECUTIVE_HYSTERESIS,
    DELAYED_SHIFT,
    INITIAL_LOSS_SCALE,
    MIN_LOSS_SCALE,
    SCALE_WINDOW,
    CreateLossScaler,
    DynamicLossScaler,
    LossScaler,
    LossScalerBase,
    to_python_float,
)

__all__ = [
    "CONSECUTIVE_HYSTERESIS",
    "DELAYED_SHIFT",
    "INITIAL_LOSS_SCALE",
    "MIN_LOSS_SCALE",
    "SCALE_WINDOW",
    "CreateLossScaler",
    "DynamicLossScaler",
    "LossScaler",
    "LossScalerBase",
    "to_python_float",
]
