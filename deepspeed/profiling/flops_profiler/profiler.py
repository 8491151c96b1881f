"""``deepspeed.profiling.flops_profiler.profiler``: the FLOPs profiler under upstream's module path.

The implementation lives in ``deepspeed/_core/observe/flops.py`` (counting), ``flops_units.py`` (unit strings and
per-module totals) and ``flops_report.py`` (the report).
"""

from __future__ import annotations

from deepspeed._core.observe.flops import MODULE_HOOK_MAPPING, FlopsProfiler, get_model_profile
from deepspeed._core.observe.flops_units import (
    DEFAULT_PRECISION,
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    get_module_duration,
    get_module_flops,
    get_module_macs,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "DEFAULT_PRECISION",
    "MODULE_HOOK_MAPPING",
    "FlopsProfiler",
    "bytes_to_string",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "get_module_duration",
    "get_module_flops",
    "get_module_macs",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
