"""The NVMe optimizer swapper's pipelining: with ``pipeline_read`` the read of step chunk k+1 is in flight before the
step of chunk k starts (so the disk works while the host steps), without it only after chunk k is done; with
``pipeline_write`` chunk k's write completes while chunk k+1 steps, without it before the step moves on. The values
each chunk sees are the file's either way."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepspeed._core.config.plan import AioPolicy
from deepspeed._core.optim.nvme import MASTER_KEY, GroupFiles, NvmeSwapper
from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

pytestmark = pytest.mark.skipif(not AsyncIOBuilder().is_compatible(), reason="the async_io op cannot be built here")

CHUNK, CHUNKS = 1024, 4


def _events(tmp_path: Path, pipeline_read: bool, pipeline_write: bool) -> list[tuple[str, int]]:
    files = [GroupFiles(CHUNK * CHUNKS, "0_1", tmp_path)]
    offload = SimpleNamespace(pipeline_read=pipeline_read, pipeline_write=pipeline_write, buffer_count=3)
    swapper = NvmeSwapper(files, CHUNK, offload, AioPolicy())
    values = torch.randn(CHUNK * CHUNKS)
    swapper.write_full(0, MASTER_KEY, values)
    events: list[tuple[str, int]] = []
    start_read = swapper._start_read

    def logged(slot, chunk, keys) -> None:
        events.append(("read", chunk.start // CHUNK))
        start_read(slot, chunk, keys)

    swapper._start_read = logged  # type: ignore[method-assign]
    settle = swapper._settle_write
    writing: list[int] = []  # chunks whose writes are in flight, in issue order

    def settled(slot) -> None:
        if slot.writing:
            events.append(("write_done", writing.pop(0)))
        settle(slot)

    swapper._settle_write = settled  # type: ignore[method-assign]
    for chunk, views, done in swapper.stream():
        k = chunk.start // CHUNK
        events.append(("step", k))
        assert torch.equal(views[MASTER_KEY], values[chunk.start : chunk.end])  # what the file holds
        views[MASTER_KEY].add_(1.0)  # the "step"
        writing.append(k)
        done()
        events.append(("end", k))
    assert torch.equal(swapper.read_full(0, MASTER_KEY), values + 1.0)  # every chunk written back
    return events


@pytest.mark.parametrize("pipeline_write", [False, True])
def test_pipeline_read_issues_the_next_read_before_the_current_step(tmp_path: Path, pipeline_write: bool) -> None:
    events = _events(tmp_path, True, pipeline_write)
    for k in range(CHUNKS - 1):
        assert events.index(("read", k + 1)) < events.index(("step", k)), events
        if pipeline_write:  # chunk k's write is still in flight while chunk k + 1 steps
            assert events.index(("write_done", k)) > events.index(("step", k + 1)), events
        else:
            assert events.index(("write_done", k)) < events.index(("end", k)), events


def test_without_pipeline_read_the_next_read_waits_for_the_step(tmp_path: Path) -> None:
    events = _events(tmp_path, False, False)
    for k in range(CHUNKS - 1):
        assert events.index(("read", k + 1)) > events.index(("end", k)), events
