"""Upstream names of ``deepspeed.runtime.config_utils``: the base of every pydantic config block and its helpers.

The implementation lives in ``deepspeed/_core/config/base.py``.
"""

from __future__ import annotations

from deepspeed._core.config.base import (
    DeepSpeedConfigModel,
    DeepSpeedConfigObject,
    ScientificNotationEncoder,
    dict_raise_error_on_duplicate_keys,
    get_dict_param,
    get_list_param,
    get_scalar_param,
    pp_int,
)

__all__ = [
    "DeepSpeedConfigModel",
    "DeepSpeedConfigObject",
    "ScientificNotationEncoder",
    "dict_raise_error_on_duplicate_keys",
    "get_dict_param",
    "get_list_param",
    "get_scalar_param",
    "pp_int",
]
