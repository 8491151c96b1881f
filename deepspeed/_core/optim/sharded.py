"""What every ZeRO stage (1-3) optimizer shares: the step prologue and the checkpoint entry points.

The step prologue is one scalar all-reduce that decides overflow, the global norm and the single coefficient
(unscale × clip) applied to the local gradient shards. A checkpoint is this rank's shard in upstream's format;
each stage names the module that writes and reads its keys (:attr:`ShardedOptimizer.checkpoint_format`).

[Note: device step] Deciding on the host means reading the norm before the first update kernel is issued: the
host waits for the whole backward to drain, then issues the step while the device idles (on the H200 the 3B
ZeRO-3 step phase took 184 ms of host time for 104 ms of device work). Where nothing needs the host, the
decision stays on the device: the coefficient is a 0-d tensor, and an overflow is handed to an optimizer that
skips on a device flag (torch's fused optimizers, the ``found_inf`` protocol ``torch.amp.GradScaler`` uses;
step counts kept on the host are put back afterwards). The norm and the flag are copied to the host as soon as
the device has them, behind an event recorded before any update kernel; the host waits on that event only after
it has issued the whole update, so neither the start nor the end of the step stalls on the device. (Reading
the outcome after the update instead made the 3B steps slower than the host decision on the H200, 3-5 % at
8192 tokens and 9-14 % at 512: waiting for the update to finish removes the overlap of the step's device work
with the host work of the next forward.) The host decides when a dynamic fp16 loss
scale must be updated, when a master lives on another device than the gradients' norm (offloaded optimizers),
or when the overflow check is on and the optimizer cannot skip on a flag.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any

import torch

from deepspeed._core.comm.collectives import sum_over
from deepspeed._core.comm.streams import record_current
from deepspeed._core.optim.base import EngineOptimizer

# Phase timers of ``wall_clock_breakdown`` (upstream's names): ZeRO-1/2 time all three, ZeRO-3 the step.
OPTIMIZER_ALLGATHER_TIMER = "optimizer_allgather"
OPTIMIZER_GRADIENTS_TIMER = "optimizer_gradients"
OPTIMIZER_STEP_TIMER = "optimizer_step"
OPTIMIZER_TIMERS = [OPTIMIZER_ALLGATHER_TIMER, OPTIMIZER_GRADIENTS_TIMER, OPTIMIZER_STEP_TIMER]
# ZeRO-3 with the optimizer state in NVMe swap files also times the waits for the swap reads and writes.
OPTIMIZER_SWAP_IN_TIMER = "optimizer_swap_in_state"
OPTIMIZER_SWAP_OUT_TIMER = "optimizer_swap_out_state"
# ZeRO-3 times the creation of the inner optimizer's state once: here the first update creates it.
INIT_OPTIMIZER_TIMER = "init_optimizer_state"


def package_version() -> str:
    """The installed distribution's version (what checkpoints record as ``ds_version``)."""
    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "0.0.0"


@dataclass(frozen=True)
class StepDecision:
    """Outcome of the shared prologue: skip on overflow, else apply ``coef`` and record ``norm``."""

    overflow: bool
    norm: float | None
    coef: float


@dataclass(frozen=True)
class DeviceStep:
    """The shared prologue's outcome kept on the device ([Note: device step]).

    ``coef`` is the 0-d coefficient, ``norm`` the unscaled global norm (``inf`` when not finite) and ``found_inf``
    a 0-d fp32 flag (1 skips the update, as ``torch.amp.GradScaler`` passes it) when the overflow check is on,
    else ``None``. All three are on the device of the gradients' norm; ``outcome`` is their host copy, in flight
    until the event ``ready`` fires.
    """

    coef: torch.Tensor
    norm: torch.Tensor
    found_inf: torch.Tensor | None
    outcome: torch.Tensor  # host copy of (norm, found_inf or 0), valid once ``ready`` has fired
    ready: Any


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours a ``found_inf`` attribute: torch's fused optimizers declare it with
    ``_step_supports_amp_scaling``, this package's with a ``skips_on_found_inf()`` method (``FusedAdam`` on CUDA)."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return True
    probe = getattr(optimizer, "skips_on_found_inf", None)
    return bool(probe()) if callable(probe) else False


