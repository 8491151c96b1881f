"""Layout arithmetic over seeded random grids of shapes and world sizes 1..64 (no process group, no device)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from deepspeed._core.layout.shards import (
    DEFAULT_PARTITION_ALIGNMENT,
    GroupLayout,
    ParamSlot,
    Range,
    Stage3ParamLayout,
    make_slots,
    partition_windows,
    plan_buckets,
    plan_chunks,
    plan_group,
    plan_segments,
    plan_stage3_group,
    round_up,
)

WORLD_SIZES = [1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 64]


def _random_shapes(rng: random.Random) -> list[tuple[int, ...]]:
    """A mix of empty, scalar, tiny, matrix and long-vector parameters."""
    shapes: list[tuple[int, ...]] = []
    for _ in range(rng.randint(0, 24)):
        kind = rng.random()
        if kind < 0.05:
            shapes.append((rng.randint(0, 3), 0))
        elif kind < 0.15:
            shapes.append(())
        elif kind < 0.6:
            shapes.append((rng.randint(1, 40), rng.randint(1, 40)))
        elif kind < 0.9:
            shapes.append((rng.randint(1, 300),))
        else:
            shapes.append((rng.randint(1, 8), rng.randint(1, 8), rng.randint(1, 64)))
    return shapes


def _grid(count: int, seed: int) -> list[tuple[list[tuple[int, ...]], int, int]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        alignment = rng.choice([1, 2, 2, 2, 4, 8])
        cases.append((_random_shapes(rng), rng.choice(WORLD_SIZES), alignment))
    return cases


GRID = _grid(300, seed=1234)
BATCHES = 6  # grid cases are checked in a few batches: per-test overhead dominates otherwise


def _batch(batch: int, stride: int = 1) -> list[tuple[list[tuple[int, ...]], int, int]]:
    return GRID[batch::BATCHES][::stride]


def _check_partitions(layout: GroupLayout) -> None:
    world, align = layout.world_size, layout.partition_alignment
    assert layout.padded_numel % (world * align) == 0
    assert 0 <= layout.padding < world * align
    assert layout.partition_numel % align == 0
    cursor = 0
    for rank in range(world):
        part = layout.partition(rank)
        assert part.start == cursor and part.size == layout.partition_numel
        cursor = part.end
    assert cursor == layout.padded_numel
    assert sum(layout.valid_range(r).size for r in range(world)) == layout.numel
    assert sum(layout.padding_in_partition(r) for r in range(world)) == layout.padding


def _check_ownership(layout: GroupLayout) -> None:
    """Every element of every param is owned by exactly one rank, and fragments rebuild the params."""
    covered = {slot.index: [] for slot in layout.slots}
    owners = {slot.index: [] for slot in layout.slots}
    for rank in range(layout.world_size):
        part = layout.partition(rank)
        previous_end = 0
        for frag in layout.params_in_partition(rank):
            assert frag.param_range.size == frag.partition_range.size > 0
            assert frag.partition_range.start >= previous_end, "fragments overlap or are out of order"
            assert frag.partition_range.end <= layout.partition_numel
            assert frag.group_range == frag.partition_range.shift(part.start)
            previous_end = frag.partition_range.end
            covered[frag.slot.index].append(frag.param_range)
            owners[frag.slot.index].append(rank)
    for slot in layout.slots:
        ranges = covered[slot.index]
        assert sum(r.size for r in ranges) == slot.numel
        cursor = 0
        for r in ranges:  # ranks are visited in order, so the fragments must tile the param in order
            assert r.start == cursor
            cursor = r.end
        assert cursor == slot.numel
        assert list(layout.owner_ranks(slot)) == owners[slot.index]


@pytest.mark.parametrize("batch", range(BATCHES))
def test_group_layout_grid(batch: int) -> None:
    for shapes, world, align in _batch(batch):
        layout = plan_group(shapes, world, partition_alignment=align)
        assert layout.numel == sum(math.prod(s) for s in shapes)
        assert [slot.shape for slot in layout.slots] == [tuple(s) for s in shapes]
        _check_partitions(layout)
        _check_ownership(layout)
        assert layout == plan_group(shapes, world, partition_alignment=align), "layout must be deterministic"


def test_default_alignment_is_upstream_two_times_world() -> None:
    rng = random.Random(7)
    for _ in range(200):
        numel = rng.randint(0, 10_000)
        world = rng.choice(WORLD_SIZES)
        layout = plan_group([(numel,)], world)
        assert layout.partition_alignment == DEFAULT_PARTITION_ALIGNMENT == 2
        assert layout.padded_numel == 2 * world * math.ceil(numel / (2 * world))


def _zero2_reconstruct(saved: list[torch.Tensor], shapes: list[tuple[int, ...]], world: int) -> list[torch.Tensor]:
    """What api_surface §5.6 says zero_to_fp32 does for one stage-1/2 group (written from the spec)."""
    full = torch.cat(saved)
    out, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        out.append(full.narrow(0, offset, numel).view(shape))
        offset += numel
    if round_up(offset, 2 * world) != round_up(full.numel(), 2 * world):
        raise ValueError(f"consumed {offset} numels out of {full.numel()}")
    return out


@pytest.mark.parametrize("batch", range(BATCHES))
def test_stage12_checkpoint_roundtrip_matches_zero_to_fp32(batch: int) -> None:
    for shapes, world, align in _batch(batch, stride=3):
        _check_stage12_checkpoint(shapes, world, align)


def _check_stage12_checkpoint(shapes: list[tuple[int, ...]], world: int, align: int) -> None:
    layout = plan_group(shapes, world, partition_alignment=align)
    flat = torch.zeros(layout.padded_numel)
    flat[: layout.numel] = torch.arange(layout.numel, dtype=torch.float32) + 1
    saved = [flat[layout.valid_range(r).as_slice()] for r in range(world)]  # padding stripped per rank
    rebuilt = _zero2_reconstruct(saved, shapes, world)
    for slot, tensor in zip(layout.slots, rebuilt, strict=True):
        assert torch.equal(tensor.reshape(-1), flat[slot.range.as_slice()])


def test_default_alignment_survives_upstream_padding_convention() -> None:
    """Upstream strips padding only on the last rank; with 2*world alignment zero_to_fp32's check still holds."""
    rng = random.Random(11)
    for _ in range(100):
        shapes = _random_shapes(rng) or [(3,)]
        world = rng.choice(WORLD_SIZES)
        layout = plan_group(shapes, world)
        flat = torch.zeros(layout.padded_numel)
        flat[: layout.numel] = torch.arange(layout.numel, dtype=torch.float32)
        saved = [flat[layout.partition(r).as_slice()] for r in range(world)]
        last = saved[-1]
        saved[-1] = last[: max(0, last.numel() - layout.upstream_group_padding(world - 1))]
        _zero2_reconstruct(saved, shapes, world)


