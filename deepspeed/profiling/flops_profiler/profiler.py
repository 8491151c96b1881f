"""``deepspeed.profiling.flops_profiler.profiler``: the FLOPs profiler under upstream's module path.

The implementation lives in ``deepspeed/_core/observe/flops.py`` (counting) and ``flops_report.py`` (the report).
"""

from __future__ import annotations

from deepspeed._core.observe.flops import (
    DEFAULT_PRECISION,
    MODULE_HOOK_MAPPING,
    FlopsProfiler,
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    get_model_profile,
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
