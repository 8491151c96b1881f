"""The one gradient reducer: bucket plans, launch order ([Note: launch order]), in-flight bound, the three modes.

The collectives are replaced by recorders (no process group): what is checked is which bucket starts and
finishes when, with what data, and where the reduced values go.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepspeed._core.comm.collectives import ReduceResult
from deepspeed._core.grads import reducer as reducer_mod
from deepspeed._core.grads.reducer import (
    Bucket,
    GradReducer,
    ReduceMode,
    ReducePhase,
    ReducerConfig,
    plan_static,
)
from deepspeed._core.grads.scaling import ReduceScaling
from deepspeed._core.grads.shard_rows import FoldOrder, GradRelease, RowEntry, ShardRows
from deepspeed._core.layout.shards import Range, make_slots


class _Work:
    def __init__(self, log: list, index: int) -> None:
        self.log, self.index, self.waited = log, index, False

    def wait(self) -> None:
        self.waited = True
        self.log.append(("wait", self.index))


@pytest.fixture()
def comm(monkeypatch: pytest.MonkeyPatch) -> list:
    """Replace the three start_* collectives with recorders that 'reduce' by doubling (a world of two equal
    ranks)."""
    log: list = []

    def fake(kind: str) -> Any:
        def start(data: torch.Tensor, *args: Any) -> ReduceResult:
            index = len([e for e in log if e[0] == "start"])
            log.append(("start", index, kind, args[0] if kind == "owners" else None))
            if kind == "scatter":
                out = data[0] * 2  # rank 0's row, summed over two equal ranks
                return ReduceResult(out, [_Work(log, index)])
            data.mul_(2)
            return ReduceResult(data, [_Work(log, index)])

        return start

    monkeypatch.setattr(reducer_mod, "start_all_reduce", lambda d, g: fake("all")(d, g))
    monkeypatch.setattr(reducer_mod, "start_reduce_to_owners", lambda d, p, g: fake("owners")(d, p, g))
    monkeypatch.setattr(reducer_mod, "start_reduce_scatter", lambda d, g: fake("scatter")(d, g))
    return log


class _IO:
    """A static-plan BucketIO over plain 1-D tensors: member ``m`` of the plan is ``values[m]``."""

    def __init__(self, values: list[torch.Tensor], owner_pieces: list[tuple[int, Range]] | None = None) -> None:
        self.values = values
        self.delivered: dict[int, torch.Tensor] = {}
        self.owner_pieces = owner_pieces or []

    def wire(self, bucket: Bucket) -> torch.Tensor:
        return torch.cat([self.values[s] for s in bucket.slots])

    def owners(self, bucket: Bucket) -> list[tuple[int, Range]]:
        return self.owner_pieces

    def process_group(self, bucket: Bucket) -> Any:
        return None

    def kept(self, bucket: Bucket, reduced: torch.Tensor) -> torch.Tensor:
        return reduced

    def deliver(self, bucket: Bucket, kept: torch.Tensor) -> None:
        self.delivered[bucket.index] = kept.clone()


def _reducer(
    io: Any,
    mode: ReduceMode,
    sizes: list[int],
    bucket: int,
    in_flight: int | None,
    scaling: ReduceScaling = ReduceScaling(1.0, 1.0),
) -> tuple[GradReducer, list]:
    events: list = []
    config = ReducerConfig(mode, bucket, torch.float32, scaling, max_in_flight=in_flight)
    slots = make_slots([(n,) for n in sizes])
    red = GradReducer(io, config, plan_static([slots], bucket), lambda e, i: events.append((e, i)))
    return red, events


def test_static_plan_reverse_order_capacity_and_groups() -> None:
    a = make_slots([(4,), (3,), (5,)])
    b = make_slots([(10,), (1,)])
    buckets = plan_static([a, b], 8)
    # Last group first, reverse slot order; 10 > 8 travels alone; groups never share a bucket.
    assert [(x.group, x.slots) for x in buckets] == [(1, (1,)), (1, (0,)), (0, (2, 1)), (0, (0,))]
    assert [x.index for x in buckets] == [0, 1, 2, 3]
    assert buckets[2].range == Range(4, 12) and buckets[1].range == Range(0, 10)


def test_out_of_order_grads_launch_in_plan_order(comm: list) -> None:
    io = _IO([torch.full((2,), float(i)) for i in range(4)])
    red, events = _reducer(io, ReduceMode.ALL_REDUCE, [2, 2, 2, 2], 4, in_flight=None)
    assert [b.slots for b in red.buckets] == [(3, 2), (1, 0)]
    red.begin(ReducePhase.REDUCE)
    red.mark_ready(1, 0)
    red.mark_ready(1, 1)  # the second bucket is complete, but the first is not: nothing may start
    assert not [e for e in comm if e[0] == "start"]
    red.mark_ready(0, 3)
    red.mark_ready(0, 3)  # a repeated report counts once
    assert not [e for e in comm if e[0] == "start"]
    red.mark_ready(0, 2)
    assert [e[1] for e in comm if e[0] == "start"] == [0, 1]
    assert events == [("launched", 0), ("launched", 1)]
    red.finish()
    assert events[2:] == [("reduced", 0), ("reduced", 1)]
    assert torch.equal(io.delivered[0], torch.tensor([6.0, 6, 4, 4]))
    assert red.in_flight == 0 and all(b.data is None and b.result is None for b in red.buckets)


def test_members_that_never_report_start_at_finish_in_order(comm: list) -> None:
    io = _IO([torch.ones(3) for _ in range(3)])
    red, events = _reducer(io, ReduceMode.ALL_REDUCE, [3, 3, 3], 3, in_flight=2)
    red.begin(ReducePhase.REDUCE)
    red.mark_ready(2, 0)  # only the last bucket's member: still nothing
    assert not comm
    red.finish()
    assert [e[1] for e in comm if e[0] == "start"] == [0, 1, 2]
    assert [e for e in events if e[0] == "reduced"] == [("reduced", 0), ("reduced", 1), ("reduced", 2)]


def test_skip_phase_launches_nothing(comm: list) -> None:
    red, _ = _reducer(_IO([torch.ones(1)]), ReduceMode.ALL_REDUCE, [1], 1, in_flight=1)
    red.begin(ReducePhase.SKIP)
    red.mark_ready(0, 0)
    red.finish()
    assert comm == []


@pytest.mark.parametrize(
    "in_flight,expected",
    [
        (1, ["start0", "wait0", "start1", "wait1", "start2", "wait2"]),
        (2, ["start0", "start1", "wait0", "start2", "wait1", "wait2"]),
        (None, ["start0", "start1", "start2", "wait0", "wait1", "wait2"]),
    ],
)
def test_in_flight_bound(comm: list, in_flight: int | None, expected: list[str]) -> None:
    io = _IO([torch.ones(2) for _ in range(3)])
    red, _ = _reducer(io, ReduceMode.ALL_REDUCE, [2, 2, 2], 2, in_flight=in_flight)
    red.begin(ReducePhase.REDUCE)
    for bucket in red.buckets:
        red.mark_ready(bucket.index, bucket.slots[0])
    red.finish()
    assert [f"{e[0]}{e[1]}" for e in comm] == expected


def test_to_owners_passes_pieces_and_scaling_is_applied_once(comm: list) -> None:
    pieces = [(0, Range(0, 2)), (1, Range(2, 4))]
    io = _IO([torch.ones(4)], owner_pieces=pieces)
    red, _ = _reducer(io, ReduceMode.TO_OWNERS, [4], 8, in_flight=1, scaling=ReduceScaling(0.5, 3.0))
    red.begin(ReducePhase.REDUCE)
    red.mark_ready(0, 0)
    red.finish()
    assert comm[0][2] == "owners" and comm[0][3] == pieces
    assert torch.equal(io.delivered[0], torch.full((4,), 3.0))  # 1 * 0.5 (pre) * 2 (sum) * 3 (post)


def test_discard_waits_and_drops_without_delivering(comm: list) -> None:
    io = _IO([torch.ones(2), torch.ones(2)])
    red, _ = _reducer(io, ReduceMode.ALL_REDUCE, [2, 2], 2, in_flight=None)
    red.begin(ReducePhase.REDUCE)
    red.mark_ready(0, 1)
    red.discard()
    assert ("wait", 0) in comm and io.delivered == {}
    assert red.in_flight == 0 and not red.reducing


class _Layout:
    def __init__(self, numel: int, world: int) -> None:
        self.partition_numel = -(-numel // world)
        self.padded_numel = self.partition_numel * world
        self.padding = self.padded_numel - numel


class _State:
    def __init__(self, numel: int, world: int) -> None:
        self.layout = _Layout(numel, world)


def _rows(
    release: GradRelease = GradRelease.EAGER,
    scaling: ReduceScaling = ReduceScaling(1.0, 1.0),
    world: int = 2,
    contiguous: bool = False,
) -> tuple[ShardRows, list]:
    folds: list = []
    io = ShardRows(
        world,
        torch.float32,
        scaling,
        release,
        lambda g, off, piece: folds.append((g, off, piece.clone())),
        None,
        FoldOrder.CONTIGUOUS if contiguous else FoldOrder.PER_ENTRY,
    )
    return io, folds


def _entry(grad: torch.Tensor, world: int, group: int, offset: int, borrowed: bool = False) -> RowEntry:
    return RowEntry(grad, _State(grad.numel(), world), group, offset, borrowed)  # type: ignore[arg-type]


def test_arrival_buckets_rank_major_rows_and_fold_targets(comm: list) -> None:
    io, folds = _rows()
    red = GradReducer(io, ReducerConfig(ReduceMode.REDUCE_SCATTER, 6, torch.float32, ReduceScaling(1.0, 1.0), 2))
    a, b = torch.arange(3.0), torch.arange(10.0, 14.0)  # a is padded to 4: rows [0 1 | 10 11], [2 0 | 12 13]
    red.add(_entry(a, 2, 0, 0), 4)
    assert not comm and len(red.open.entries) == 1
    red.add(_entry(b, 2, 1, 5), 4)  # 8 >= 6: the bucket starts
    assert [e[2] for e in comm if e[0] == "start"] == ["scatter"]
    assert red.open.entries == [] and red.buckets[0].data is None  # rows dropped; only the output stays
    red.finish()
    assert [(g, off) for g, off, _ in folds] == [(0, 0), (1, 5)]
    assert torch.equal(folds[0][2], torch.tensor([0.0, 2.0])) and torch.equal(folds[1][2], torch.tensor([20.0, 22.0]))
    assert red.buckets == [] and red.reducing  # arrival-order buckets reduce every backward


def test_unit_buckets_close_when_told_and_fold_adjacent_shards_once(comm: list) -> None:
    io, folds = _rows(contiguous=True)
    config = ReducerConfig(ReduceMode.REDUCE_SCATTER, 2, torch.float32, ReduceScaling(1.0, 1.0), 2, unit_buckets=True)
    red = GradReducer(io, config)
    # A unit's gradients arrive last parameter first: shards at offsets 5 (2 elements) and 3 (2), then 0 (3, group 1).
    red.add(_entry(torch.arange(4.0), 2, 0, 5), 4)
    red.add(_entry(torch.arange(10.0, 14.0), 2, 0, 3), 4)
    assert not comm, "a unit bucket does not close on size"
    red.close_bucket()
    assert [e[2] for e in comm if e[0] == "start"] == ["scatter"]
    red.add(_entry(torch.arange(20.0, 26.0), 2, 1, 0), 6)
    red.close_bucket()
    red.close_bucket()  # an empty bucket starts nothing
    red.finish()
    assert [e[2] for e in comm if e[0] == "start"] == ["scatter", "scatter"]
    # Rows in shard order: offset 3's shard then offset 5's, folded as one 4-element piece at offset 3.
    assert [(g, off, piece.tolist()) for g, off, piece in folds] == [
        (0, 3, [20.0, 22.0, 0.0, 2.0]),
        (1, 0, [40.0, 42.0, 44.0]),
    ]


def test_single_large_entry_travels_without_a_staging_copy() -> None:
    io, _ = _rows()
    grad = torch.arange(8.0)
    bucket = Bucket(0, entries=[_entry(grad, 2, 0, 0)])
    rows = io.wire(bucket)
    assert rows is not None and rows.data_ptr() == grad.data_ptr() and rows.shape == (2, 4)
    # A routed (borrowed) gradient is not scaled in place: with pre-division it gets a staging copy.
    io_pre, _ = _rows(scaling=ReduceScaling(0.5, 1.0))
    rows = io_pre.wire(Bucket(0, entries=[_entry(grad, 2, 0, 0, borrowed=True)]))
    assert rows is not None and rows.data_ptr() != grad.data_ptr()
    # Upstream-behaviour A/B release: copied, and the full gradient zeroed.
    io_ab, _ = _rows(GradRelease.ZEROED)
    kept = torch.arange(8.0)
    rows = io_ab.wire(Bucket(0, entries=[_entry(kept, 2, 0, 0)]))
    assert rows is not None and rows.data_ptr() != kept.data_ptr() and not kept.any()
    assert torch.equal(rows, torch.arange(8.0).view(2, 4))


def test_one_rank_folds_unreduced_with_both_factors(comm: list) -> None:
    io, folds = _rows(scaling=ReduceScaling(0.5, 4.0), world=1)
    red = GradReducer(io, ReducerConfig(ReduceMode.REDUCE_SCATTER, 100, torch.float32, ReduceScaling(0.5, 4.0), 1))
    red.add(_entry(torch.ones(3), 1, 0, 7), 3)
    red.finish()
    assert comm == [] and folds[0][1] == 7 and torch.equal(folds[0][2], torch.full((3,), 2.0))