def test_larger_alignment_needs_stripped_padding() -> None:
    """A partition alignment above 2 breaks zero_to_fp32 if padded partitions were saved whole."""
    layout = plan_group([(5,)], 2, partition_alignment=8)
    flat = torch.zeros(layout.padded_numel)
    with pytest.raises(ValueError, match="consumed"):
        _zero2_reconstruct([flat[layout.partition(r).as_slice()] for r in range(2)], [(5,)], 2)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_stage3_param_layout(world: int) -> None:
    rng = random.Random(world)
    for numel in [0, 1, world - 1, world, world + 1, *[rng.randint(0, 5000) for _ in range(40)]]:
        lay = Stage3ParamLayout(numel, world)
        assert lay.partition_numel == math.ceil(numel / world)
        assert lay.padding == ((world - numel % world) if numel % world else 0)
        assert [lay.partition(r).start for r in range(world)] == [r * lay.partition_numel for r in range(world)]
        assert sum(lay.valid_range(r).size for r in range(world)) == numel


@pytest.mark.parametrize("batch", range(BATCHES))
def test_stage3_group_matches_zero_to_fp32(batch: int) -> None:
    for shapes, world, _ in _batch(batch, stride=6):
        _check_stage3_checkpoint(shapes, world)


def _check_stage3_checkpoint(shapes: list[tuple[int, ...]], world: int) -> None:
    group = plan_stage3_group(shapes, world)
    values = [torch.arange(math.prod(s), dtype=torch.float32) + 100 * i for i, s in enumerate(shapes)]
    rank_flats = []
    for rank in range(world):
        flat = torch.full((group.rank_numel,), -1.0)
        for slot, value in zip(group.slots, values, strict=True):
            lay = group.param(slot)
            shard = torch.zeros(lay.partition_numel)
            valid = lay.valid_range(rank)
            shard[: valid.size] = value[valid.as_slice()]
            flat[group.rank_range(slot).as_slice()] = shard
        rank_flats.append(flat)
    consumed = 0
    for slot, value in zip(group.slots, values, strict=True):  # §5.6: concatenate every rank's slice, truncate to numel
        pn = math.ceil(slot.numel / world)
        assert group.rank_offset(slot) == consumed
        full = torch.cat([f[consumed : consumed + pn] for f in rank_flats])[: slot.numel]
        assert torch.equal(full, value)
        consumed += pn
    assert consumed * world == group.rank_numel * world


def _check_bucket_plan(slots: tuple[ParamSlot, ...], bucket_numel: int, order: list[int]) -> None:
    buckets = plan_buckets(slots, bucket_numel, order)
    flat_order = [i for b in buckets for i in b.slot_indices]
    assert flat_order == order, "buckets must follow the gradient-ready order and hold every slot once"
    for position, bucket in enumerate(buckets):
        assert bucket.index == position
        assert bucket.numel == sum(slots[i].numel for i in bucket.slot_indices)
        assert bucket.numel <= bucket_numel or len(bucket.slot_indices) == 1
        if position + 1 < len(buckets):  # greedy: the next slot would not have fitted
            assert bucket.numel + slots[buckets[position + 1].slot_indices[0]].numel > bucket_numel


@pytest.mark.parametrize("batch", range(BATCHES))
def test_buckets(batch: int) -> None:
    rng = random.Random(batch)
    for shapes, _, _ in _batch(batch, stride=2):
        _check_buckets(make_slots(shapes), rng)


