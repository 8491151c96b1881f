"""Persistent parameters are refreshed in place after a step rewrote their shards: the gathered tensors keep their
storage (no release and re-allocation per parameter) and take the shards' new values."""

from __future__ import annotations

import torch
from torch import nn

from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.config.plan import LeanPolicy, Stage3Policy
from deepspeed._core.params.manager import ParamStorage, ZeroParamManager
from deepspeed._core.params.param import FullStorage, ShardedState


def test_refresh_rewrites_gathered_persistent_parameters_in_place() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 40))
    manager = ZeroParamManager(
        model,
        ShardGroup(None, 0, 1),
        Stage3Policy(param_persistence_threshold=30),  # all but the last layer (200 and 40 elements)
        LeanPolicy(),
        storage=ParamStorage(
            single_rank=FullStorage.SEPARATE
        ),  # gathered storage apart from the shard, as at several ranks
    )
    persistent = [s for s in manager.states.values() if s.is_persistent]
    other = [s for s in manager.states.values() if not s.is_persistent]
    assert len(persistent) == 4 and len(other) == 2
    assert all(s.state is ShardedState.FULL for s in persistent)
    storages = [s.full.untyped_storage().data_ptr() for s in persistent]
    for state in persistent + other:  # what a step does: new values in every shard
        state.shard.add_(1.0)
    manager.refresh_persistent()
    assert [s.full.untyped_storage().data_ptr() for s in persistent] == storages
    for state in persistent:
        assert torch.equal(state.full[: state.numel], state.shard[: state.numel])
    assert all(s.state is ShardedState.SHARDED for s in other)  # partitioned parameters stay partitioned
    manager.destroy()
