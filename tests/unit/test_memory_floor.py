"""The model-state floors match the formulas in docs/memory_floors.md."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepspeed._core.config.plan import BatchPlan, OffloadDevice, OffloadPolicy, PrecisionPolicy, RunPlan, ZeroPlan
from deepspeed._core.engine.memory import model_state_floor

P, N = 7.6e9, 8


def _plan(stage: int, offload: bool = False) -> RunPlan:
    bf16 = PrecisionPolicy(param_dtype=torch.bfloat16, grad_accum_dtype=torch.bfloat16, comm_dtype=torch.bfloat16)
    zero = ZeroPlan(stage=stage)
    if offload:
        zero = dataclasses.replace(zero, offload_optimizer=OffloadPolicy(device=OffloadDevice.CPU))
    return RunPlan(batch=BatchPlan(8, 1, 1, N), precision=bf16, zero=zero)


@pytest.mark.parametrize(
    "stage,offload,gb",
    # The worked example of memory_targets.md (P = 7.6e9, N = 8, bf16, Adam), in decimal GB.
    [(0, False, 121.6), (1, False, 41.8), (2, False, 28.5), (3, False, 15.2), (3, True, 3.8)],
)
def test_worked_example(stage: int, offload: bool, gb: float) -> None:
    floor = model_state_floor(_plan(stage, offload), int(P), N)
    assert floor.device / 1e9 == pytest.approx(gb, abs=0.05)
    if offload:
        assert floor.host / 1e9 == pytest.approx(12 * P / N / 1e9, rel=1e-6)
