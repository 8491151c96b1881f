"""Partition arithmetic and topologies: pure functions, no process group."""

from __future__ import annotations

import itertools
import random

import pytest

from deepspeed._core.pipe.partition import (
    PartitionError,
    parse_method,
    partition_balanced,
    partition_layers,
    partition_uniform,
)
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology


def _bottleneck(weights: list[int], parts: list[int]) -> int:
    return max(sum(weights[a:b]) for a, b in itertools.pairwise(parts))


def _best_bottleneck(weights: list[int], k: int) -> int:
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        parts = [0, *cuts, n]
        value = _bottleneck(weights, parts)
        best = value if best is None else min(best, value)
    return best


def test_uniform() -> None:
    assert partition_uniform(8, 2) == [0, 4, 8]
    assert partition_uniform(7, 3) == [0, 3, 5, 7]
    assert partition_uniform(3, 3) == [0, 1, 2, 3]


@pytest.mark.parametrize("seed", range(40))
def test_balanced_is_optimal_and_nonempty(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    weights = [rng.choice([0, 0, 1, 3, 10, 50]) for _ in range(n)]
    parts = partition_balanced(weights, k)
    assert parts[0] == 0 and parts[-1] == n and len(parts) == k + 1
    assert all(a < b for a, b in itertools.pairwise(parts)), f"empty stage in {parts}"
    assert _bottleneck(weights, parts) == _best_bottleneck(weights, k)


def test_type_regex_balances_matching_layers() -> None:
    names = ["Embedding"] + ["TransformerBlock"] * 6 + ["LayerNorm", "Head"]
    parts = partition_layers("type:transformer", 2, names, None)
    assert parts == [0, 4, 9]  # embedding + 3 blocks | 3 blocks + norm + head
    assert partition_layers("type:Block", 3, names, None) == [0, 3, 5, 9]


def test_parameters_method_uses_counts() -> None:
    names = ["A"] * 4
    assert partition_layers("parameters", 2, names, [100, 1, 1, 1]) == [0, 1, 4]
    assert partition_layers("PARAMETERS", 2, names, [1, 1, 1, 100]) == [0, 3, 4]


@pytest.mark.parametrize(
    "method, needle",
    [
        ("best", "valid: 'parameters', 'uniform', 'type:<regex>'"),
        ("type:", "needs a regular expression"),
        ("type:(", "invalid regular expression"),
        ("type:conv", "matches none"),
    ],
)
def test_bad_methods_name_the_setting(method: str, needle: str) -> None:
    with pytest.raises(PartitionError, match="partition_method") as info:
        partition_layers(method, 2, ["Linear"] * 4, [1] * 4)
    assert needle in str(info.value)


def test_too_few_layers() -> None:
    with pytest.raises(PartitionError, match="3 layers into 4 pipeline stages"):
        partition_uniform(3, 4)
    with pytest.raises(PartitionError, match="fewer than the 3 pipeline stages"):
        partition_layers("type:block", 3, ["Block", "Block", "Head", "Head"], None)
    assert parse_method("type:Foo") == ("type", "Foo")


def test_topology_mapping_last_axis_fastest() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert topo.world_size() == 6
    assert topo.get_rank(pipe=1, data=0) == 3
    assert topo.get_coord(4) == topo.ProcessCoord(pipe=1, data=1)
    assert topo.get_axis_comm_lists("pipe") == [[0, 3], [1, 4], [2, 5]]
    assert topo.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]
    assert topo.get_axis_comm_lists("model") == []
    assert topo.filter_match(pipe=0) == [0, 1, 2]
    assert topo.get_dim("model") == 0 and topo.get_axis_names() == ["pipe", "data"]
    assert topo.get_rank_repr(4) == ""
    for rank in range(6):
        assert topo.get_rank(**topo.get_coord(rank)._asdict()) == rank


def test_three_d_topology() -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.get_rank(pipe=1, data=0, model=1) == 5
    assert topo.get_rank_repr(5) == "model_01"
    assert topo.get_rank_repr(5, omit_axes=["data"]) == "pipe_01-model_01"
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.filter_match(pipe=1, model=0) == [4, 6]


def test_topology_errors() -> None:
    with pytest.raises(ValueError, match="axes"):
        ProcessTopology(axes=["pipe"], dims=[2, 2])
    with pytest.raises(ValueError, match="positive"):
        ProcessTopology(axes=["pipe", "data"], dims=[2, 0])
    topo = PipeDataParallelTopology(2, 2)
    with pytest.raises(ValueError, match="exactly the axes"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="outside"):
        topo.get_coord(9)
    with pytest.raises(ValueError, match="unknown axes"):
        topo.filter_match(model=0)
