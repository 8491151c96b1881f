"""Host<->device transfers of optimizer offload on a real device: the pipelined write-back (two pinned buffers,
non-blocking copies) delivers every value, and offloaded masters stay pageable ([Note: pinned ring])."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepspeed._core.layout.flat_buffer import FlatBuffer
from deepspeed._core.layout.shards import Range, plan_group, plan_segments
from deepspeed.accelerator import get_accelerator

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 33), (7,), (1000, 129), (5,), (65536,)]


def _device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def test_zero12_offloaded_master_is_pageable_and_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed._core.optim import master as optimizer_shard
    from deepspeed._core.optim.master import MasterPlacement, MasterShard, TransferPath

    monkeypatch.setattr(optimizer_shard, "TRANSFER_CHUNK_NUMEL", 10_000)  # many pieces through both buffers
    layout = plan_group(SHAPES, 2)
    values = torch.randn(layout.padded_numel).to(torch.bfloat16)
    buf = FlatBuffer.allocate(layout, _device(), torch.bfloat16, plan_segments(layout, 50_000))
    buf.copy_in(Range(0, layout.padded_numel), values.to(_device()))
    master = MasterShard.of_flat(buf, 1, torch.float32, MasterPlacement.PINNED_HOST)
    assert master.writer.transfer is TransferPath.CHUNKED
    assert master.param.device.type == "cpu" and not master.param.is_pinned()
    part = layout.partition(1)
    assert torch.equal(master.param.data, values[part.as_slice()].float())
    for _ in range(3):  # each round's copies must have landed before the buffers are refilled
        master.param.data.add_(0.5)
        master.writer.write_partition(master.param.data)  # no all-gather: no process group here
        out = torch.empty(part.size, dtype=torch.bfloat16, device=_device())
        buf.copy_out(part, out)
        assert torch.equal(out.cpu(), master.param.data.to(torch.bfloat16))


def test_zero3_write_back_pipeline_scatters_into_device_shards() -> None:
    from deepspeed._core.optim.master import ScatterWriteBack

    sizes = [300_001, 17, 1_000_000, 3, 250_000]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    states = [
        SimpleNamespace(
            shard=torch.zeros(n, dtype=torch.bfloat16, device=_device()), layout=SimpleNamespace(partition_numel=n)
        )
        for n in sizes
    ]
    master = torch.randn(sum(sizes))
    for chunk in (65_536, 1 << 20, 1 << 24):
        master.add_(1.0)
        ScatterWriteBack(states, chunk).write(master)  # host master -> device shards: one pipelined pass
        for state, off, n in zip(states, offsets, sizes, strict=True):
            assert torch.equal(state.shard.cpu(), master[off : off + n].to(torch.bfloat16)), (chunk, off)
