"""ZeRO-3 parameter state machine and ds_* attribute view, without a process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepspeed._core.comm.streams import StreamSet
from deepspeed._core.params.gather import Gatherer
from deepspeed._core.params.param import (
    FullStorage,
    ShardedState,
    ShardGroup,
    ZeroParameter,
    ZeroParamStatus,
    ZeroParamType,
    is_zero_param,
    zero_state,
)
from deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    register_external_parameter,
)


def _partitioned(
    numel: int, rank: int = 0, world: int = 1, single_rank: FullStorage = FullStorage.SEPARATE
) -> tuple[nn.Parameter, Gatherer]:
    # These tests check the allocate/free mechanics, which one-rank parameters skip by default (see the
    # FullStorage.SHARD test at the end), so they ask for separate gathered storage.
    engine = Gatherer(StreamSet(), single_rank=single_rank)
    param = nn.Parameter(torch.arange(float(numel)))
    engine.partition(param, ShardGroup(None, rank, world))
    return param, engine


@pytest.mark.parametrize(
    "numel, rank, world, expected",
    [
        (10, 3, 4, [9.0, 0.0, 0.0]),
        (10, 0, 4, [0.0, 1.0, 2.0]),
        (8, 1, 2, [4.0, 5.0, 6.0, 7.0]),
        (3, 2, 4, [2.0]),
        (3, 3, 4, [0.0]),
    ],
)
def test_shard_contents_and_padding(numel: int, rank: int, world: int, expected: list[float]) -> None:
    param, _ = _partitioned(numel, rank, world)
    assert param.ds_tensor.tolist() == expected
    assert param.partition_numel() == len(expected) == param.ds_tensor.ds_numel
    assert param.aligned_size() == len(expected) * world
    assert param.padding_size() == len(expected) * world - numel


def test_attribute_view_reads_the_one_state() -> None:
    param, _ = _partitioned(12, 1, 4)
    state = zero_state(param)
    assert isinstance(param, ZeroParameter) and isinstance(param, nn.Parameter) and is_zero_param(param)
    assert param.ds_status is ZeroParamStatus.NOT_AVAILABLE
    assert param.ds_shape == torch.Size([12]) and param.ds_numel == 12 and param.numel() == 0
    assert param.ds_param_type is ZeroParamType.PARTITIONED and not param.ds_persist
    assert param.ds_zero_partition_rank == 1 and param.ds_zero_partition_world_size == 4
    assert param.ds_secondary_tensor is None and param.nvme_swapper is None and not param.is_external_param
    param.ds_active_sub_modules.add(7)  # TRL mutates (clears) this set in place
    assert state.active_modules == {7}
    param.ds_active_sub_modules.clear()
    state.ds_id = 12345
    assert param.ds_id == 12345
    with pytest.raises(AttributeError):
        param.ds_status = ZeroParamStatus.AVAILABLE
    assert param.ds_summary()["ds_numel"] == 12


def test_state_machine_transitions_and_wrong_state_asserts() -> None:
    param, engine = _partitioned(6)
    state = zero_state(param)
    with pytest.raises(AssertionError, match="SHARDED"):
        state.mark_full()
    with pytest.raises(AssertionError):
        state.mark_sharded()
    engine.start_gather([state])
    assert state.state is ShardedState.GATHERING and param.ds_status is ZeroParamStatus.INFLIGHT
    with pytest.raises(AssertionError):
        state.mark_gathering(None)
    engine.finish_gather([state])
    assert state.state is ShardedState.FULL and param.ds_status is ZeroParamStatus.AVAILABLE
    assert param.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    state.active_modules.add(1)
    with pytest.raises(AssertionError, match="in use"):
        state.mark_sharded()
    engine.release([state])  # in use: release must leave it gathered
    assert state.state is ShardedState.FULL
    state.active_modules.clear()
    engine.release([state])
    assert state.state is ShardedState.SHARDED and param.numel() == 0 and not state.holds_memory


def test_gathered_storage_object_is_reused_so_saved_views_see_regathered_values() -> None:
    param, engine = _partitioned(4)
    state = zero_state(param)
    engine.gather([state])
    view = param.data.view(2, 2).t()  # what autograd may save
    engine.release([state])
    assert view.untyped_storage().nbytes() == 0
    engine.gather([state])
    assert view.t().reshape(-1).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_item_auto_gathers_and_releases() -> None:
    param, _ = _partitioned(1)
    param.ds_tensor.fill_(3.5)
    assert param.item() == 3.5
    assert param.ds_status is ZeroParamStatus.NOT_AVAILABLE


def test_partition_has_been_updated_writes_the_shard() -> None:
    param, _ = _partitioned(3)
    param.all_gather()
    param.data.mul_(2)
    param.partition(has_been_updated=True)
    assert param.ds_tensor.tolist() == [0.0, 2.0, 4.0]


def test_gathered_parameters_read_only_and_overlap_error() -> None:
    first, _ = _partitioned(3)
    second, _ = _partitioned(2)
    with GatheredParameters([first, second]):
        assert first.ds_status is ZeroParamStatus.AVAILABLE and first.tolist() == [0.0, 1.0, 2.0]
        first.data.fill_(9.0)
        with pytest.raises(RuntimeError, match="already gathered"), GatheredParameters(first):
            pass
        with GatheredParameters([]):  # nothing partitioned: a no-op
            pass
    assert first.ds_status is ZeroParamStatus.NOT_AVAILABLE
    assert first.ds_tensor.tolist() == [0.0, 1.0, 2.0]  # read-only: the change was discarded


def test_register_external_parameter_rejects_non_parameters() -> None:
    module = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="not a torch.nn.Parameter"):
        register_external_parameter(module, torch.ones(2))
    param, _ = _partitioned(2)
    register_external_parameter(module, param)
    assert param.is_external_param and [p for _, p in module.ds_external_parameters()] == [param]


def test_convert_to_zero_parameters_uses_the_same_group() -> None:
    param, _ = _partitioned(4, 1, 2)
    other = nn.Parameter(torch.arange(6.0))
    param.convert_to_zero_parameters([other])
    assert other.ds_tensor.tolist() == [3.0, 4.0, 5.0] and other.ds_zero_partition_world_size == 2


def test_shard_placement_from_offload_policy() -> None:
    from deepspeed._core.config.plan import OffloadDevice, OffloadPolicy
    from deepspeed._core.params.placement import Pinning, ShardPlacement

    assert ShardPlacement.from_policy(OffloadPolicy()) == ShardPlacement()
    cpu = ShardPlacement.from_policy(OffloadPolicy(device=OffloadDevice.CPU, pin_memory=False))
    assert cpu.device == torch.device("cpu") and cpu.pinning is Pinning.PAGEABLE
    # NVMe: a new shard is staged in pageable host memory before it goes to its swap file.
    nvme = ShardPlacement.from_policy(OffloadPolicy(device=OffloadDevice.NVME))
    assert nvme.device == torch.device("cpu") and nvme.pinning is Pinning.PAGEABLE


def test_one_rank_gathers_into_the_shard_itself() -> None:
    """FullStorage.SHARD: gathering moves no memory, release frees nothing, the shard keeps the values."""
    param, engine = _partitioned(6, single_rank=FullStorage.SHARD)
    state = zero_state(param)
    assert state.aliases_shard and state.full is state.shard
    engine.gather([state])
    assert param.data_ptr() == state.shard.data_ptr() and param.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert not state.holds_memory  # no gathered storage of its own
    engine.release([state])
    assert state.state is ShardedState.SHARDED and param.numel() == 0
    assert state.shard.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # release did not touch the values
    state.shard.add_(1.0)  # an optimizer step writes the shard ...
    engine.gather([state])
    assert param.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # ... and the next gather shows it, with no copy
    engine.release([state])


def test_several_ranks_never_alias() -> None:
    param, _ = _partitioned(10, rank=1, world=4, single_rank=FullStorage.SHARD)
    assert not zero_state(param).aliases_shard
