"""fp16 loss scaling: a static scaler, a dynamic scaler with hysteresis, and their factory.

The classes here are the objects upstream DeepSpeed pickles into checkpoints (field ``loss_scaler`` of the
ZeRO optimizer file), so two things are part of the interface, not implementation details:

* the import path recorded by pickle, ``deepspeed.runtime.fp16.loss_scaler.<ClassName>``: every class sets
  ``__module__`` to that façade module, which re-exports them, so our pickles load with upstream and theirs
  load with us;
* the instance attribute names (``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``scale_factor``,
  ``scale_window``, ``min_scale``, ``delayed_shift``, ``cur_hysteresis``, ``consecutive_hysteresis``,
  ``raise_error_at_min_scale``, ``dynamic``, ``dtype``): unpickling restores ``__dict__`` without calling
  ``__init__``, so the methods read exactly these names, and ``__setstate__`` fills in the ones that
  checkpoints written by older releases do not carry.

Dynamic scaling rule (one :meth:`DynamicLossScaler.update_scale` call per optimizer step):

* overflow: if hysteresis is exhausted (``delayed_shift == 1`` or ``cur_hysteresis == 1``) the scale is
  divided by ``scale_factor`` but never below ``min_scale`` (and, with ``raise_error_at_min_scale``, an
  overflow while already at ``min_scale`` aborts the run); otherwise only ``cur_hysteresis`` drops by one.
* no overflow: ``consecutive_hysteresis`` refills the hysteresis at once. When the number of clean updates
  since the last overflow, not counting the one right after it, is a positive multiple of ``scale_window``
  the scale is multiplied by ``scale_factor`` and the hysteresis is refilled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from deepspeed._core.config.plan import LossScalePolicy
from deepspeed._foundation.logging import log_dist

# Pickles record this path; the façade module re-exports every class below under the same name.
FACADE_MODULE = "deepspeed.runtime.fp16.loss_scaler"

# Keys of the ``dynamic_loss_args`` dict handed to :func:`CreateLossScaler` (upstream names and values).
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"

MIN_SCALE_ERROR = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."


def to_python_float(t: Any) -> float:
    """Return ``t`` as a Python number (a tensor's ``item()``, else its first element)."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]


class LossScalerBase:
    """Common behaviour of loss scalers: hold ``cur_scale`` and apply it to losses and gradients."""

    __module__ = FACADE_MODULE

    def __init__(self, cur_scale: float) -> None:
        """Start with the given scale; subclasses decide whether it ever changes."""
        self.cur_scale = cur_scale
        self.dynamic = False

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        """Restore a pickled scaler, filling attributes that older checkpoints lack."""
        self.__dict__.update(self._state_defaults(state))
        self.__dict__.update(state)

    def _state_defaults(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Values for attributes a pickled ``state`` may be missing (see ``__setstate__``)."""
        return {"dynamic": False}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in sorted(self.__dict__.items()))
        return f"{type(self).__name__}({fields})"

    @property
    def loss_scale(self) -> float:
        """The current loss scale (same value as ``cur_scale``)."""
        return self.cur_scale

    def scale_gradient(self, module: torch.nn.Module, grad_in: tuple, grad_out: tuple) -> tuple:
        """Backward-hook helper: multiply each incoming gradient by the loss scale."""
        return tuple(None if g is None else self.loss_scale * g for g in grad_in)

    def update_scale(self, overflow: bool) -> None:
        """Record the outcome of a step; a fixed scale ignores it."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss`` multiplied by the current scale, without running backward."""
        return loss * self.loss_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Run backward on the scaled loss, so gradients come out multiplied by ``loss_scale``."""
        self.scale_loss(loss).backward(retain_graph=retain_graph)


class LossScaler(LossScalerBase):
    """A fixed loss scale (``fp16.loss_scale > 0``, or the no-op scale 1 for bf16/fp32).

    Args:
        scale: the loss scale, used unchanged for the whole run.
    """

    __module__ = FACADE_MODULE

    def __init__(self, scale: float = 1) -> None:
        super().__init__(scale)

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """A static scaler never reports overflow; the optimizer checks gradients itself."""
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        """A static scaler never reports overflow."""
        return False


class DynamicLossScaler(LossScalerBase):
    """Loss scale that backs off on overflow and grows again after a run of clean steps.

    The caller skips the optimizer step when gradients overflow and then calls :meth:`update_scale` once
    per step; see the module docstring for the exact rule.

    Args:
        init_scale: the first scale tried.
        scale_factor: factor the scale is divided by on overflow and multiplied by on growth.
        scale_window: clean steps between growth attempts.
        min_scale: floor of the scale.
        delayed_shift: hysteresis, the number of overflows tolerated before the scale is lowered
            (``fp16.hysteresis``).
        consecutive_hysteresis: refill the hysteresis after every clean step, instead of only when
            the scale grows.
        raise_error_at_min_scale: raise when an overflow happens while the scale is already at
            ``min_scale``, instead of carrying on at the floor.
        dtype: the low-precision dtype being trained (messages quote the scale only for fp16).
    """

    __module__ = FACADE_MODULE

    def __init__(
        self,
        init_scale: float = 2**32,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
        dtype: torch.dtype = torch.half,
    ) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.dynamic = True
        self.dtype = dtype

    def _state_defaults(self, state: Mapping[str, Any]) -> dict[str, Any]:
        # Attributes added to upstream's class over time default to the behaviour of the releases that
        # lacked them, so an old checkpoint resumes with the schedule it was written under.
        delayed_shift = state.get("delayed_shift", 1)
        return {
            "dynamic": True,
            "cur_iter": 0,
            "last_overflow_iter": -1,
            "scale_factor": 2.0,
            "scale_window": 1000,
            "min_scale": 1,
            "delayed_shift": delayed_shift,
            "cur_hysteresis": delayed_shift,
            "consecutive_hysteresis": False,
            "raise_error_at_min_scale": True,
            "dtype": torch.half,
        }

    def has_overflow_serial(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """True if any parameter's ``.grad`` holds an inf or a NaN (checked one tensor at a time)."""
        return any(p.grad is not None and self._has_inf_or_nan(p.grad.data) for p in params)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        """True if ``x`` holds an inf or a NaN.

        ``isfinite`` is used rather than summing: a sum of large finite values can itself overflow and
        report a false positive, and the boolean mask costs a quarter of the fp32 copy a sum would need.
        """
        return not bool(torch.isfinite(x).all())

    def update_scale(self, overflow: bool) -> None:
        """Advance one step: back off (or spend hysteresis) on overflow, maybe grow otherwise."""
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                raise Exception(MIN_SCALE_ERROR)
            next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            self._log_overflow(f"reducing to {self._fmt(next_scale)}")
            self.cur_scale = next_scale
        else:
            self._log_overflow(
                f"but hysteresis is {self.cur_hysteresis}. Reducing hysteresis to {self.cur_hysteresis - 1}"
            )
            self.cur_hysteresis -= 1

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.delayed_shift
        # The step right after an overflow does not count towards the window.
        stable_steps = self.cur_iter - self.last_overflow_iter - 1
        if stable_steps > 0 and stable_steps % self.scale_window == 0:
            self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor

    def _fmt(self, scale: float) -> str:
        return str(int(scale)) if math.isfinite(scale) else str(scale)

    def _log_overflow(self, detail: str) -> None:
        # Keep upstream's "OVERFLOW! Rank 0 Skipping step." wording: log scrapers key on it. Only rank 0
        # logs, so the rank in the text is always 0.
        message = "[deepspeed] OVERFLOW! Rank 0 Skipping step."
        if self.dtype == torch.half:
            message += f" Attempted loss scale: {self._fmt(self.cur_scale)}, {detail}"
        log_dist(message, ranks=[0])


def _positive_finite(value: Any, name: str) -> float:
    """Return ``value`` if it is a finite number > 0, else raise a ValueError naming ``name``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _positive_int(value: Any, name: str) -> int:
    """Return ``value`` if it is an int > 0, else raise a ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be an integer > 0, got {value!r}")
    return value


def _validated_dynamic_args(dynamic_loss_args: Mapping[str, Any]) -> dict[str, Any]:
    """Check the five required ``dynamic_loss_args`` keys; extra keys pass through to the constructor."""
    checks = {
        INITIAL_LOSS_SCALE: _positive_finite,
        SCALE_WINDOW: _positive_int,
        DELAYED_SHIFT: _positive_int,
        MIN_LOSS_SCALE: _positive_finite,
    }
    args = dict(dynamic_loss_args)
    for key, check in checks.items():
        args[key] = check(dynamic_loss_args[key], f"dynamic_loss_args['{key}']")
    args[CONSECUTIVE_HYSTERESIS] = dynamic_loss_args[CONSECUTIVE_HYSTERESIS]
    return args


def CreateLossScaler(
    dtype: torch.dtype,
    static_loss_scale: float,
    dynamic_scaling: bool,
    dynamic_loss_args: Mapping[str, Any] | None,
) -> LossScalerBase:
    """Build the scaler an optimizer wrapper uses.

    Only fp16 is scaled: fp16 with ``dynamic_scaling`` gets a :class:`DynamicLossScaler` configured by
    ``dynamic_loss_args`` (keys ``init_scale``, ``scale_window``, ``delayed_shift``,
    ``consecutive_hysteresis``, ``min_scale``); fp16 without it gets a static ``static_loss_scale``; any
    other dtype gets a static scale of 1 so callers can treat every precision alike.
    """
    if dtype == torch.half and dynamic_scaling:
        assert dynamic_loss_args is not None, "Dynamic loss scaling parameters must be defined."
        return DynamicLossScaler(dtype=dtype, **_validated_dynamic_args(dynamic_loss_args))
    scale = static_loss_scale if dtype == torch.half else 1.0
    return LossScaler(scale=_positive_finite(scale, "fp16.loss_scale"))


def from_policy(policy: LossScalePolicy) -> LossScalerBase:
    """Build the fp16 scaler described by a run plan's :class:`LossScalePolicy`."""
    if not policy.dynamic:
        return LossScaler(scale=_positive_finite(policy.static_scale, "fp16.loss_scale"))
    args = {
        INITIAL_LOSS_SCALE: 2.0**policy.initial_scale_power,
        SCALE_WINDOW: policy.scale_window,
        DELAYED_SHIFT: policy.hysteresis,
        CONSECUTIVE_HYSTERESIS: policy.consecutive_hysteresis,
        MIN_LOSS_SCALE: policy.min_scale,
    }
    return DynamicLossScaler(dtype=torch.half, **_validated_dynamic_args(args))
