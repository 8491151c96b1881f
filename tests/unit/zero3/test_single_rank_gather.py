"""ZeRO-3 gather copies: one-rank gathers read the shards directly (no flat buffer, same values as the
collective path); a unit's copy-in and copy-out are one batched op each, whatever its parameter count."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepspeed._core.comm.codec import IDENTITY_CODEC
from deepspeed._core.comm.collectives import finish_all_gather, start_all_gather
from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.comm.streams import StreamRole, StreamSet


def test_single_rank_gather_allocates_no_flat_buffer_and_copies_each_shard() -> None:
    shards = [torch.arange(6, dtype=torch.float32), torch.arange(10, 13, dtype=torch.float32)]
    result = start_all_gather(shards, [6, 3], ShardGroup(None, 0, 1), StreamSet(), IDENTITY_CODEC, torch.device("cpu"))
    assert result.flat is None and result.sources is not None
    outs = [torch.full((6,), -1.0), torch.full((3,), -1.0)]
    finish_all_gather(result, outs, StreamSet(), StreamRole.COMPUTE, IDENTITY_CODEC)
    assert torch.equal(outs[0], shards[0]) and torch.equal(outs[1], shards[1])
    shards[0].add_(100.0)  # the outputs are copies, not views of the shards
    assert outs[0][0].item() == 0.0


class _Doubling:
    """A codec that is not the identity: the single-rank shortcut must not bypass it."""

    def wire_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return param_dtype

    def encode(self, shards: list[torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(torch.cat(shards) * 2)

    def decode(self, received: torch.Tensor, outs: list[torch.Tensor]) -> None:
        outs[0].copy_(received)


def test_other_codecs_keep_the_flat_path() -> None:
    shards = [torch.ones(4)]
    result = start_all_gather(shards, [4], ShardGroup(None, 0, 1), StreamSet(), _Doubling(), torch.device("cpu"))
    assert result.flat is not None
    out = [torch.zeros(4)]
    finish_all_gather(result, out, StreamSet(), StreamRole.COMPUTE, _Doubling())
    assert out[0].tolist() == [2.0] * 4


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _gather_ops(world_size: int, rank: int) -> list[str]:
    """The tensor ops of one unit's copy-in and copy-out (the collective replaced by a local stand-in)."""
    numels = [10, 7, 3, 16]
    shards = [torch.full((-(-n // world_size),), float(i)) for i, n in enumerate(numels)]
    group = ShardGroup(None, rank, world_size)
    from deepspeed._core.comm import collectives

    real = collectives.dist.all_gather_into_tensor
    collectives.dist.all_gather_into_tensor = lambda flat, local, group=None, async_op=False: None
    try:
        with _CountOps() as counted:
            result = start_all_gather(shards, numels, group, StreamSet(), IDENTITY_CODEC, torch.device("cpu"))
            outs = [torch.empty(world_size * s.numel()) for s in shards]
            result.work = None
            finish_all_gather(result, outs, StreamSet(), StreamRole.COMPUTE, IDENTITY_CODEC)
    finally:
        collectives.dist.all_gather_into_tensor = real
    for i, (shard, out) in enumerate(zip(shards, outs, strict=True)):
        assert torch.equal(out.view(world_size, -1)[rank], shard), i
    return counted.ops


def test_a_units_gather_is_one_copy_kernel_each_way() -> None:
    ops = _gather_ops(world_size=4, rank=1)
    copies = [op for op in ops if op.split(".")[0] in {"copy_", "cat", "split_with_sizes_copy", "_foreach_copy_"}]
    assert copies == ["cat.out", "split_with_sizes_copy.out"], ops


def test_a_one_rank_units_copy_out_is_one_kernel_per_source_dtype() -> None:
    # Three fp32 master views and two 16-bit shards of one unit, all gathered into bf16: one multi-tensor copy
    # per source dtype (converting the fp32 ones), not one copy per parameter.
    shards = [torch.linspace(-1, 1, n) for n in (5, 8, 3)] + [torch.arange(n).bfloat16() for n in (4, 6)]
    numels = [s.numel() for s in shards]
    with _CountOps() as counted:
        result = start_all_gather(
            shards,
            numels,
            ShardGroup(None, 0, 1),
            StreamSet(),
            IDENTITY_CODEC,
            torch.device("cpu"),
            dtype=torch.bfloat16,
        )
        outs = [torch.empty(n, dtype=torch.bfloat16) for n in numels]
        finish_all_gather(result, outs, StreamSet(), StreamRole.COMPUTE, IDENTITY_CODEC)
    copies = [
        op for op in counted.ops if op.split(".")[0] in {"copy_", "cat", "split_with_sizes_copy", "_foreach_copy_"}
    ]
    assert copies == ["_foreach_copy_.default", "_foreach_copy_.default"], counted.ops
    for shard, out in zip(shards, outs, strict=True):
        assert torch.equal(out, shard.bfloat16())


@pytest.mark.gpu
def test_a_one_rank_units_copy_out_launches_one_kernel_per_source_dtype_on_cuda() -> None:
    from torch.profiler import ProfilerActivity, profile

    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    shards = [torch.randn(n, device=device) for n in (4096, 1000, 77)] + [
        torch.randn(n, device=device).bfloat16() for n in (512, 9)
    ]
    numels = [s.numel() for s in shards]
    outs = [torch.empty(n, dtype=torch.bfloat16, device=device) for n in numels]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = start_all_gather(
            shards, numels, ShardGroup(None, 0, 1), StreamSet(), IDENTITY_CODEC, device, dtype=torch.bfloat16
        )
        finish_all_gather(result, outs, StreamSet(), StreamRole.COMPUTE, IDENTITY_CODEC)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2, [e.name for e in kernels]
    for shard, out in zip(shards, outs, strict=True):
        assert torch.equal(out, shard.bfloat16())
