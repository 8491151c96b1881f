"""One-rank ZeRO-3 gathers read the shards directly: no flat buffer, same values as the collective path."""
from __future__ import annotations

import torch

from deepspeed._core.zero.codec import IDENTITY_CODEC
from deepspeed._core.zero.collectives import finish_all_gather, start_all_gather
from deepspeed._core.zero.param import ShardGroup
from deepspeed._core.zero.streams import StreamRole, StreamSet


def test_single_rank_gather_allocates_no_flat_buffer_and_copies_each_shard() -> None:
    shards = [torch.arange(6, dtype=torch.float32), torch.arange(10, 13, dtype=torch.float32)]
    result = start_all_gather(shards, [6, 3], ShardGroup(None, 0, 1), StreamSet(), IDENTITY_CODEC,
                              torch.device("cpu"))
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

    def encode(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(shard * 2)

    def decode(self, received: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(received)


def test_other_codecs_keep_the_flat_path() -> None:
    shards = [torch.ones(4)]
    result = start_all_gather(shards, [4], ShardGroup(None, 0, 1), StreamSet(), _Doubling(), torch.device("cpu"))
    assert result.flat is not None
    out = [torch.zeros(4)]
    finish_all_gather(result, out, StreamSet(), StreamRole.COMPUTE, _Doubling())
    assert out[0].tolist() == [2.0] * 4
