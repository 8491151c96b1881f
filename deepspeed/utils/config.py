"""``deepspeed.utils.config``: the ``timers`` block (``DeepSpeedThroughputTimerConfig``, ``get_timers_config``).

The implementation lives in ``deepspeed/_core/config/monitor.py``.
"""

from __future__ import annotations

from deepspeed._core.config.monitor import DeepSpeedThroughputTimerConfig, get_timers_config

__all__ = ["DeepSpeedThroughputTimerConfig", "get_timers_config"]
