"""Utility names that scripts and integrations import from ``deepspeed.utils``.

``groups`` (and everything else that needs torch) resolves on first access so that importing the
logger, as every module does, stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from deepspeed.utils.logging import log_dist, logger

_LAZY = {
    "groups": ("deepspeed.utils.groups", None),
    "set_z3_leaf_modules": ("deepspeed.utils.z3_leaf_module", "set_z3_leaf_modules"),
    "unset_z3_leaf_modules": ("deepspeed.utils.z3_leaf_module", "unset_z3_leaf_modules"),
    "get_z3_leaf_modules": ("deepspeed.utils.z3_leaf_module", "get_z3_leaf_modules"),
    "z3_leaf_module": ("deepspeed.utils.z3_leaf_module", "z3_leaf_module"),
    "RepeatingLoader": ("deepspeed.runtime.dataloader", "RepeatingLoader"),
    "OnDevice": ("deepspeed.utils.init_on_device", "OnDevice"),
    "instrument_w_nvtx": ("deepspeed.utils.nvtx", "instrument_w_nvtx"),
    "safe_get_full_fp32_param": ("deepspeed.utils.tensor_fragment", "safe_get_full_fp32_param"),
    "safe_set_full_fp32_param": ("deepspeed.utils.tensor_fragment", "safe_set_full_fp32_param"),
    "safe_get_full_optimizer_state": ("deepspeed.utils.tensor_fragment", "safe_get_full_optimizer_state"),
    "safe_set_full_optimizer_state": ("deepspeed.utils.tensor_fragment", "safe_set_full_optimizer_state"),
    "safe_get_full_grad": ("deepspeed.utils.tensor_fragment", "safe_get_full_grad"),
    "safe_set_full_grad": ("deepspeed.utils.tensor_fragment", "safe_set_full_grad"),
    "safe_get_local_fp32_param": ("deepspeed.utils.tensor_fragment", "safe_get_local_fp32_param"),
    "safe_get_local_grad": ("deepspeed.utils.tensor_fragment", "safe_get_local_grad"),
    "safe_get_local_optimizer_state": ("deepspeed.utils.tensor_fragment", "safe_get_local_optimizer_state"),
    "safe_set_local_fp32_param": ("deepspeed.utils.tensor_fragment", "safe_set_local_fp32_param"),
    "safe_set_local_optimizer_state": ("deepspeed.utils.tensor_fragment", "safe_set_local_optimizer_state"),
    "safe_set_local_grad": ("deepspeed.utils.tensor_fragment", "safe_set_local_grad"),
    "safe_update_full_grad_vectorized": ("deepspeed.utils.tensor_fragment", "safe_update_full_grad_vectorized"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'deepspeed.utils' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


__all__ = ["logger", "log_dist", "groups"]
