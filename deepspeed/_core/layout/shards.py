"""Pure shard arithmetic for ZeRO: which rank owns which ``[start, end)`` of which flat group.

Everything here is a pure function of parameter sizes, the world size and a few integers. Nothing allocates
memory, touches a device or a process group, so every rank computes the identical layout and all of it can be
unit-tested on a CPU over hundreds of shapes. The rules (alignment, tail padding, checkpoint compatibility,
segments for the in-place flatten, bucket order) are written down once in [Note: layout]
(``docs/design/layout.md``) and cited from here.

Units: every size and offset is a count of *elements* of the flat group's dtype, never bytes.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

DEFAULT_PARTITION_ALIGNMENT = 2
"""Elements each ZeRO-1/2 partition is a multiple of; 2 reproduces upstream's ``2 * world_size`` group alignment."""


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for non-negative integers, without floating point."""
    return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= value``."""
    return ceil_div(value, multiple) * multiple


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Range:
    """Half-open element interval ``[start, end)``; empty when ``start == end``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"Range end {self.end} precedes start {self.start}")

    @property
    def size(self) -> int:
        """Number of elements in the interval."""
        return self.end - self.start

    @property
    def is_empty(self) -> bool:
        """True when the interval holds no element."""
        return self.end == self.start

    def intersect(self, other: Range) -> Range:
        """The overlap of two intervals; an empty range (anchored at the larger start) when disjoint."""
        start = max(self.start, other.start)
        return Range(start, max(start, min(self.end, other.end)))

    def shift(self, delta: int) -> Range:
        """The same interval moved by ``delta`` elements (negative moves left: global -> local coordinates)."""
        return Range(self.start + delta, self.end + delta)

    def contains(self, other: Range) -> bool:
        """True when ``other`` lies entirely inside this interval (an empty ``other`` must sit within bounds)."""
        return self.start <= other.start and other.end <= self.end

    def as_slice(self) -> slice:
        """A ``slice`` for indexing a 1-D tensor or sequence."""
        return slice(self.start, self.end)


@dataclass(frozen=True)
class ParamSlot:
    """A parameter's place in a flat group: its position ``index``, shape and ``[offset, offset + numel)``."""

    index: int
    shape: tuple[int, ...]
    numel: int
    offset: int
    name: str | None = None

    @property
    def range(self) -> Range:
        """The slot's element interval in the group's (logical) flat address space."""
        return Range(self.offset, self.offset + self.numel)


def make_slots(shapes: Sequence[Sequence[int]], names: Sequence[str] | None = None) -> tuple[ParamSlot, ...]:
    """Pack parameters back to back, in the given order, with no padding between them.

    Packing without gaps is what ``zero_to_fp32`` assumes when it slices params out of the concatenated
    partitions ([Note: layout], "Alignment decision").
    """
    if names is not None and len(names) != len(shapes):
        raise ValueError(f"names has {len(names)} entries but shapes has {len(shapes)}")
    slots = []
    offset = 0
    for index, shape in enumerate(shapes):
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"shape {dims} of param {index} has a negative dimension")
        numel = math.prod(dims)
        slots.append(ParamSlot(index, dims, numel, offset, None if names is None else names[index]))
        offset += numel
    return tuple(slots)


@dataclass(frozen=True)
class Fragment:
    """The part of one parameter that falls inside one rank's partition.

    Attributes:
        slot: the parameter.
        param_range: elements of the flattened parameter, ``[0, slot.numel)`` coordinates.
        partition_range: where those elements sit in the rank's partition, ``[0, partition_numel)`` coordinates.
    """

    slot: ParamSlot
    param_range: Range
    partition_range: Range

    @property
    def group_range(self) -> Range:
        """The fragment's interval in the group's flat address space."""
        return self.param_range.shift(self.slot.offset)


