"""The one bucketed gradient reducer of every ZeRO stage: buckets, launch order, in-flight bound, collectives.

Stage 0, ZeRO-1/2 and ZeRO-3 differ in what a bucket holds and where its reduced values go, not in how
buckets are scheduled. That difference is a :class:`BucketIO` (``replicas.py`` for stage 0, ``partitions.py``
for ZeRO-1/2, ``shard_rows.py`` for ZeRO-3); :class:`GradReducer` does the rest, in one of three
:class:`ReduceMode` s, through the split-phase collectives of ``deepspeed/_core/comm/collectives.py``.

[Note: launch order] Every rank must issue the same collectives in the same sequence, even when its
parameters receive gradients in a different order or not at all. Buckets therefore launch strictly in one
order, the same on every rank: a bucket is started once it is complete *and* every bucket before it has been
started (the "ready prefix"); at the end of the backward whatever is left is started in that order (a bucket
none of whose parameters got a gradient reduces zeros). Two bucket plans share this loop:

- a static plan (stage 0, ZeRO-1/2): buckets are fixed at construction in reverse parameter order, roughly
  the order autograd produces gradients; a bucket is complete when each of its parameters has reported;
- arrival order (ZeRO-3): gradients are appended to one open bucket in the order the parameter manager hands
  them over (the same on every rank, the backward being the same program), and the bucket is complete once it
  holds ``bucket_numel`` elements, or (``ReducerConfig.unit_buckets``) only when the caller closes it
  (:meth:`GradReducer.close_bucket`, at the end of each fetch unit's backward); it is then the next in order by
  construction.

``max_in_flight`` bounds the buckets alive at once, counting the one being filled: after each start the oldest
started buckets are finished until at most ``max_in_flight - 1`` remain (2 with ``overlap_comm``: one reduces
while the next fills; 1 without). Stage 0 keeps every bucket in flight until the end of the backward
(``None``), as it always has.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from deepspeed._core.comm.collectives import (
    ReduceResult,
    finish_reduce,
    start_all_reduce,
    start_reduce_scatter,
    start_reduce_to_owners,
)
from deepspeed._core.grads.scaling import ReduceScaling
from deepspeed._core.layout.shards import ParamSlot, Range, plan_buckets


class ReduceMode(enum.Enum):
    """Which collective reduces a bucket.

    ``ALL_REDUCE``: every rank gets the full sum (stage 0; ZeRO-1/2 without ``reduce_scatter``).
    ``TO_OWNERS``: each range's sum goes to the rank owning it (ZeRO-1/2 with ``reduce_scatter``).
    ``REDUCE_SCATTER``: the bucket is ``(world, width)`` rank-major rows and rank ``r`` gets row ``r`` summed
    (ZeRO-3, [Note: zero3-grads]).
    """

    ALL_REDUCE = "all_reduce"
    TO_OWNERS = "to_owners"
    REDUCE_SCATTER = "reduce_scatter"


class ReducePhase(enum.Enum):
    """Whether a backward's gradients are reduced (a boundary micro-step, or every one for ZeRO-2) or only
    accumulated."""

    REDUCE = "reduce"
    SKIP = "skip"


class MicroStepKind(enum.Enum):
    """What the coming backward must do with gradients (the engine decides it; the reducers act on it)."""

    ACCUMULATE = "accumulate"  # keep accumulating locally
    REDUCE = "reduce"  # last micro-step of the window: reduce across data-parallel ranks


@dataclass
class Bucket:
    """One gradient bucket: its members, its staging buffer and its collective.

    A statically planned bucket names its members by ``slots`` (indices into group ``group``'s parameters)
    spanning ``range`` of the group; an arrival-order bucket lists what was added in ``entries``.
    """

    index: int
    group: int = 0
    slots: tuple[int, ...] = ()
    range: Range = Range(0, 0)
    pending: int = 0  # members that have not reported yet (static plan)
    ready: set[int] = field(default_factory=set)
    entries: list[Any] = field(default_factory=list)  # arrival order: what the bucket holds until its start
    numel: int = 0  # arrival order: elements added so far
    data: torch.Tensor | None = None  # staging buffer; reduced in place by ALL_REDUCE and TO_OWNERS
    result: ReduceResult | None = None  # set from start to finish
    targets: list[Any] = field(default_factory=list)  # where the reduced values go (the BucketIO's business)


class BucketIO(Protocol):
    """What a bucket holds and where its reduced values go: the part of a gradient pipeline that is stage-specific."""

    def wire(self, bucket: Bucket) -> torch.Tensor | None:
        """The bucket's values in the wire dtype, ready to be pre-scaled and reduced (``(world, width)`` rows for
        ``REDUCE_SCATTER``); ``None`` when the reduction is the identity and the values already reached their
        home (one rank)."""

    def owners(self, bucket: Bucket) -> list[tuple[int, Range]]:
        """``TO_OWNERS``: ``(group rank, range of the wire tensor)`` per owner of part of the bucket."""

    def process_group(self, bucket: Bucket) -> Any:
        """The process group the bucket is reduced over."""

    def kept(self, bucket: Bucket, reduced: torch.Tensor) -> torch.Tensor | None:
        """The part of the reduced values this rank keeps (post-scaled in place by the reducer), or ``None``."""

    def deliver(self, bucket: Bucket, kept: torch.Tensor) -> None:
        """Move the kept, scaled values to their home."""


@dataclass(frozen=True)
class ReducerConfig:
    """Static settings of a :class:`GradReducer`.

    ``max_in_flight``: bucket buffers alive at once, counting the one being filled ([Note: launch order]);
    ``None`` leaves every started bucket in flight until :meth:`GradReducer.finish`. ``unit_buckets`` (arrival
    order only): ``bucket_numel`` sets no limit, a bucket closes only through :meth:`GradReducer.close_bucket`.
    """

    mode: ReduceMode
    bucket_numel: int
    comm_dtype: torch.dtype
    scaling: ReduceScaling
    max_in_flight: int | None = 1
    unit_buckets: bool = False


class GradReducer:
    """Reduces gradient buckets in one global launch order with a bounded number in flight.

    Args:
        io: the stage-specific half (:class:`BucketIO`).
        config: mode, bucket size, wire dtype, scaling and in-flight bound.
        buckets: a static plan (see :func:`plan_static`), or ``None`` for arrival-order buckets
            (:meth:`add`).
        observer: optional callback ``(event, bucket_index)``: "launched" and "reduced" (and whatever the
            ``io`` reports, e.g. "staging_alloc"), for tests and memory accounting.
    """

    def __init__(
        self,
        io: BucketIO,
        config: ReducerConfig,
        buckets: Sequence[Bucket] | None = None,
        observer: Callable[[str, int], None] | None = None,
    ) -> None:
        self.io = io
        self.config = config
        self.static = buckets is not None
        self.buckets: list[Bucket] = list(buckets) if buckets is not None else []
        self.observer = observer or (lambda event, index: None)
        self.open = Bucket(0)  # arrival order: the bucket being filled
        self.reducing = not self.static  # arrival-order buckets reduce every backward
        self._next_launch = 0
        self._in_flight: list[Bucket] = []

    @property
    def in_flight(self) -> int:
        """Buckets started and not finished yet."""
        return len(self._in_flight)

    # --- one backward ---------------------------------------------------------------------------------
    def begin(self, reducing: ReducePhase) -> None:
        """Start a backward; ``ReducePhase.SKIP`` makes reports only bookkeeping (nothing launches)."""
        self.reducing = reducing is ReducePhase.REDUCE
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.slots)
            bucket.ready.clear()

    def mark_ready(self, bucket_index: int, member: int) -> None:
        """Static plan: member ``member`` of bucket ``bucket_index`` has its gradient; start the ready prefix."""
        bucket = self.buckets[bucket_index]
        if not self.reducing or member in bucket.ready:
            return
        bucket.ready.add(member)
        bucket.pending -= 1
        self._launch_ready_prefix()

    def add(self, entry: Any, numel: int) -> None:
        """Arrival order: append ``entry`` (``numel`` elements) to the open bucket; a full bucket starts."""
        self.open.entries.append(entry)
        self.open.numel += numel
        if not self.config.unit_buckets and self.open.numel >= self.config.bucket_numel:
            self.close_bucket()

    def close_bucket(self) -> None:
        """Arrival order: the open bucket is complete; it starts if it holds anything (a no-op otherwise)."""
        bucket, self.open = self.open, Bucket(self.open.index + 1)
        if bucket.entries:
            self.buckets.append(bucket)
            self._launch_ready_prefix()

    def _launch_ready_prefix(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            # The started bucket's wire tensor stays referenced while older buckets finish: the reduce-scatter
            # rows are otherwise dropped at the start, and their bytes must not be reused by those folds.
            wire = self._start(self.buckets[self._next_launch])
            self._next_launch += 1
            self._drain(None if self.config.max_in_flight is None else self.config.max_in_flight - 1)
            del wire

    def _drain(self, keep: int | None) -> None:
        """Finish the oldest started buckets until at most ``keep`` remain in flight (bounds staging memory)."""
        while keep is not None and len(self._in_flight) > keep:
            self._finish(self._in_flight.pop(0))

    def finish(self) -> None:
        """End of a backward: start what is left, in order, and finish everything."""
        if not self.reducing:
            return
        if not self.static:
            self.close_bucket()
        for bucket in self.buckets[self._next_launch :]:
            self._start(bucket)
            self._drain(self.config.max_in_flight)
        self._next_launch = len(self.buckets)
        self._drain(0)
        self.reducing = not self.static
        if not self.static:
            self.buckets, self._next_launch = [], 0

    def discard(self) -> None:
        """Drop every bucket without delivering it (after an overflow, ``zero_grad`` or destroy)."""
        for bucket in self.buckets:
            if bucket.result is not None:
                finish_reduce(bucket.result)
            bucket.data, bucket.result = None, None
        self.open = Bucket(self.open.index + 1)
        self._in_flight.clear()
        self.reducing = not self.static
        if not self.static:
            self.buckets, self._next_launch = [], 0

    # --- one bucket -----------------------------------------------------------------------------------
    def _start(self, bucket: Bucket) -> torch.Tensor | None:
        """Issue ``bucket``'s collective; returns the tensor it reads (``None`` for the identity reduction)."""
        data = self.io.wire(bucket)
        if data is None:  # the identity reduction: the io already put the values home
            self.observer("launched", bucket.index)
            self.observer("reduced", bucket.index)
            return None
        if self.config.scaling.pre != 1.0:
            data.mul_(self.config.scaling.pre)
        group = self.io.process_group(bucket)
        mode = self.config.mode
        if mode is ReduceMode.ALL_REDUCE:
            bucket.result = start_all_reduce(data, group)
        elif mode is ReduceMode.TO_OWNERS:
            bucket.result = start_reduce_to_owners(data, self.io.owners(bucket), group)
        else:
            bucket.result = start_reduce_scatter(data, group)
        # The in-place modes read the reduced values from the staging buffer itself; the reduce-scatter's rows
        # are dropped here, as soon as the collective holds them, and only its output stays.
        bucket.data = data if mode is not ReduceMode.REDUCE_SCATTER else None
        self._in_flight.append(bucket)
        self.observer("launched", bucket.index)
        return data

    def _finish(self, bucket: Bucket) -> None:
        assert bucket.result is not None
        reduced = finish_reduce(bucket.result)
        kept = self.io.kept(bucket, reduced)
        if kept is not None:
            if self.config.scaling.post != 1.0:
                kept.mul_(self.config.scaling.post)
            self.io.deliver(bucket, kept)
        bucket.data, bucket.result, bucket.targets = None, None, []
        self.observer("reduced", bucket.index)


def plan_static(groups: Sequence[Sequence[ParamSlot]], bucket_numel: int) -> list[Bucket]:
    """Buckets of at most ``bucket_numel`` elements over the slots of ``groups`` (last group first, each in
    reverse slot order: :func:`~deepspeed._core.layout.shards.plan_buckets`); a bucket never spans two groups.
    Each bucket's ``range`` spans its slots."""
    buckets: list[Bucket] = []
    for g in reversed(range(len(groups))):
        slots = groups[g]
        for planned in plan_buckets(slots, max(1, bucket_numel)):
            members = [slots[i] for i in planned.slot_indices]
            span = Range(min(s.offset for s in members), max(s.range.end for s in members))
            buckets.append(Bucket(len(buckets), g, planned.slot_indices, span))
    return buckets