def _check_buckets(slots: tuple[ParamSlot, ...], rng: random.Random) -> None:
    for bucket_numel in [1, 7, 100, 1000, 10**9]:
        _check_bucket_plan(slots, bucket_numel, list(range(len(slots)))[::-1])
        assert plan_buckets(slots, bucket_numel) == plan_buckets(slots, bucket_numel, list(range(len(slots)))[::-1])
        shuffled = list(range(len(slots)))
        rng.shuffle(shuffled)
        _check_bucket_plan(slots, bucket_numel, shuffled)


def test_bucket_order_must_be_a_permutation() -> None:
    slots = make_slots([(2,), (3,), (4,)])
    with pytest.raises(ValueError, match="permutation"):
        plan_buckets(slots, 10, [0, 1])
    with pytest.raises(ValueError, match="permutation"):
        plan_buckets(slots, 10, [0, 1, 1])


@pytest.mark.parametrize("batch", range(BATCHES))
def test_chunks_and_segments(batch: int) -> None:
    for shapes, world, align in _batch(batch, stride=2):
        _check_chunks(plan_group(shapes, world, partition_alignment=align))


def _check_chunks(layout: GroupLayout) -> None:
    for chunk_numel in [1, 5, 64, 777, 10**9]:
        chunks = plan_chunks(layout.slots, chunk_numel)
        next_slot, cursor = 0, 0
        for position, chunk in enumerate(chunks):
            assert chunk.slots.start == next_slot and chunk.range.start == cursor and chunk.slots.size >= 1
            assert chunk.range.size <= chunk_numel or chunk.slots.size == 1
            if position + 1 < len(chunks):
                following = layout.slots[chunks[position + 1].slots.start]
                assert chunk.range.size + following.numel > chunk_numel
            next_slot, cursor = chunk.slots.end, chunk.range.end
        assert next_slot == len(layout.slots) and cursor == layout.numel
        _check_segments(layout, chunk_numel)


def _check_segments(layout: GroupLayout, chunk_numel: int) -> None:
    plan = plan_segments(layout, chunk_numel)
    assert plan.segments[-1].range.end == layout.padded_numel
    for slot in layout.slots:
        assert plan.segment_of(slot).range.contains(slot.range)
    rng = random.Random(chunk_numel)
    probes = [layout.partition(r) for r in range(layout.world_size)]
    for _ in range(10):
        a, b = sorted(rng.randint(0, layout.padded_numel) for _ in range(2))
        probes.append(Range(a, b))
    for probe in probes:
        pieces = plan.locate(probe)
        assert sum(local.size for _, local in pieces) == probe.size
        starts = [plan.segments[i].range.start + local.start for i, local in pieces]
        assert starts == sorted(starts) and (not pieces or starts[0] == probe.start)


def test_single_segment_without_chunk() -> None:
    layout = plan_group([(3, 3), (5,)], 4)
    plan = plan_segments(layout, None)
    assert len(plan.segments) == 1 and plan.segments[0].range == Range(0, layout.padded_numel)


def test_oversized_param_gets_own_chunk_and_bucket() -> None:
    slots = make_slots([(2,), (50,), (3,), (4,)])
    chunks = plan_chunks(slots, 10)
    assert [c.slots for c in chunks] == [Range(0, 1), Range(1, 2), Range(2, 4)]
    buckets = plan_buckets(slots, 10, [0, 1, 2, 3])
    assert [b.slot_indices for b in buckets] == [(0,), (1,), (2, 3)]


def test_partition_windows_tile_partition() -> None:
    layout = plan_group([(1000,)], 4)
    windows = partition_windows(layout, 60)
    assert windows[0].start == 0 and windows[-1].end == layout.partition_numel
    assert all(w.size <= 60 for w in windows)
    assert all(a.end == b.start for a, b in itertools.pairwise(windows))


def test_range_algebra() -> None:
    assert Range(2, 9).intersect(Range(5, 20)) == Range(5, 9)
    assert Range(2, 4).intersect(Range(6, 8)).is_empty
    assert Range(2, 4).shift(-2) == Range(0, 2)
    assert Range(0, 10).contains(Range(3, 10)) and not Range(0, 10).contains(Range(3, 11))
    with pytest.raises(ValueError):
        Range(5, 4)


def test_worked_example_straddling_param() -> None:
    layout = plan_group([(3, 4), (5,), (7, 2)], 3)
    assert (layout.numel, layout.padded_numel, layout.partition_numel, layout.padding) == (31, 36, 12, 5)
    frags = layout.params_in_partition(1)
    assert [(f.slot.index, f.param_range, f.partition_range) for f in frags] == [
        (1, Range(0, 5), Range(0, 5)),
        (2, Range(0, 7), Range(5, 12)),
    ]
    assert list(layout.owner_ranks(layout.slots[2])) == [1, 2]
    assert layout.padding_in_partition(2) == 5 and layout.upstream_group_padding(2) == 5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2, "partition_alignment": 0}, "partition_alignment"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_group([(4,)], **kwargs)


def test_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="rank"):
        plan_group([(4,)], 2).partition(2)
