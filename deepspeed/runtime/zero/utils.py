"""ZeRO helper names at upstream's path (``deepspeed.runtime.zero.utils``)."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed.utils.logging import logger

__all__ = [
    "ZERO_SUPPORTED_OPTIMIZERS",
    "ZeRORuntimeException",
    "get_mapping_to_flat_buffer",
    "is_zero_supported_optimizer",
]


class ZeRORuntimeException(ValueError):
    """A ZeRO set-up was asked for something it cannot do (e.g. optimizer offload with a non-CPU optimizer).

    Upstream derives it from ``Exception``; deriving from ``ValueError`` keeps ``except Exception`` and
    ``except ZeRORuntimeException`` working and matches this project's bad-input convention.
    """


def _supported_classes() -> list[type]:
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

    return [
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        FusedAdam,
        DeepSpeedCPUAdam,
        DeepSpeedCPUAdagrad,
        DeepSpeedCPULion,
        FusedLion,
    ]


ZERO_SUPPORTED_OPTIMIZERS: list[type] = _supported_classes()
"""Optimizer classes ZeRO accepts without ``zero_allow_untested_optimizer`` (extend it to add your own)."""


def is_zero_supported_optimizer(optimizer: Any) -> bool:
    """True when ``type(optimizer)`` is in :data:`ZERO_SUPPORTED_OPTIMIZERS` (logs the class it checked)."""
    supported = type(optimizer) in ZERO_SUPPORTED_OPTIMIZERS
    logger.debug(f"checking ZeRO support for optimizer={type(optimizer).__name__}: {supported}")
    return supported


def get_mapping_to_flat_buffer(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
    """``(tensor, offset, numel)`` of each tensor laid end to end in one flat buffer, in order."""
    mapping, offset = [], 0
    for tensor in tensors:
        mapping.append((tensor, offset, tensor.numel()))
        offset += tensor.numel()
    return mapping
