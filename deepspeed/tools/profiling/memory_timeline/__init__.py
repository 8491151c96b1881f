"""Per-step device-memory timeline by category, from a PyTorch CUDA allocator snapshot (config ``memory_timeline``).

The engine records the allocator history of one optimizer step and writes the snapshot (``deepspeed/_core/engine/
memory.py``); this package analyses it: which category every block belongs to (:mod:`.rules`, :mod:`.classify`),
live bytes per category over the window with the deferred frees and a JSON summary (:mod:`.timeline`), the chart
(:mod:`.plot`), the addresses stored at recording time (:mod:`.hints`), what the engine façade hands the core
(:mod:`.report`) and the command line (:mod:`.cli`, ``python -m deepspeed.tools.profiling.memory_timeline``).

The package is pure: standard library only (matplotlib is imported inside :func:`plot_timeline`), with relative
imports only, so benchmark workers running any DeepSpeed -- or none -- can load it by path: a spec for this
``__init__.py`` with ``submodule_search_locations`` set to this directory, registered in ``sys.modules`` under a
name of their own before it is executed (the relative imports resolve through that entry).
"""

from __future__ import annotations

from .classify import classify
from .cli import main
from .hints import tensor_hints
from .plot import MatplotlibMissingError, plot_timeline
from .report import Report, TimelineAnalyser
from .rules import (
    ALLOC_RULES,
    BACKWARD_RULES,
    BEFORE_RECORDING,
    CATEGORIES,
    FREE_RULES,
    HELPER,
    HELPER_RULES,
    OURS,
    PLOT_CATEGORIES,
    Rule,
)
from .timeline import Timeline, build_timeline, deferred_frees, summarize

__all__ = [
    "ALLOC_RULES",
    "BACKWARD_RULES",
    "BEFORE_RECORDING",
    "CATEGORIES",
    "FREE_RULES",
    "HELPER",
    "HELPER_RULES",
    "OURS",
    "PLOT_CATEGORIES",
    "MatplotlibMissingError",
    "Report",
    "Rule",
    "Timeline",
    "TimelineAnalyser",
    "build_timeline",
    "classify",
    "deferred_frees",
    "main",
    "plot_timeline",
    "summarize",
    "tensor_hints",
]
