"""Unit strings and per-module totals of the FLOPs profiler (upstream's helper names), shared by the profiler and
its printed report."""

from __future__ import annotations

from torch import nn

DEFAULT_PRECISION = 2
_UNITS = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}


# --- strings ----------------------------------------------------------------------------------------------------------
def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``num`` scaled to an SI prefix: ``"1.2 G"`` (a space and the prefix, no unit)."""
    if units is None:
        units = next((u for u in ("T", "G", "M", "K") if num >= _UNITS[u]), None)
        if units is None:
            units = "" if num >= 1 or num == 0 else "m" if num >= 1e-3 else "u"
    magnitude = _UNITS.get(units, 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``"3.1 GMACs"``."""
    return f"{number_to_string(macs, units=units, precision=precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``"3.1 GFLOPS"``."""
    return f"{number_to_string(flops, units=units, precision=precision)}FLOPS"


def bytes_to_string(b: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``"2 GB"``."""
    return f"{number_to_string(b, units=units, precision=precision)}B"


def params_to_string(params_num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``"7 B"`` for seven billion (billions use ``B``, not ``G``)."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params_num, units=units, precision=precision).replace("G", "B").strip()


def duration_to_string(duration: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``"12.5 ms"``."""
    return f"{number_to_string(duration, units=units, precision=precision)}s"


# --- per-module sums --------------------------------------------------------------------------------------------------
def get_module_flops(module: nn.Module) -> int:
    """Forward flops of ``module`` and its submodules."""
    return int(getattr(module, "__flops__", 0)) + sum(get_module_flops(c) for c in module.children())


def get_module_macs(module: nn.Module) -> int:
    """Forward multiply-accumulates of ``module`` and its submodules."""
    return int(getattr(module, "__macs__", 0)) + sum(get_module_macs(c) for c in module.children())


def get_module_duration(module: nn.Module) -> float:
    """Forward seconds of ``module`` (the sum of its children's for a container that is never called)."""
    duration = float(getattr(module, "__duration__", 0.0))
    if duration == 0:
        duration = sum(get_module_duration(c) for c in module.children())
    return duration
