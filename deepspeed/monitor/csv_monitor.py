"""``deepspeed.monitor.csv_monitor``: scalar events to one CSV file per tag.

The implementation lives in ``deepspeed/_core/observe/monitors.py``.
"""

from __future__ import annotations

from deepspeed._core.observe.monitors import csvMonitor

__all__ = ["csvMonitor"]
