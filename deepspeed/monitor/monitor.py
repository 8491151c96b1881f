"""``deepspeed.monitor.monitor``: the monitor base class and ``MonitorMaster``, which fans events out to every
enabled monitor on global rank 0.

The implementation lives in ``deepspeed/_core/observe/monitors.py``.
"""

from __future__ import annotations

from deepspeed._core.observe.monitors import Monitor, MonitorMaster

__all__ = ["Monitor", "MonitorMaster"]
