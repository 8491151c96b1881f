"""Upstream names of ``deepspeed.monitor.config``: the ``tensorboard``, ``wandb``, ``csv_monitor`` and ``comet``
blocks.

The implementation lives in ``deepspeed/_core/config/monitor.py``.
"""

from __future__ import annotations

from deepspeed._core.config.monitor import (
    CometConfig,
    CSVConfig,
    DeepSpeedMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
    get_monitor_config,
)

__all__ = [
    "CSVConfig",
    "CometConfig",
    "DeepSpeedMonitorConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "get_monitor_config",
]
