"""The stacked-area chart of a :class:`~.timeline.Timeline` (matplotlib, imported only when a chart is drawn)."""

from __future__ import annotations

from collections.abc import Sequence

from .rules import BEFORE_RECORDING, PLOT_CATEGORIES
from .timeline import Timeline

_STACK_ORDER = (
    BEFORE_RECORDING,
    "parameters",
    "optimizer state",
    "gradients",
    "gathered parameters",
    "activations",
    "buffers",
)  # chart bottom to top: long-lived state first, transients on top
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#d62728", "#8c564b", "#7f7f7f")
_COLORS = dict(zip(PLOT_CATEGORIES, _PALETTE, strict=True))  # strict: a new category needs its own colour


class MatplotlibMissingError(RuntimeError):
    """Raised by :func:`plot_timeline` when matplotlib is not installed."""


def _downsample(n: int, total: Sequence[int], limit: int) -> list[int]:
    """Indices of at most ~``limit`` points: the largest ``total`` of each stretch, so the peak survives."""
    if n <= limit:
        return list(range(n))
    stride = -(-n // limit)
    keep = [max(range(lo, min(lo + stride, n)), key=total.__getitem__) for lo in range(0, n, stride)]
    return sorted(set(keep) | {0, n - 1})


def plot_timeline(timeline: Timeline, png_path: str, title: str = "") -> None:
    """Write a stacked-area chart of ``timeline`` (GiB per category over time, peak marked) to ``png_path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise MatplotlibMissingError("plot_timeline needs matplotlib: pip install matplotlib") from err
    keep = _downsample(len(timeline.total), timeline.total, 20_000)
    ms = timeline.time_unit == "us"
    xs = [timeline.times[i] / 1000.0 if ms else timeline.times[i] for i in keep]
    bands = [c for c in _STACK_ORDER if any(timeline.live[c])]
    ys = [[timeline.live[c][i] / 2**30 for i in keep] for c in bands]
    fig = Figure(figsize=(13, 6.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if bands:
        ax.stackplot(xs, ys, labels=bands, colors=[_COLORS[c] for c in bands], step="post", alpha=0.85)
    peak_x = timeline.times[timeline.peak_index] / (1000.0 if ms else 1.0)
    peak_gib = timeline.total[timeline.peak_index] / 2**30
    ax.axvline(peak_x, color="black", linestyle="--", linewidth=1)
    ax.annotate(f"peak {peak_gib:.3f} GiB", (peak_x, peak_gib), textcoords="offset points", xytext=(6, 6))
    for name, x in timeline.phases:
        xv = x / 1000.0 if ms else x
        if xs and xs[0] <= xv <= xs[-1]:
            ax.axvline(xv, color="grey", linewidth=0.8, linestyle=":")
            ax.text(xv, ax.get_ylim()[1] * 0.98, name, rotation=90, va="top", ha="right", fontsize=8)
    ax.set_xlabel("time since recording started (ms)" if ms else "allocator trace entry")
    ax.set_ylabel("allocated (GiB)")
    ax.set_title(title or "device memory by category")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
