"""Model-state memory floors and the per-phase memory report (config ``memory_breakdown``).

The floors are the formulas of ``shared/spec/memory_targets.md``: bytes that the parameters, gradients
and Adam-style optimizer state must occupy per rank for a stage, before activations and transients.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepspeed._core.plan import RunPlan
from deepspeed.accelerator import get_accelerator
from deepspeed.utils.logging import log_dist

_GIB = float(1 << 30)


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class StateFloor:
    """Per-rank bytes of model state on the device and on the host, for one configuration."""

    device: float
    host: float


def model_state_floor(plan: RunPlan, n_params: int, dp_world: int) -> StateFloor:
    """Device/host floor for ``n_params`` trainable parameters at ``plan``'s stage and world size."""
    bp = _nbytes(plan.precision.param_dtype)
    bg = _nbytes(plan.precision.grad_accum_dtype)
    # Adam keeps two fp32 moments; mixed precision adds an fp32 master copy (memory_targets.md: K = 12).
    k = 8 + (4 if plan.precision.param_dtype != torch.float32 else 0)
    p, n, stage = float(n_params), float(max(dp_world, 1)), plan.zero.stage
    optimizer_bytes = k * p / n if stage >= 1 else k * p
    grads = bg * p / n if stage >= 2 else bg * p
    params = bp * p / n if stage >= 3 else bp * p
    if plan.zero.offload_optimizer.enabled:
        return StateFloor(device=params + grads, host=optimizer_bytes)
    return StateFloor(device=params + grads + optimizer_bytes, host=0.0)


class MemoryReporter:
    """Logs allocated / reserved / peak device memory at named phases, next to the model-state floor.

    Args:
        plan: run plan (its ``memory_breakdown`` switch turns reports on).
        n_params: trainable parameters of the model.
        dp_world: data-parallel size.
    """

    def __init__(self, plan: RunPlan, n_params: int, dp_world: int) -> None:
        self.enabled = plan.memory_breakdown
        self.floor = model_state_floor(plan, n_params, dp_world)
        self.records: list[dict[str, float | str]] = []

    def report(self, phase: str) -> dict[str, float | str] | None:
        """Record (and log on rank 0) the memory at ``phase``; returns the record when enabled."""
        if not self.enabled:
            return None
        acc = get_accelerator()
        record: dict[str, float | str] = {
            "phase": phase,
            "allocated_gib": acc.memory_allocated() / _GIB,
            "reserved_gib": acc.memory_reserved() / _GIB,
            "peak_gib": acc.max_memory_allocated() / _GIB,
            "floor_gib": self.floor.device / _GIB,
        }
        self.records.append(record)
        log_dist(
            f"memory {phase}: allocated {record['allocated_gib']:.3f} GiB, reserved {record['reserved_gib']:.3f} GiB, "
            f"peak {record['peak_gib']:.3f} GiB; model-state floor {record['floor_gib']:.3f} GiB on device"
            + (f", {self.floor.host / _GIB:.3f} GiB on host" if self.floor.host else ""),
            ranks=[0],
        )
        return record
