"""``DeepSpeedConfig`` and the upstream names importable from ``deepspeed.runtime.config``.

The implementation lives in ``deepspeed/_core/config/`` (``ds_config.py``; docs/config.md describes the room).
"""

from __future__ import annotations

from deepspeed._core.config.base import DeepSpeedConfigError
from deepspeed._core.config.ds_config import DeepSpeedConfig
from deepspeed._core.config.precision import DtypeEnum
from deepspeed.runtime.constants import (
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAM_W_MODE,
    ADAM_W_MODE_DEFAULT,
    ADAMW_OPTIMIZER,
    DEEPSPEED_OPTIMIZERS,
    LAMB_OPTIMIZER,
    LION_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUON_OPTIMIZER,
    MUSGD_OPTIMIZER,
    ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER,
    TORCH_ADAM_PARAM,
    ZERO_ONE_ADAM_OPTIMIZER,
)

__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DtypeEnum",
    "ADAGRAD_OPTIMIZER",
    "ADAM_OPTIMIZER",
    "ADAMW_OPTIMIZER",
    "LAMB_OPTIMIZER",
    "ONEBIT_ADAM_OPTIMIZER",
    "ZERO_ONE_ADAM_OPTIMIZER",
    "ONEBIT_LAMB_OPTIMIZER",
    "MUADAM_OPTIMIZER",
    "MUADAMW_OPTIMIZER",
    "MUSGD_OPTIMIZER",
    "LION_OPTIMIZER",
    "MUON_OPTIMIZER",
    "DEEPSPEED_OPTIMIZERS",
    "TORCH_ADAM_PARAM",
    "ADAM_W_MODE",
    "ADAM_W_MODE_DEFAULT",
]