@dataclass(frozen=True)
class GroupLayout:
    """ZeRO-1/2 layout of one parameter group at one world size ([Note: layout], "Stage 1/2").

    The group is the slots packed back to back (``numel`` elements) followed by ``padding`` zero elements, so
    that ``padded_numel`` splits into ``world_size`` equal partitions of ``partition_numel`` elements, each a
    multiple of ``partition_alignment``. Rank ``r`` owns ``[r * partition_numel, (r + 1) * partition_numel)``.
    """

    slots: tuple[ParamSlot, ...]
    world_size: int
    partition_alignment: int = DEFAULT_PARTITION_ALIGNMENT

    def __post_init__(self) -> None:
        _require_positive("world_size", self.world_size)
        _require_positive("partition_alignment", self.partition_alignment)
        expected = 0
        for position, slot in enumerate(self.slots):
            if slot.index != position or slot.offset != expected:
                raise ValueError(f"slot {position} is not packed: index {slot.index}, offset {slot.offset}")
            expected += slot.numel

    @property
    def numel(self) -> int:
        """Elements of real parameter data (no padding)."""
        return self.slots[-1].range.end if self.slots else 0

    @property
    def padded_numel(self) -> int:
        """Group size after tail padding: a multiple of ``world_size * partition_alignment``."""
        return round_up(self.numel, self.world_size * self.partition_alignment)

    @property
    def padding(self) -> int:
        """Zero elements appended after the last parameter."""
        return self.padded_numel - self.numel

    @property
    def partition_numel(self) -> int:
        """Elements owned by each rank (identical on every rank)."""
        return self.padded_numel // self.world_size

    @cached_property
    def _ends(self) -> tuple[int, ...]:
        return tuple(slot.range.end for slot in self.slots)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")

    def partition(self, rank: int) -> Range:
        """The interval of the padded group owned by ``rank``."""
        self._check_rank(rank)
        return Range(rank * self.partition_numel, (rank + 1) * self.partition_numel)

    def valid_range(self, rank: int) -> Range:
        """The part of ``rank``'s partition that holds parameter data (what a checkpoint saves for the rank)."""
        return self.partition(rank).intersect(Range(0, self.numel))

    def padding_in_partition(self, rank: int) -> int:
        """Padding elements inside ``rank``'s partition (only trailing ranks have any)."""
        return self.partition_numel - self.valid_range(rank).size

    def upstream_group_padding(self, rank: int) -> int:
        """Upstream's ``group_paddings`` entry: the whole tail padding on the last rank, 0 elsewhere."""
        self._check_rank(rank)
        return self.padding if rank == self.world_size - 1 else 0

    def slots_overlapping(self, rng: Range) -> tuple[ParamSlot, ...]:
        """Slots with at least one element inside ``rng`` (group coordinates), in order."""
        if rng.is_empty:
            return ()
        first = bisect.bisect_right(self._ends, rng.start)
        found = []
        for slot in self.slots[first:]:
            if slot.offset >= rng.end:
                break
            if slot.numel:
                found.append(slot)
        return tuple(found)

    def params_in_partition(self, rank: int) -> tuple[Fragment, ...]:
        """The fragments of every parameter that ``rank`` owns, in flat order (a param may straddle ranks)."""
        part = self.partition(rank)
        fragments = []
        for slot in self.slots_overlapping(part):
            overlap = slot.range.intersect(part)
            fragments.append(Fragment(slot, overlap.shift(-slot.offset), overlap.shift(-part.start)))
        return tuple(fragments)

    def owner_ranks(self, slot: ParamSlot) -> range:
        """Ranks owning at least one element of ``slot`` (an empty range for a zero-element param)."""
        if slot.numel == 0:
            return range(0)
        first = slot.offset // self.partition_numel
        last = (slot.range.end - 1) // self.partition_numel
        return range(first, last + 1)


def plan_group(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    *,
    partition_alignment: int = DEFAULT_PARTITION_ALIGNMENT,
    names: Sequence[str] | None = None,
) -> GroupLayout:
    """Build the ZeRO-1/2 layout of one param group from parameter shapes in flat (registration) order."""
    return GroupLayout(make_slots(shapes, names), world_size, partition_alignment)


def partition_windows(layout: GroupLayout, window_numel: int) -> tuple[Range, ...]:
    """Tile ``[0, partition_numel)`` into windows of at most ``window_numel`` elements.

    Window ``w`` is the same interval inside every rank's partition, so one all-gather per window rebuilds
    ``world_size * window`` elements; callers pass ``allgather_bucket_size // world_size``.
    """
    _require_positive("window_numel", window_numel)
    size = layout.partition_numel
    return tuple(Range(start, min(start + window_numel, size)) for start in range(0, size, window_numel))


@dataclass(frozen=True)
class Chunk:
    """A run of consecutive slots ``slots`` (slot-index interval) covering ``range`` of the flat group."""

    index: int
    slots: Range
    range: Range


