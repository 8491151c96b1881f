"""``deepspeed.profiling.flops_profiler``: ``FlopsProfiler``, ``get_model_profile`` and the string helpers.

The implementation lives in ``deepspeed/_core/observe/flops.py``.
"""

from __future__ import annotations

from deepspeed.profiling.flops_profiler.profiler import *  # noqa: F403 - upstream re-exports the module this way
from deepspeed.profiling.flops_profiler.profiler import __all__  # noqa: F401
