"""ZeRO-3 gradient staging rows ([Note: zero3-grads]): the one-kernel copy-in (``torch._chunk_cat``) builds the
same ``(world, S)`` rows as the per-parameter copy, padding and wire-dtype conversion included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepspeed._core.grads import shard_rows
from deepspeed._core.grads.reducer import Bucket
from deepspeed._core.grads.scaling import ReduceScaling
from deepspeed._core.grads.shard_rows import GradRelease, RowEntry, ShardRows
from deepspeed._core.layout.shards import Stage3ParamLayout


def _rows(
    world: int, wire: torch.dtype, batched: bool, monkeypatch: pytest.MonkeyPatch, release: GradRelease
) -> tuple[torch.Tensor, list]:
    if not batched:
        monkeypatch.setattr(shard_rows, "_CHUNK_CAT", None)
    gen = torch.Generator().manual_seed(world)
    grads = [torch.randn(shape, generator=gen) for shape in ((5, 3), (8,), (3,), (2, 7))]
    bucket = Bucket(0)
    offset = 0
    for g in grads:
        layout = Stage3ParamLayout(g.numel(), world)
        bucket.entries.append(RowEntry(g, SimpleNamespace(layout=layout), 0, offset, False))  # type: ignore[arg-type]
        offset += layout.partition_numel
    io = ShardRows(world, wire, ReduceScaling(1.0, 1.0), release, lambda *a: None, None)
    rows = io.wire(bucket)
    assert rows is not None and not bucket.entries
    if release is GradRelease.ZEROED:  # the upstream-behaviour A/B keeps the buffers, zeroed
        assert all(not g.any() for g in grads)
    return rows, list(bucket.targets)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("release", [GradRelease.EAGER, GradRelease.ZEROED])
def test_batched_rows_equal_the_per_parameter_copy(
    world: int, wire: torch.dtype, release: GradRelease, monkeypatch
) -> None:
    if shard_rows._CHUNK_CAT is None:
        pytest.skip("torch without _chunk_cat: only the per-parameter copy exists")
    batched, targets = _rows(world, wire, True, monkeypatch, release)
    looped, looped_targets = _rows(world, wire, False, monkeypatch, release)
    assert batched.dtype == wire and batched.shape == looped.shape
    assert torch.equal(batched, looped) and targets == looped_targets