def plan_chunks(slots: Sequence[ParamSlot], chunk_numel: int) -> tuple[Chunk, ...]:
    """Greedily group consecutive, packed slots into runs of at most ``chunk_numel`` elements.

    A slot larger than ``chunk_numel`` forms a chunk of its own. Every slot lands in exactly one chunk, and the
    chunks tile ``[slots[0].offset, slots[-1].range.end)`` in order.
    """
    _require_positive("chunk_numel", chunk_numel)
    chunks: list[Chunk] = []
    first = 0
    for position in range(1, len(slots) + 1):
        at_end = position == len(slots)
        if not at_end and slots[position].range.end - slots[first].offset <= chunk_numel:
            continue
        span = Range(slots[first].offset, slots[position - 1].range.end)
        chunks.append(Chunk(len(chunks), Range(slots[first].index, slots[position - 1].index + 1), span))
        first = position
    return tuple(chunks)


@dataclass(frozen=True)
class Bucket:
    """Slots reduced together, listed in the order their gradients are expected to become ready."""

    index: int
    slot_indices: tuple[int, ...]
    numel: int


def plan_buckets(
    slots: Sequence[ParamSlot], bucket_numel: int, order: Sequence[int] | None = None
) -> tuple[Bucket, ...]:
    """Group slots into gradient-reduction buckets of at most ``bucket_numel`` elements.

    ``order`` lists slot indices in gradient-ready order; the default is reverse registration order, which is
    how backward usually produces them ([Note: layout], "Buckets and chunks"). A slot larger than
    ``bucket_numel`` gets a bucket of its own. Zero-element slots still appear, so every slot is in exactly
    one bucket.
    """
    _require_positive("bucket_numel", bucket_numel)
    by_index = {slot.index: slot for slot in slots}
    sequence = list(reversed(list(by_index))) if order is None else list(order)
    if sorted(sequence) != sorted(by_index):
        raise ValueError("order must be a permutation of the slots' indices")
    buckets: list[Bucket] = []
    members: list[int] = []
    numel = 0
    for index in sequence:
        size = by_index[index].numel
        if members and numel + size > bucket_numel:
            buckets.append(Bucket(len(buckets), tuple(members), numel))
            members, numel = [], 0
        members.append(index)
        numel += size
    if members:
        buckets.append(Bucket(len(buckets), tuple(members), numel))
    return tuple(buckets)


@dataclass(frozen=True)
class Segment:
    """One physically contiguous piece of a flat group: slots ``slots`` and group interval ``range``."""

    index: int
    slots: Range
    range: Range


@dataclass(frozen=True)
class SegmentPlan:
    """How a group's logical flat address space is split into separately allocated segments.

    Segments tile ``[0, layout.padded_numel)``; every parameter lies wholly in one segment and the tail
    padding belongs to the last one. One segment is the classic single flat buffer. See [Note: layout],
    "In-place flatten".
    """

    layout: GroupLayout
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        cursor = 0
        for position, segment in enumerate(self.segments):
            if segment.index != position or segment.range.start != cursor:
                raise ValueError(f"segment {position} does not continue the tiling at {cursor}")
            cursor = segment.range.end
        if not self.segments or cursor != self.layout.padded_numel:
            raise ValueError(f"segments must tile [0, {self.layout.padded_numel}), they end at {cursor}")
        self._check_slots()

    def _check_slots(self) -> None:
        next_slot = 0
        for segment in self.segments:
            if segment.slots.start != next_slot:
                raise ValueError(f"segment {segment.index} starts at slot {segment.slots.start}, not {next_slot}")
            for slot in self.layout.slots[segment.slots.as_slice()]:
                if not segment.range.contains(slot.range):
                    raise ValueError(f"slot {slot.index} {slot.range} straddles segment {segment.index}")
            next_slot = segment.slots.end
        if next_slot != len(self.layout.slots):
            raise ValueError(f"segments cover {next_slot} of {len(self.layout.slots)} slots")

    @cached_property
    def _starts(self) -> tuple[int, ...]:
        return tuple(segment.range.start for segment in self.segments)

    @cached_property
    def _segment_by_slot(self) -> tuple[int, ...]:
        owner = [0] * len(self.layout.slots)
        for segment in self.segments:
            owner[segment.slots.start : segment.slots.end] = [segment.index] * segment.slots.size
        return tuple(owner)

    def segment_of(self, slot: ParamSlot) -> Segment:
        """The segment holding ``slot`` entirely."""
        return self.segments[self._segment_by_slot[slot.index]]

    def _index_at(self, offset: int) -> int:
        return max(0, bisect.bisect_right(self._starts, offset) - 1)

    def locate(self, rng: Range) -> tuple[tuple[int, Range], ...]:
        """Split a group interval into ``(segment index, segment-local range)`` pieces, in order."""
        if not Range(0, self.layout.padded_numel).contains(rng):
            raise ValueError(f"{rng} is outside the group [0, {self.layout.padded_numel})")
        if rng.is_empty:
            return ()
        pieces = []
        for segment in self.segments[self._index_at(rng.start) :]:
            if segment.range.start >= rng.end:
                break
            overlap = segment.range.intersect(rng)
            if not overlap.is_empty:
                pieces.append((segment.index, overlap.shift(-segment.range.start)))
        return tuple(pieces)


