"""What the engine façade plugs into the core's allocator-history recorder (config ``memory_timeline``).

The core (``deepspeed/_core/engine/memory.py``) records one step's allocator history and writes the snapshot; it
asks a ``SnapshotAnalyser`` it is given for the ``category_hints`` to store in the snapshot and for the report
files. :class:`TimelineAnalyser` is that analyser; the core never imports this package.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from .hints import tensor_hints
from .plot import MatplotlibMissingError, plot_timeline
from .timeline import build_timeline, summarize


class Report(NamedTuple):
    """The summary of one recorded step, the files written for it, and the files skipped (with the reason)."""

    summary: dict[str, Any]
    files: list[str]
    skipped: list[str]


class TimelineAnalyser:
    """Hints at recording time, then ``<prefix>.json`` (the summary) and ``<prefix>.png`` (the chart)."""

    def tensor_hints(self, module: Any, optimizer: Any) -> list[dict[str, Any]]:
        """Device addresses of ``module``'s and ``optimizer``'s state, by category (see :func:`.hints.tensor_hints`)."""
        return tensor_hints(module, optimizer)

    def write_report(self, snapshot: Mapping[str, Any], device: int, prefix: str, title: str) -> Report:
        """Write the summary of ``snapshot`` on ``device`` to ``<prefix>.json`` and its chart to ``<prefix>.png``
        (skipped, and said so, without matplotlib)."""
        summary = summarize(snapshot, device)
        json_path, png_path = prefix + ".json", prefix + ".png"
        with open(json_path, "w") as fd:
            fd.write(json.dumps(summary, indent=2) + "\n")
        try:
            plot_timeline(build_timeline(snapshot, device), png_path, title=title)
        except MatplotlibMissingError as err:
            return Report(summary, [json_path], [f"{png_path} ({err})"])
        return Report(summary, [json_path, png_path], [])
