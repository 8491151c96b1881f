"""The training loop the engine façade delegates to: forward, backward, step, accumulation.

It talks to one :class:`EngineOptimizer`, whatever the ZeRO stage, and keeps the counters that
integrations read (``global_steps``, ``global_samples``, ``skipped_steps``, ``micro_steps``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from deepspeed._core.config.plan import RunPlan
from deepspeed._core.engine.accumulation import AccumulationState
from deepspeed._core.engine.memory import MemoryReporter, SnapshotAnalyser
from deepspeed._core.engine.precision import cast_inputs
from deepspeed._core.engine.progress import ProgressReporter
from deepspeed._core.observe.step_observer import StepObserver
from deepspeed._core.observe.timers import (
    BACKWARD_GLOBAL_TIMER,
    BACKWARD_INNER_GLOBAL_TIMER,
    BACKWARD_INNER_MICRO_TIMER,
    BACKWARD_MICRO_TIMER,
    BACKWARD_REDUCE_GLOBAL_TIMER,
    BACKWARD_REDUCE_MICRO_TIMER,
    STEP_GLOBAL_TIMER,
    STEP_MICRO_TIMER,
)
from deepspeed._core.optim.base import EngineOptimizer, MicroStepKind


class TrainingLoop:
    """Owns the micro-step state machine of one engine.

    Args:
        module: the user's model (already on its device, already cast).
        optimizer: the wrapped optimizer, or ``None`` for an inference-only engine.
        lr_scheduler: a scheduler stepped after every applied optimizer step, or ``None``.
        plan: the run plan.
        analyser: turns a recorded ``memory_timeline`` snapshot into its report (given by the engine façade).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: EngineOptimizer | None,
        lr_scheduler: Any,
        plan: RunPlan,
        analyser: SnapshotAnalyser | None = None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.plan = plan
        self.accumulation = AccumulationState(plan.batch.gradient_accumulation_steps)
        self.progress = ProgressReporter(plan.steps_per_print, plan.batch.train_batch_size)
        n_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters() if p.requires_grad)
        self.memory = MemoryReporter(plan, n_params, plan.batch.dp_world_size, analyser)
        self.observer = StepObserver(plan, self.memory.floor.device)
        if hasattr(optimizer, "timers"):  # ZeRO optimizers time their phases on the engine's timers
            optimizer.timers = self.observer.timers  # type: ignore[union-attr]
        if plan.zero.offload_optimizer.enabled and hasattr(optimizer, "host_state_bytes"):
            self.memory.host_probe = optimizer.host_state_bytes  # type: ignore[union-attr]
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.step_applied = False
        self._sync_disabled = False
        self._backward_pending = False

    # --- forward / backward -----------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module, casting floating inputs when fp16 ``auto_cast`` is on."""
        if self.plan.precision.auto_cast:
            inputs = cast_inputs(inputs, self.plan.precision.param_dtype)
            kwargs = cast_inputs(kwargs, self.plan.precision.param_dtype)
        self.memory.timeline.begin(self.global_steps)
        self.observer.forward_begin(self.global_steps, inputs, kwargs)
        try:
            out = self.module(*inputs, **kwargs)
        finally:
            self.observer.forward_end()
        self._phase("after forward")
        return out

    def _phase(self, name: str) -> None:
        self.memory.report(name)
        self.observer.phase(name)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of one micro-batch's loss; returns the (GAS-scaled) loss for logging."""
        if self.optimizer is None:
            raise RuntimeError("backward() needs an optimizer: pass one to deepspeed.initialize or configure one")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"backward() expects a scalar loss tensor, got {type(loss).__name__}")
        self.memory.timeline.begin(self.global_steps)
        self.observer.note_loss(loss)
        with self.observer.timed(BACKWARD_MICRO_TIMER, BACKWARD_GLOBAL_TIMER):
            self.accumulation.on_backward()
            if scale_wrt_gas and self.accumulation.gas > 1:
                loss = loss / self.accumulation.gas
            self.optimizer.prepare_backward(self._micro_step_kind())
            with self.observer.timed(BACKWARD_INNER_MICRO_TIMER, BACKWARD_INNER_GLOBAL_TIMER):
                self.optimizer.backward(loss, retain_graph=retain_graph)
            with self.observer.timed(BACKWARD_REDUCE_MICRO_TIMER, BACKWARD_REDUCE_GLOBAL_TIMER):
                self.optimizer.finish_backward()
        self._phase("after backward")
        return loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss`` scaled for a caller-run ``loss.backward()`` (arms the reduction as backward would)."""
        if self.optimizer is None:
            raise RuntimeError("scale() needs an optimizer")
        self.memory.timeline.begin(self.global_steps)
        self.observer.note_loss(loss)
        self.accumulation.on_backward()
        loss = loss / self.accumulation.gas if self.accumulation.gas > 1 else loss
        self.optimizer.prepare_backward(self._micro_step_kind())
        self._backward_pending = True
        scale = self.optimizer.cur_scale
        return loss * scale if scale != 1.0 else loss

    def _micro_step_kind(self) -> MicroStepKind:
        if self.accumulation.is_boundary() and not self._sync_disabled:
            return MicroStepKind.REDUCE
        return MicroStepKind.ACCUMULATE

    # --- step ------------------------------------------------------------------------------------
    def step(self, lr_kwargs: dict | None = None) -> None:
        """Advance one micro-step; at the boundary apply the optimizer and the scheduler."""
        if self._sync_disabled:
            raise RuntimeError("step() was called inside no_sync(); leave the no_sync() context first")
        boundary = self.accumulation.is_boundary()
        with self.observer.timed(STEP_MICRO_TIMER, STEP_GLOBAL_TIMER):
            if self._backward_pending and self.optimizer is not None:
                self.optimizer.finish_backward()
                self._backward_pending = False
            self.step_applied = False
            if boundary and self.optimizer is not None:
                self._take_model_step(self.optimizer, lr_kwargs)
                self._phase("after step")
                self.memory.timeline.finish(self.global_steps, self.module, self.optimizer)
        self.observer.step_end(boundary and self.optimizer is not None, self)
        self.accumulation.on_step()

    def _take_model_step(self, optimizer: EngineOptimizer, lr_kwargs: dict | None) -> None:
        applied = optimizer.step()
        if applied:
            self.step_applied = True
            if self.lr_scheduler is not None:
                _step_scheduler(self.lr_scheduler, lr_kwargs, self.plan.batch.train_batch_size)
        else:
            self.skipped_steps += 1
        optimizer.zero_grad()
        self.global_steps += 1
        self.global_samples += self.plan.batch.train_batch_size
        self.progress.maybe_report(self.global_steps, optimizer.cur_scale, self.get_lr(), optimizer._global_grad_norm)

    def zero_grad(self) -> None:
        """Drop gradients of the module's parameters (upstream: no arguments)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        for p in self.module.parameters():
            p.grad = None

    def get_lr(self) -> list[float]:
        """Learning rate of each parameter group."""
        if self.optimizer is None:
            return []
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    @contextlib.contextmanager
    def no_sync(self, zero_stage: int) -> Iterator[None]:
        """Skip gradient reduction for the enclosed backwards (stage 0/1 only, not re-entrant)."""
        if zero_stage >= 2:
            raise AssertionError(f"no_sync() is incompatible with ZeRO stage {zero_stage} (partitioned gradients)")
        if self._sync_disabled:
            raise AssertionError("no_sync() context manager is not re-entrant")
        self._sync_disabled = True
        try:
            yield
        finally:
            self._sync_disabled = False


def _step_scheduler(scheduler: Any, lr_kwargs: dict | None, train_batch_size: int) -> None:
    """Step ``scheduler``; schedulers that need an increment get ``train_batch_size`` (upstream rule)."""
    try:
        scheduler.step(**(lr_kwargs or {}))
    except TypeError:
        scheduler.step(train_batch_size)
