"""``deepspeed.monitor.wandb``: scalar events to Weights & Biases.

The implementation lives in ``deepspeed/_core/observe/monitors.py``.
"""

from __future__ import annotations

from deepspeed._core.observe.monitors import WandbMonitor

__all__ = ["WandbMonitor"]
