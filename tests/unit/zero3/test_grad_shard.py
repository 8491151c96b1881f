"""ChunkedGradShard against a dense reference over many shapes ([Note: lazy grad shard])."""

from __future__ import annotations

import itertools

import pytest
import torch

from deepspeed._core.grads.accumulator import KEPT_CHUNKS, ChunkedGradShard


@pytest.mark.parametrize("numel,chunk", [(1, 1), (10, 3), (16, 4), (17, 4), (100, 7), (5, 64)])
def test_add_read_write_match_a_dense_tensor(numel: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(numel * 31 + chunk)
    shard = ChunkedGradShard(numel, chunk, torch.float32, "cpu")
    dense = torch.zeros(numel)
    ranges = [(a, b) for a, b in itertools.combinations(range(numel + 1), 2)][:60]
    for i, (a, b) in enumerate(ranges):
        values = torch.randn(b - a, generator=gen, dtype=torch.float64)  # converted on the way in
        if i % 5 == 4:
            shard.write(a, values)
            dense[a:b] = values.float()
        else:
            shard.add_(a, values)
            dense[a:b] += values.float()
        assert torch.equal(shard.read(0, numel), dense)
    for a, b in ranges:
        assert torch.equal(shard.window(a, b), dense[a:b])


def test_chunks_appear_only_where_written_and_missing_ones_read_as_zeros() -> None:
    shard = ChunkedGradShard(10, 4, torch.bfloat16, "cpu")  # chunks [0,4) [4,8) [8,10)
    assert shard.allocated() == [] and shard.allocated_numel == 0
    assert torch.equal(shard.read(0, 10), torch.zeros(10, dtype=torch.bfloat16))
    shard.add_(5, torch.ones(2))
    assert shard.allocated_numel == 4 and len(shard.allocated()) == 1
    shard.add_(3, torch.ones(2))  # straddles chunks 0 and 1
    assert shard.allocated_numel == 8
    assert shard.read(0, 10).tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0]
    assert shard.read(0, 10).dtype == torch.bfloat16


def test_window_is_the_chunk_itself_when_it_fits() -> None:
    shard = ChunkedGradShard(12, 4, torch.float32, "cpu")
    shard.add_(4, torch.arange(4.0))
    view = shard.window(4, 8)
    view.mul_(2)  # a view: the step may scale it in place
    assert shard.read(4, 4).tolist() == [0, 2, 4, 6]
    unallocated = shard.window(8, 12)
    assert unallocated.tolist() == [0, 0, 0, 0] and shard.allocated_numel == 4  # zeros, not allocated
    across = shard.window(2, 6)  # spans two chunks: a copy
    assert across.tolist() == [0, 0, 0, 2]


def test_release_frees_whole_chunks_inside_the_range() -> None:
    shard = ChunkedGradShard(10, 4, torch.float32, "cpu")
    shard.add_(0, torch.ones(10))
    shard.release(0, 6)  # only chunk 0 lies wholly inside
    assert shard.allocated_numel == 6
    shard.release(4, 10)
    assert shard.allocated_numel == 0


def test_kept_storage_is_reused_zeroed_and_not_counted_while_stale() -> None:
    shard = ChunkedGradShard(10, 4, torch.float32, "cpu", KEPT_CHUNKS)
    shard.add_(0, torch.ones(10))
    ptrs = [c.data_ptr() for c in shard.allocated()]
    shard.release(0, 8)  # as the step does: chunks 0 and 1 stepped
    assert shard.allocated_numel == 2 and shard.storage_numel == 10
    assert shard.read(0, 10).tolist() == [0] * 8 + [1, 1]  # stale chunks read as zeros
    assert shard.window(0, 4).tolist() == [0] * 4
    shard.reset()  # next window
    assert shard.allocated() == [] and shard.storage_numel == 10
    shard.add_(5, torch.full((2,), 3.0))  # lands in stale chunk 1: zeroed first, then added
    assert shard.read(0, 10).tolist() == [0, 0, 0, 0, 0, 3, 3, 0, 0, 0]
    shard.write(8, torch.tensor([2.0, 2.0]))
    assert [c.data_ptr() for c in shard._chunks] == ptrs  # same storage, nothing reallocated
    assert shard.allocated_numel == 6


def test_kept_storage_matches_a_dense_tensor_over_several_windows() -> None:
    gen = torch.Generator().manual_seed(7)
    shard = ChunkedGradShard(23, 5, torch.float32, "cpu", KEPT_CHUNKS)
    for _ in range(4):
        dense = torch.zeros(23)
        for _ in range(6):
            a = int(torch.randint(0, 22, (1,), generator=gen))
            b = int(torch.randint(a + 1, 24, (1,), generator=gen))
            values = torch.randn(b - a, generator=gen)
            shard.add_(a, values)
            dense[a:b] += values
        assert torch.equal(shard.read(0, 23), dense)
        assert torch.equal(torch.cat([shard.window(*shard.bounds(i)) for i in range(5)]), dense)
        shard.reset()


def test_bad_ranges_are_rejected() -> None:
    shard = ChunkedGradShard(10, 4, torch.float32, "cpu")
    with pytest.raises(IndexError, match="outside"):
        shard.add_(8, torch.ones(3))
    with pytest.raises(IndexError, match="outside"):
        shard.read(-1, 2)
    with pytest.raises(ValueError, match="chunk_numel"):
        ChunkedGradShard(10, 0, torch.float32, "cpu")