def plan_segments(layout: GroupLayout, chunk_numel: int | None) -> SegmentPlan:
    """Segments of at most ``chunk_numel`` parameter elements (``None``: one segment for the whole group).

    A parameter larger than ``chunk_numel`` gets a segment of its own; the tail padding extends the last.
    """
    if chunk_numel is None or not layout.slots:
        whole = Segment(0, Range(0, len(layout.slots)), Range(0, layout.padded_numel))
        return SegmentPlan(layout, (whole,))
    chunks = plan_chunks(layout.slots, chunk_numel)
    segments = [Segment(c.index, c.slots, c.range) for c in chunks[:-1]]
    last = chunks[-1]
    segments.append(Segment(last.index, last.slots, Range(last.range.start, layout.padded_numel)))
    return SegmentPlan(layout, tuple(segments))


@dataclass(frozen=True)
class Stage3ParamLayout:
    """ZeRO-3 split of one parameter ([Note: layout], "Stage 3"; api_surface §5.6).

    Every rank holds ``partition_numel = ceil(numel / world_size)`` elements; rank ``r`` holds flattened
    elements ``[r * partition_numel, (r + 1) * partition_numel)`` and the trailing ranks are zero-padded.
    """

    numel: int
    world_size: int

    def __post_init__(self) -> None:
        _require_positive("world_size", self.world_size)
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")

    @property
    def partition_numel(self) -> int:
        """Elements per rank, identical on every rank."""
        return ceil_div(self.numel, self.world_size)

    @property
    def padded_numel(self) -> int:
        """``world_size * partition_numel``."""
        return self.partition_numel * self.world_size

    @property
    def padding(self) -> int:
        """Zero elements after the real data: ``world - numel % world`` when that remainder is non-zero."""
        return self.padded_numel - self.numel

    def partition(self, rank: int) -> Range:
        """``rank``'s interval of the padded flattened parameter."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return Range(rank * self.partition_numel, (rank + 1) * self.partition_numel)

    def valid_range(self, rank: int) -> Range:
        """The real (unpadded) elements inside ``rank``'s partition."""
        return self.partition(rank).intersect(Range(0, self.numel))


@dataclass(frozen=True)
class Stage3GroupLayout:
    """Each rank's flat ZeRO-3 buffer: the slots' per-rank shards back to back, no padding between them.

    That packing is what ``zero_to_fp32`` expects of ``fp32_flat_groups``: the shard of slot ``i`` starts at
    ``rank_offset(slot)`` in every rank's buffer and the per-rank total is ``rank_numel``.
    """

    slots: tuple[ParamSlot, ...]
    world_size: int

    def __post_init__(self) -> None:
        _require_positive("world_size", self.world_size)

    def param(self, slot: ParamSlot) -> Stage3ParamLayout:
        """The per-parameter split of ``slot``."""
        return Stage3ParamLayout(slot.numel, self.world_size)

    @cached_property
    def _rank_offsets(self) -> tuple[int, ...]:
        offsets = [0]
        for slot in self.slots:
            offsets.append(offsets[-1] + ceil_div(slot.numel, self.world_size))
        return tuple(offsets)

    def rank_offset(self, slot: ParamSlot) -> int:
        """Where ``slot``'s shard starts in each rank's flat buffer."""
        return self._rank_offsets[slot.index]

    def rank_range(self, slot: ParamSlot) -> Range:
        """``slot``'s shard interval in each rank's flat buffer."""
        return Range(self._rank_offsets[slot.index], self._rank_offsets[slot.index + 1])

    @property
    def rank_numel(self) -> int:
        """Elements of each rank's flat buffer (shards plus their per-parameter padding)."""
        return self._rank_offsets[-1]


def plan_stage3_group(
    shapes: Sequence[Sequence[int]], world_size: int, names: Sequence[str] | None = None
) -> Stage3GroupLayout:
    """Build the ZeRO-3 per-rank layout of a group from parameter shapes in order."""
    return Stage3GroupLayout(make_slots(shapes, names), world_size)
