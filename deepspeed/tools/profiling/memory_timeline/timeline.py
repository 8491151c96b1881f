"""Live bytes per category over one recorded window, the deferred frees, and the JSON summary."""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any, NamedTuple

from .classify import Analysis, analyse, recording_meta
from .rules import GATHERED, PLOT_CATEGORIES


class Timeline(NamedTuple):
    """Live bytes per category after each allocation-changing event of one device's trace (a small record).

    Attributes:
        times: x of each point: microseconds since the first trace entry, or the entry index when the trace has
            no timestamps (see ``time_unit``). Point 0 is the state when recording started.
        time_unit: ``"us"`` or ``"entry"``.
        entry_index: trace index of each point (-1 for point 0).
        live: category -> live bytes at each point, for every name of :data:`PLOT_CATEGORIES`.
        total: live bytes over all categories at each point.
        peak_index: index (into the point arrays) of the first point where ``total`` is largest.
        phases: ``(name, x)`` marks the engine recorded (e.g. ``"after forward"``), in the units of ``times``.
    """

    times: array
    time_unit: str
    entry_index: array
    live: dict[str, array]
    total: array
    peak_index: int
    phases: list[tuple[str, float]]

    def at(self, index: int) -> dict[str, int]:
        """Live bytes per category at point ``index``."""
        return {c: int(v[index]) for c, v in self.live.items()}


def _deltas(analysis: Analysis) -> tuple[dict[str, int], dict[int, list[tuple[str, int]]]]:
    start = {c: 0 for c in PLOT_CATEGORIES}
    changes: dict[int, list[tuple[str, int]]] = {}
    for block in analysis.blocks:
        if block.alloc_index < 0:
            start[block.category] += block.size
        else:
            changes.setdefault(block.alloc_index, []).append((block.category, block.size))
        if block.free_completed is not None:
            changes.setdefault(block.free_completed, []).append((block.category, -block.size))
    return start, changes


def _timeline_from(analysis: Analysis) -> Timeline:
    start, changes = _deltas(analysis)
    t0 = analysis.times[0] if analysis.times else 0.0

    def x_of(i: int) -> float:
        return analysis.times[i] - t0 if analysis.times else float(i)

    live = {c: array("q", [start[c]]) for c in PLOT_CATEGORIES}
    current = dict(start)
    times, index, total = array("d", [0.0]), array("q", [-1]), array("q", [sum(start.values())])
    for i in sorted(changes):
        for category, delta in changes[i]:
            current[category] += delta
        for c in PLOT_CATEGORIES:
            live[c].append(current[c])
        times.append(x_of(i))
        index.append(i)
        total.append(sum(current.values()))
    peak = max(range(len(total)), key=total.__getitem__)
    # Phase marks carry wall-clock microseconds, like time_us; without timestamps they cannot be placed.
    phases = [(name, t - t0) for name, t in analysis.phases] if analysis.times else []
    return Timeline(times, "us" if analysis.times else "entry", index, live, total, peak, phases)


def build_timeline(snapshot: Mapping[str, Any], device: int = 0) -> Timeline:
    """Replay ``snapshot``'s trace on ``device`` into a :class:`Timeline` of live bytes per category."""
    return _timeline_from(analyse(snapshot, device))


# ----------------------------------------------------------------------------------------------------------------
# deferred frees and summary


def _deferred_from(analysis: Analysis) -> dict[str, Any]:
    # A free is deferred when the program went on (another alloc or free request) between the request and the
    # completion, or when it is still pending at the end. Timestamps alone cannot tell: adjacent entries can
    # differ by a microsecond.
    progress = array("q", [0])
    for entry in analysis.trace:
        progress.append(progress[-1] + (entry.get("action") in ("alloc", "free_requested")))
    out: dict[str, Any] = {
        "count": 0,
        "bytes": 0,
        "max_delay_entries": 0,
        "max_delay_us": None,
        "pending_at_end": 0,
        "gathered_count": 0,
        "gathered_bytes": 0,
    }
    for block in analysis.blocks:
        req, done = block.free_requested, block.free_completed
        if req is None:
            continue
        if done is not None and progress[done] - progress[req + 1] <= 0:
            continue
        out["count"] += 1
        out["bytes"] += block.size
        out["pending_at_end"] += done is None
        end = done if done is not None else len(analysis.trace) - 1
        out["max_delay_entries"] = max(out["max_delay_entries"], end - req)
        if analysis.times is not None:
            delay = analysis.times[end] - analysis.times[req]
            out["max_delay_us"] = max(out["max_delay_us"] or 0.0, delay)
        if block.category == GATHERED:
            out["gathered_count"] += 1
            out["gathered_bytes"] += block.size
    return out


