"""Trace-based prefetch: record the order units are fetched in one step, replay it in later steps.

Pure bookkeeping over unit ids and sizes (no tensors, no process group), so it is tested with fake sizes. The
manager calls :meth:`StepTrace.begin_step` at the root module's forward, :meth:`StepTrace.observe` at every
fetch, then asks :meth:`StepTrace.prefetch_candidates` which units to start gathering and, at release,
:meth:`StepTrace.reused_soon` whether to keep a unit. Both answers are bounded by one element budget, so the
gathered units alive at a module boundary are the active ones plus at most one prefetch window, however far the
host runs ahead ([Note: zero3-prefetch] in ``docs/design/zero3.md``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from deepspeed._core.config.plan import Stage3Policy
from deepspeed._foundation.logging import logger


class TraceMode(enum.Enum):
    """Trace state (upstream ``ZeRoTraceMode`` values)."""

    RECORD = 1
    COMPLETE = 2
    INVALID = 3


@dataclass(frozen=True)
class PrefetchBudget:
    """Element budgets of the prefetcher.

    Attributes:
        prefetch_numel: elements of not-yet-needed units that may be gathered ahead (the prefetch window).
        max_live_numel: cap on gathered elements (active units included) when deciding to prefetch.
        reuse_numel: a released unit stays gathered only if it is needed again within this many elements of
            upcoming fetches; never more than ``prefetch_numel``, so what is kept shares the prefetch window.
        whole_unit_numel: the next upcoming unit is prefetched whole, even when it is larger than the window, if
            it holds at most this many elements (0: never). Units are gathered whole, so a window smaller than
            one leaf unit would prefetch nothing ([Note: zero3-prefetch]).
    """

    prefetch_numel: int
    max_live_numel: int
    reuse_numel: int
    whole_unit_numel: int = 0

    @classmethod
    def from_policy(cls, policy: Stage3Policy, whole_unit_numel: int = 0) -> PrefetchBudget:
        """Budgets from ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``, ``..._max_reuse_distance``
        (``whole_unit_numel``: see the attribute)."""
        window = max(0, int(policy.prefetch_bucket_size))
        return cls(
            window,
            max(0, int(policy.max_live_parameters)),
            min(window, max(0, int(policy.max_reuse_distance))),
            max(0, int(whole_unit_numel)),
        )


SizeOf = Callable[[int], int]
IsGathered = Callable[[int], bool]


class StepTrace:
    """The fetch order of one training step and the replay position in the current step."""

    def __init__(self, budget: PrefetchBudget) -> None:
        """Start in ``INVALID``: the first step records."""
        self.budget = budget
        self.mode = TraceMode.INVALID
        self.order: list[int] = []
        self.position = 0
        self.invalidations = 0

    def begin_step(self) -> None:
        """Start a step: a recorded trace becomes ``COMPLETE``; an invalid one starts recording."""
        if self.mode is TraceMode.RECORD and self.order:
            self.mode = TraceMode.COMPLETE
        elif self.mode is TraceMode.INVALID:
            self.mode = TraceMode.RECORD
            self.order = []
        self.position = 0

    def observe(self, unit_id: int) -> None:
        """A unit is being fetched: record it, or check it against the trace (a mismatch invalidates)."""
        if self.mode is TraceMode.RECORD:
            self.order.append(unit_id)
        elif self.mode is TraceMode.COMPLETE:
            expected = self.order[self.position] if self.position < len(self.order) else None
            if expected != unit_id:
                self.invalidate(f"expected unit {expected}, got {unit_id} at position {self.position}")
        self.position += 1

    def invalidate(self, reason: str) -> None:
        """Drop the trace (the fetch order changed); recording restarts at the next step."""
        logger.debug("ZeRO-3 prefetch trace invalidated: %s", reason)
        self.mode = TraceMode.INVALID
        self.invalidations += 1

    def _upcoming(self) -> list[int]:
        if self.mode is not TraceMode.COMPLETE:
            return []
        return self.order[self.position :]

    def upcoming(self) -> list[int]:
        """The unit ids the trace says are fetched after the current position (empty while recording)."""
        return self._upcoming()

    def prefetch_candidates(
        self, size_of: SizeOf, is_gathered: IsGathered, live_numel: int | Callable[[], int]
    ) -> list[int]:
        """Units to start gathering now, in trace order.

        Walks upcoming units, charging every distinct one (already gathered or not) to the prefetch window,
        and stops when the window or ``max_live_numel`` would be exceeded; the next unit alone may exceed the
        window up to ``whole_unit_numel``. ``live_numel`` may be a callable:
        it is then evaluated only once a candidate fits the window (counting live memory walks every
        parameter, which dominated the fetch path's Python time when the window is smaller than a layer).
        """
        window = 0
        live: int | None = live_numel if isinstance(live_numel, int) else None
        seen: set[int] = set()
        chosen: list[int] = []
        for unit_id in self._upcoming():
            if unit_id in seen:
                continue
            seen.add(unit_id)
            size = size_of(unit_id)
            window += size
            allowance = self.budget.prefetch_numel
            if len(seen) == 1 and allowance > 0 and size <= self.budget.whole_unit_numel:
                allowance = max(allowance, size)  # the next unit, whole: a leaf larger than the window
            if window > allowance:
                break
            if is_gathered(unit_id):
                continue
            if live is None:
                live = live_numel()  # type: ignore[operator]
            if live + size > self.budget.max_live_numel:
                break
            live += size
            chosen.append(unit_id)
        return chosen

    def reused_soon(self, unit_id: int, size_of: SizeOf) -> bool:
        """Whether ``unit_id`` is fetched again within ``reuse_numel`` elements of upcoming fetches."""
        distance = 0
        seen: set[int] = set()
        for upcoming in self._upcoming():
            if upcoming == unit_id:
                return distance + size_of(unit_id) <= self.budget.reuse_numel
            if upcoming in seen:
                continue
            seen.add(upcoming)
            distance += size_of(upcoming)
            if distance > self.budget.reuse_numel:
                return False
        return False
