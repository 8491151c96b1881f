"""``deepspeed.monitor.comet``: scalar events to Comet.

The implementation lives in ``deepspeed/_core/observe/monitors.py``.
"""

from __future__ import annotations

from deepspeed._core.observe.monitors import CometMonitor

__all__ = ["CometMonitor"]
