"""``deepspeed.monitor.tensorboard``: scalar events to TensorBoard event files.

The implementation lives in ``deepspeed/_core/observe/monitors.py``.
"""

from __future__ import annotations

from deepspeed._core.observe.monitors import TensorBoardMonitor

__all__ = ["TensorBoardMonitor"]