def deferred_frees(snapshot: Mapping[str, Any], device: int = 0) -> dict[str, Any]:
    """Frees whose completion was deferred past later allocator activity (blocks marked as used by another stream).

    Returns ``count``, ``bytes``, ``max_delay_entries``, ``max_delay_us`` (None without timestamps),
    ``pending_at_end`` (requested but not completed when the snapshot was taken) and ``gathered_count`` /
    ``gathered_bytes`` (those among ``gathered parameters`` blocks). A stream-ordered design has none.
    """
    return _deferred_from(analyse(snapshot, device))


def _phase_before(timeline: Timeline, x: float) -> str | None:
    before = [name for name, t in timeline.phases if t <= x]
    return before[-1] if before else None


def _warnings(analysis: Analysis, max_entries: int | None) -> list[str]:
    notes = []
    if max_entries is not None and len(analysis.trace) >= max_entries:
        notes.append(
            f"the trace holds max_entries={max_entries} entries: the allocator's ring buffer probably "
            "dropped the oldest ones; raise memory_timeline.max_entries"
        )
    if analysis.anomalies.get("free_completed_without_request") or analysis.anomalies.get("alloc_of_live_address"):
        notes.append(f"inconsistent trace (entries missing): {analysis.anomalies}")
    if analysis.anomalies.get("oom"):
        notes.append(f"the allocator reported {analysis.anomalies['oom']} out-of-memory error(s) in the window")
    if not analysis.trace:
        notes.append("empty trace: was _record_memory_history(enabled='all') on for this device?")
    return notes


def summarize(snapshot: Mapping[str, Any], device: int = 0, unit_bytes: float | None = None) -> dict[str, Any]:
    """JSON-serialisable summary of the recorded window on ``device``.

    ``unit_bytes`` (bytes of one gathered layer) adds ``gathered_layers_alive_max_from_trace``: the most
    ``gathered parameters`` bytes alive at once divided by it.
    """
    analysis = analyse(snapshot, device)
    tl = _timeline_from(analysis)
    peak = tl.peak_index
    gathered_max = max(tl.live[GATHERED]) if len(tl.total) else 0
    early = [b for b in analysis.blocks if b.alloc_index < 0 and b.free_requested is not None]
    return {
        "device": device,
        "events": len(analysis.trace),
        "time_unit": tl.time_unit,
        "duration": tl.times[-1],
        "peak_allocated_bytes": int(tl.total[peak]),
        "peak_time": tl.times[peak],
        "peak_entry_index": int(tl.entry_index[peak]),
        "peak_after_phase": _phase_before(tl, tl.times[peak]),
        "peak_by_category": tl.at(peak),
        "max_by_category": {c: int(max(v)) for c, v in tl.live.items()},
        "start_by_category": tl.at(0),
        "end_by_category": tl.at(len(tl.total) - 1),
        "gathered_max_bytes": int(gathered_max),
        "unit_bytes": unit_bytes,
        "gathered_layers_alive_max_from_trace": (gathered_max / unit_bytes) if unit_bytes else None,
        "deferred_frees": _deferred_from(analysis),
        "freed_blocks_from_before_recording": {"count": len(early), "bytes": sum(b.size for b in early)},
        "phases": [{"name": n, "time": t} for n, t in tl.phases],
        "warnings": _warnings(analysis, recording_meta(snapshot).get("max_entries")),
    }