def _host_step_counts(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, int | None]:
    """Each group's parameter's step count where the optimizer keeps it on the host (``None``: no state yet)."""
    counts: dict[torch.Tensor, int | None] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if not torch.is_tensor(step):
                counts[p] = None if step is None else int(step)
    return counts


def _restore_host_step_counts(optimizer: torch.optim.Optimizer, counts: dict[torch.Tensor, int | None]) -> None:
    """Undo a device-skipped update's host bookkeeping: counts go back, and state first made by it goes."""
    for p, count in counts.items():
        state = optimizer.state.get(p)
        if not state or torch.is_tensor(state.get("step")):
            continue  # device step counts: the optimizer put them back itself
        if count is None:
            optimizer.state.pop(p, None)
        else:
            state["step"] = count


class ShardedOptimizer(EngineOptimizer):
    """Base of the ZeRO optimizers whose ranks hold disjoint gradient shards (stages 1-3).

    Subclasses set ``checkpoint_format``: a module with ``shard_state_dict(opt, version)`` and
    ``load_shards(opt, shards, load_optimizer_states, load_from_fp32_weights)``, plus ``universal_targets(opt)``
    and ``load_universal(opt, states, global_state)`` for universal checkpoints (``universal_state.py``).
    """

    checkpoint_format: ModuleType
    # The engine's phase timers (``SynchronizedWallClockTimer``, or ``NoopTimer`` without wall_clock_breakdown);
    # ``None`` until an engine adopts the optimizer, so a bare optimizer times nothing.
    timers: Any = None
    dp_group: Any
    world_size: int
    check_overflow: bool
    plan: Any

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Time the enclosed code under the phase timer ``name`` (nothing without the engine's timers)."""
        timers = self.timers
        if timers is None:
            yield
            return
        timers(name).start()
        try:
            yield
        finally:
            timers(name).stop()

    def log_timers(self, names: list[str]) -> None:
        """Print and reset the named phase timers (``[Rank 0] time (ms) | name: …``), as upstream's step does."""
        if self.timers is not None:
            self.timers.log(names)

    def _decide_step(self, local_sq: torch.Tensor) -> StepDecision:
        """All-reduce this rank's squared norm, then derive overflow, the unscaled norm and the coefficient."""
        if self.world_size > 1:
            sum_over(local_sq, self.dp_group)
        if self.stage_group is not None:  # pipeline: the other stages' shards ([Note: pipeline norm])
            sum_over(local_sq, self.stage_group)
        scale = self.cur_scale
        total = float(local_sq)
        norm = math.sqrt(total) / scale if math.isfinite(total) else float("inf")
        if self.check_overflow and not math.isfinite(norm):
            return StepDecision(True, None, 1.0)
        coef = 1.0 / scale
        clip = self.plan.grads.clip_norm
        if clip > 0 and norm > clip:
            coef *= clip / (norm + 1e-6)
        return StepDecision(False, norm, coef)

    def _device_step(self, local_sq: torch.Tensor, master_devices: set[torch.device]) -> DeviceStep | None:
        """The prologue on the device, or ``None`` when the host must decide ([Note: device step]).

        Reduces ``local_sq`` like :meth:`_decide_step` and derives the same values as tensors: a non-finite norm
        counts as ``inf`` (so clipping zeroes the update when nothing skips it), and the coefficient is
        ``min(1, clip / (norm + 1e-6))``.
        """
        if self.loss_scaler is not None or master_devices != {local_sq.device}:
            return None
        if self.check_overflow and not skips_on_device(self.optimizer):
            return None
        if self.world_size > 1:
            sum_over(local_sq, self.dp_group)
        if self.stage_group is not None:
            sum_over(local_sq, self.stage_group)
        # In float64, as the host decision takes it: the coefficient then rounds to the same fp32 value.
        norm = local_sq.double().sqrt()
        finite = torch.isfinite(norm)
        norm = torch.where(finite, norm, torch.full_like(norm, float("inf")))
        coef = torch.ones_like(norm)
        clip = self.plan.grads.clip_norm
        if clip > 0:
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
        found_inf = (~finite).to(torch.float32) if self.check_overflow else None
        values = torch.stack([norm, (~finite).double() if found_inf is not None else torch.zeros_like(norm)])
        outcome = self._outcome_buffer(values.device)
        outcome.copy_(values, non_blocking=True)
        return DeviceStep(coef, norm, found_inf, outcome, record_current())

    def _outcome_buffer(self, device: torch.device) -> torch.Tensor:
        """Two float64 host values the step's outcome is copied into (page-locked from an accelerator); reused,
        since each step waits for its copy before the next one starts."""
        buf = getattr(self, "_outcome_host", None)
        pinned = device.type != "cpu"
        if buf is None or buf.is_pinned() != pinned:
            buf = self._outcome_host = torch.empty(2, dtype=torch.float64, pin_memory=pinned)
        return buf

    def _run_device_step(self, step: DeviceStep, update: Any) -> bool:
        """Run ``update(coef)`` (every group's step and the write-back) under the device flag, then settle the
        outcome on the host from its early copy."""
        found_inf = step.found_inf
        counts = _host_step_counts(self.optimizer) if found_inf is not None else {}
        if found_inf is not None:
            self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            update(step.coef)
        finally:
            if found_inf is not None:
                del self.optimizer.found_inf  # type: ignore[attr-defined]
        step.ready.synchronize()  # recorded before the first update kernel: done by now, or soon
        norm, skipped = step.outcome.tolist()
        self.overflow = bool(skipped)
        if self.overflow:
            _restore_host_step_counts(self.optimizer, counts)
        self._global_grad_norm = None if self.overflow else norm
        return not self.overflow

    def host_state_bytes(self) -> int:
        """Bytes of host memory this rank's optimizer holds for model state: masters, optimizer states and
        gradient buffers kept on the host (stale ones included), each storage once. The fixed-size pinned staging
        pool is not model state ([Note: pinned pool]); :meth:`host_staging_bytes` reports it."""
        tensors = [g.master.data for g in self.groups]  # type: ignore[attr-defined]
        tensors += [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        seen: set[int] = set()
        total = 0
        for t in tensors:
            if t.device.type != "cpu" or t.untyped_storage().data_ptr() in seen:
                continue
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
        return total + self.host_grad_bytes()

    def host_staging_bytes(self) -> int:
        """Bytes of the pinned staging pool (bounded, independent of the model size)."""
        pool = getattr(self, "pinned", None)
        return pool.held_bytes if pool is not None else 0

    def host_grad_bytes(self) -> int:
        """Bytes of gradient buffers this rank keeps in host memory (each stage knows its own)."""
        return 0

    def _skip_step(self) -> bool:
        """Overflow: drop this window's gradients everywhere and back the loss scale off."""
        self._global_grad_norm = None
        self._clear_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(True)
        return False

    def _clear_grads(self) -> None:
        """Drop this window's gradients (each stage's buffers)."""
        raise NotImplementedError

    # --- checkpoints (interface: deepspeed._core.checkpoint.save_load.ShardedCheckpointOptimizer) ---------
    def state_dict(self) -> dict:
        """This rank's shard with upstream's keys for its stage."""
        return self.checkpoint_format.shard_state_dict(self, package_version())

    def load_state_dict(  # type: ignore[override]  # upstream's ZeRO signature: every saved rank's shard
        self, state_dict_list: list, load_optimizer_states: bool = True, load_from_fp32_weights: bool = True
    ) -> None:
        """Restore from every saved rank's shard; the saved world size may differ from the live one."""
        if isinstance(state_dict_list, dict):
            state_dict_list = [state_dict_list]
        self.checkpoint_format.load_shards(self, state_dict_list, load_optimizer_states, load_from_fp32_weights)

    def checkpoint_check_shards(self, state_dict_list: list) -> None:
        """Raise if the saved shards cannot be loaded (called while reading, before anything changes)."""
        check = getattr(self.checkpoint_format, "check_shards", None)
        if callable(check):
            check(state_dict_list)

    def universal_targets(self) -> list:
        """Per flat group, the parameter pieces this rank's master holds (``UniversalTarget`` list)."""
        return self.checkpoint_format.universal_targets(self)

    def load_universal_state(self, states: list, global_state: dict) -> None:
        """Install values read from a universal checkpoint for :meth:`universal_targets` and publish the weights."""
        self.checkpoint_format.load_universal(self, states, global_state)
