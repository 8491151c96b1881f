"""``deepspeed.utils.timer``: the engine's phase timers (``SynchronizedWallClockTimer``, ``NoopTimer``), the
``ThroughputTimer``, ``trim_mean`` and the timer name constants, under upstream's names.

The implementation lives in ``deepspeed/_core/observe/timers.py``.
"""

from __future__ import annotations

from deepspeed._core.observe.timers import (
    BACKWARD_GLOBAL_TIMER,
    BACKWARD_INNER_GLOBAL_TIMER,
    BACKWARD_INNER_MICRO_TIMER,
    BACKWARD_MICRO_TIMER,
    BACKWARD_REDUCE_GLOBAL_TIMER,
    BACKWARD_REDUCE_MICRO_TIMER,
    FORWARD_GLOBAL_TIMER,
    FORWARD_MICRO_TIMER,
    STEP_GLOBAL_TIMER,
    STEP_MICRO_TIMER,
    TIME_EPSILON,
    CudaEventTimer,
    NoopTimer,
    SynchronizedWallClockTimer,
    ThroughputTimer,
    trim_mean,
)

__all__ = [
    "BACKWARD_GLOBAL_TIMER",
    "BACKWARD_INNER_GLOBAL_TIMER",
    "BACKWARD_INNER_MICRO_TIMER",
    "BACKWARD_MICRO_TIMER",
    "BACKWARD_REDUCE_GLOBAL_TIMER",
    "BACKWARD_REDUCE_MICRO_TIMER",
    "FORWARD_GLOBAL_TIMER",
    "FORWARD_MICRO_TIMER",
    "STEP_GLOBAL_TIMER",
    "STEP_MICRO_TIMER",
    "TIME_EPSILON",
    "CudaEventTimer",
    "NoopTimer",
    "SynchronizedWallClockTimer",
    "ThroughputTimer",
    "trim_mean",
]
