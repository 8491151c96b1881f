"""A ZeRO-3 shard that is a view of the fp32 master ([Note: zero3-master]), without a process group: adoption keeps
the shard invariants and frees the 16-bit copy, gathers convert to the working dtype, the write-back and the
master rebuild skip the views, and ``GatheredParameters`` writes land in the master."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepspeed._core.comm.codec import IDENTITY_CODEC
from deepspeed._core.comm.collectives import finish_all_gather, start_all_gather
from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.comm.streams import StreamRole, StreamSet
from deepspeed._core.optim.master import MasterShard
from deepspeed._core.params.gather import Gatherer
from deepspeed._core.params.param import FullStorage, ShardedState, zero_state
from deepspeed.runtime.zero.partition_parameters import GatheredParameters


def _params(dtype: torch.dtype, single_rank: FullStorage) -> tuple[list[nn.Parameter], Gatherer]:
    gatherer = Gatherer(StreamSet(), single_rank=single_rank)
    params = [nn.Parameter(torch.linspace(-1, 1, n).to(dtype)) for n in (7, 3)]
    for p in params:
        gatherer.partition(p, ShardGroup(None, 0, 1))
    return params, gatherer


def _adopt(params: list[nn.Parameter]) -> MasterShard:
    states = [zero_state(p) for p in params]
    master = MasterShard.of_shards(states, torch.float32, "cpu", 4)
    off = 0
    for state in states:
        state.adopt_master_shard(master.data.narrow(0, off, state.layout.partition_numel))
        off += state.layout.partition_numel
    return master


@pytest.mark.parametrize("single_rank", [FullStorage.SHARD, FullStorage.SEPARATE])
def test_adoption_keeps_the_invariants_and_frees_the_16bit_shard(single_rank: FullStorage) -> None:
    params, gatherer = _params(torch.bfloat16, single_rank)
    old = [p.ds_tensor for p in params]
    master = _adopt(params)
    for p, before in zip(params, old, strict=True):
        state = zero_state(p)
        assert state.shard_is_master and not state.aliases_shard  # gathered storage stays 16-bit
        assert p.ds_tensor.dtype == torch.float32 and p.ds_tensor.shape == (state.layout.partition_numel,)
        assert p.ds_tensor.ds_numel == p.partition_numel()
        assert p.ds_tensor.untyped_storage().data_ptr() == master.data.untyped_storage().data_ptr()
        assert before.untyped_storage().nbytes() == 0
        assert p.dtype == torch.bfloat16 and state.full.dtype == torch.bfloat16
    gatherer.gather([zero_state(p) for p in params])
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert torch.equal(params[0].detach(), torch.linspace(-1, 1, 7).bfloat16())
    gatherer.release([zero_state(p) for p in params])


def test_fp32_single_rank_view_is_the_gathered_tensor() -> None:
    params, gatherer = _params(torch.float32, FullStorage.SHARD)
    master = _adopt(params)
    state = zero_state(params[0])
    assert state.aliases_shard and state.full.data_ptr() == master.data.data_ptr()
    gatherer.gather([state])
    assert params[0].data_ptr() == master.data.data_ptr()  # no copy at all
    gatherer.release([state])


def test_write_back_and_refresh_skip_views_but_not_copies() -> None:
    params, _ = _params(torch.bfloat16, FullStorage.SEPARATE)
    states = [zero_state(p) for p in params]
    master = MasterShard.of_shards(states, torch.float32, "cpu", 4)
    states[0].adopt_master_shard(master.data.narrow(0, 0, 7))  # the second keeps its 16-bit shard
    assert [off for _, off in master.writer.copied(master.data)] == [7]
    master.data.add_(0.5)
    master.write_back()
    assert torch.equal(params[1].ds_tensor, (torch.linspace(-1, 1, 3).bfloat16().float() + 0.5).bfloat16())
    params[1].ds_tensor.fill_(2.0)
    before = master.data[:7].clone()
    master.refresh()
    assert torch.equal(master.data[7:], torch.full((3,), 2.0)) and torch.equal(master.data[:7], before)


def test_gather_converts_mixed_shards_into_the_working_dtype_wire() -> None:
    shards = [torch.tensor([0.1, 0.2, 0.3], dtype=torch.float32), torch.tensor([1.5, 2.5], dtype=torch.bfloat16)]
    for world_one in (True, False):
        # The flat path (a codec that is not the identity object) and the one-rank path read fp32 and bf16 shards.
        codec = IDENTITY_CODEC if world_one else type(IDENTITY_CODEC)()
        result = start_all_gather(
            shards, [3, 2], ShardGroup(None, 0, 1), StreamSet(), codec, torch.device("cpu"), dtype=torch.bfloat16
        )
        if not world_one:
            assert result.flat is not None and result.flat.dtype == torch.bfloat16
        outs = [torch.empty(3, dtype=torch.bfloat16), torch.empty(2, dtype=torch.bfloat16)]
        finish_all_gather(result, outs, StreamSet(), StreamRole.COMPUTE, codec)
        assert torch.equal(outs[0], shards[0].bfloat16()) and torch.equal(outs[1], shards[1])


def test_modifier_writes_land_in_the_master_and_keep_unchanged_precision() -> None:
    params, _ = _params(torch.bfloat16, FullStorage.SHARD)
    master = _adopt(params)
    master.data[:7].add_(1e-4)  # values a bf16 copy cannot hold
    before = master.data[:7].clone()
    with GatheredParameters([params[0]], modifier_rank=0):
        with torch.no_grad():
            params[0][2] = 5.0
    assert zero_state(params[0]).state is ShardedState.SHARDED
    assert master.data[2].item() == 5.0
    keep = [i for i in range(7) if i != 2]
    assert torch.equal(master.data[keep], before[keep])
