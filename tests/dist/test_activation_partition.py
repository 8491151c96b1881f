"""partition_activations across a model-parallel group of 2 (gloo, CPU).

The fake mpu makes the whole world the model-parallel group. Both ranks build the same model and inputs, as
tensor-parallel replicas of an activation would be. Each rank reports what it observed; assertions run here.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import pytest
import torch

from deepspeed import comm as dist
from deepspeed._core.engine import activation_checkpoint as core
from deepspeed.runtime.activation_checkpointing import checkpointing as ck
from tests._harness import run_distributed

SHAPE = (3, 5)  # 15 elements: odd, so each rank keeps ceil(15 / 2) = 8 and the last share is padded
LAYERS = 3


class WorldMpu:
    """Model-parallel unit whose model-parallel group is the whole world."""

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_model_parallel_group(self) -> Any:
        return dist.get_world_group()

    def get_data_parallel_world_size(self) -> int:
        return 1


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(SHAPE[1], SHAPE[1])
        self.drop = torch.nn.Dropout(0.4)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        # Dropout on the default stream, which is seeded alike on every rank: the checkpointed activations are
        # then true replicas across the group, as partitioning assumes (Megatron draws rank-specific tracker
        # dropout only on tensor-parallel shards, which are not what gets checkpointed between layers).
        return self.drop(torch.tanh(self.lin(x))) * scale + x


def _model_and_input() -> tuple[torch.nn.ModuleList, torch.Tensor]:
    torch.manual_seed(0)  # identical on every rank
    return torch.nn.ModuleList(Layer() for _ in range(LAYERS)), torch.randn(*SHAPE, requires_grad=True)


def _grads(model: torch.nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    out = [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]
    x.grad = None
    model.zero_grad(set_to_none=True)
    return out


CALLS = {
    "plain": lambda layer, h: layer(h, 0.5),
    "reentrant": lambda layer, h: ck.checkpoint(layer, h, 0.5),
    "non_reentrant": lambda layer, h: ck.non_reentrant_checkpoint(layer, h, 0.5),
}


def _forward(model: torch.nn.ModuleList, x: torch.Tensor, mode: str) -> tuple[torch.Tensor, list]:
    """Run the layers; also return weak references to the intermediate full activations."""
    h, inner = x, []
    for layer in model:
        h = CALLS[mode](layer, h)
        inner.append(weakref.ref(h))
    return h, inner[:-1]


def _partition_run(mode: str, cpu: bool, contiguous: bool) -> dict:
    """Plain and partitioned-checkpoint training steps from the same seeds; report parity and lifetimes."""
    state = core.current_state()
    ck.configure(
        WorldMpu(),
        deepspeed_config={
            "train_batch_size": 1,
            "activation_checkpointing": {
                "partition_activations": True,
                "cpu_checkpointing": cpu,
                "contiguous_memory_optimization": contiguous,
                "number_checkpoints": LAYERS,
            },
        },
    )
    model, x = _model_and_input()
    ck.model_parallel_cuda_manual_seed(42)
    plain_out, _ = _forward(model, x, "plain")
    plain_out.square().sum().backward()
    plain = _grads(model, x)

    saved: list[tuple[int, Any, str]] = []
    state.observers.append(lambda t: saved.append((t.numel(), weakref.ref(t), t.device.type)))
    ck.model_parallel_cuda_manual_seed(42)
    out, inner = _forward(model, x, mode)
    alive_before = sum(ref() is not None for _, ref, _ in saved)
    inner_alive = sum(ref() is not None for ref in inner)
    same_out = torch.equal(plain_out, out)
    out.square().sum().backward()
    ckpt = _grads(model, x)
    del out
    state.observers.clear()
    return {
        "equal": [torch.equal(a, b) for a, b in zip(plain, ckpt)],
        "same_out": same_out,
        "numels": [n for n, _, _ in saved],
        "devices": sorted({d for _, _, d in saved}),
        "alive_before": alive_before,
        "alive_after": sum(ref() is not None for _, ref, _ in saved),
        "inner_alive": inner_alive,
        "pending": state.pending_backwards,
    }


def _unpartitioned_lifetimes() -> dict:
    """Control run without partitioning: the intermediate activations must then stay alive until backward."""
    ck.configure(WorldMpu())
    model, x = _model_and_input()
    ck.model_parallel_cuda_manual_seed(42)
    out, inner = _forward(model, x, "reentrant")
    alive = sum(ref() is not None for ref in inner)
    out.sum().backward()
    return {"inner_alive": alive}


SCENARIOS = {
    "device": ("reentrant", False, False),
    "cpu_checkpointing": ("reentrant", True, False),
    "contiguous": ("reentrant", False, True),
    "non_reentrant": ("non_reentrant", False, False),
    "non_reentrant_cpu": ("non_reentrant", True, False),
}


def _all_scenarios() -> dict:
    """Every scenario in one launch: a gloo rendezvous costs seconds on a loaded 2-core runner."""
    report = {name: _partition_run(*setup) for name, setup in SCENARIOS.items()}
    report["unpartitioned"] = _unpartitioned_lifetimes()
    return report


@pytest.fixture(scope="module")
def rank_reports() -> list[dict]:
    return run_distributed(_all_scenarios, 2)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_partitioned_checkpoint_matches_plain_and_frees_partitions(rank_reports: list[dict], scenario: str) -> None:
    expected = math.ceil(math.prod(SHAPE) / 2)
    for rank, report in enumerate(rank_reports):
        res = report[scenario]
        assert res["same_out"] and all(res["equal"]) and len(res["equal"]) == 1 + 2 * LAYERS, (rank, res)
        # One saved tensor per checkpointed call (its activation input); `scale` is a constant.
        assert res["numels"] == [expected] * LAYERS, (rank, res)
        assert res["devices"] == ["cpu"]
        assert res["alive_before"] == LAYERS, "partitions must be alive between forward and backward"
        assert res["inner_alive"] == 0, "full intermediate activations must not be kept once partitioned"
        assert res["pending"] == 0
        if scenario == "contiguous":
            # Partitions are views into the reusable arena, which intentionally outlives the step.
            continue
        assert res["alive_after"] == 0, f"rank {rank}: saved partitions still referenced after backward"


def test_without_partitioning_intermediates_stay_alive(rank_reports: list[dict]) -> None:
    """Shows the lifetime check above can fail: unpartitioned checkpoints keep each full input until backward."""
    assert all(report["unpartitioned"]["inner_alive"] == LAYERS - 1 for report in rank_reports), rank_reports
