"""The interface the engine drives: every wrapped optimizer (stage 0, ZeRO-1/2, ZeRO-3) implements it.

The engine's micro-step is ``prepare_backward(kind)`` → ``backward(loss)`` → ``finish_backward()``, and
at the accumulation boundary ``step()``. Keeping this one interface means the engine never branches
on the ZeRO stage.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed._core.grads.reducer import MicroStepKind

__all__ = ["EngineOptimizer", "MicroStepKind"]


class EngineOptimizer:
    """Base class of the engine's wrapped optimizers (public alias: ``DeepSpeedOptimizer``).

    Subclasses set ``self.optimizer`` (the inner torch optimizer) and ``self.loss_scaler`` (or None)
    and implement the micro-step hooks. Attributes read by integrations (``overflow``,
    ``param_groups``, ``state``, ``cur_scale``, ``loss_scale``, ``_global_grad_norm``) live here.
    """

    optimizer: torch.optim.Optimizer
    loss_scaler: Any = None
    overflow: bool = False
    _global_grad_norm: float | None = None
    # Pipeline parallelism: the group of this replica's stages. Each stage holds a disjoint part of the model, so
    # the overflow decision and the clipping norm are summed over it too ([Note: pipeline norm]).
    stage_group: Any = None

    # --- attributes promoted from the inner optimizer --------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's parameter groups (learning rates live here)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> dict:
        """The inner optimizer's per-parameter state."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        """The inner optimizer's defaults."""
        return self.optimizer.defaults

    @property
    def cur_scale(self) -> float:
        """Current loss scale (1.0 without fp16 loss scaling)."""
        return float(self.loss_scaler.cur_scale) if self.loss_scaler is not None else 1.0

    @property
    def loss_scale(self) -> float:
        """Alias of :attr:`cur_scale` (upstream reads both names)."""
        return self.cur_scale

    # --- micro-step protocol ----------------------------------------------------------------------
    def prepare_backward(self, kind: MicroStepKind) -> None:
        """Called by the engine before each backward."""

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Run autograd on ``loss`` multiplied by the current loss scale."""
        scale = self.cur_scale
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)

    def finish_backward(self) -> None:
        """Called by the engine after each backward (flushes pending reductions)."""

    def step(self, closure: Any = None) -> bool:
        """Apply the update at the accumulation boundary; returns False when the step was skipped."""
        raise NotImplementedError

    def window_grads(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The gradients accumulated so far in this window for ``params``, shaped like them and writable in place.

        The pipeline engine sums tied weights' gradients over stages through these before they are reduced.
        Default: ``param.grad`` (zeros when autograd left none).
        """
        out = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients."""
        raise NotImplementedError

    def destroy(self) -> None:
        """Remove hooks and release buffers; the object is unusable afterwards."""

    def refresh_fp32_params(self) -> None:
        """Rebuild fp32 master weights from the working weights (no-op without masters)."""

    def state_dict(self) -> dict:
        """Checkpointable state."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self.optimizer.load_state_dict(state_dict)
