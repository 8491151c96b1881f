"""``fp16``, ``bf16`` and ``data_types`` config blocks (upstream keys and defaults), and ``DtypeEnum``.

The ``bf16`` block may also be spelled ``bfloat16`` (legacy name); ``bf16`` wins when both are present.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any, ClassVar, overload

import torch
from pydantic import field_validator, model_validator

from deepspeed._core.config.base import DeepSpeedConfigModel, DeepSpeedLenientConfigModel

# Keys of the dict handed to the dynamic loss scaler (upstream ``dynamic_loss_scale_args`` names).
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    """The ``fp16`` block: fp16 working weights with loss scaling."""

    config_block: ClassVar[str] = "fp16"

    enabled: bool = False
    """Train with fp16 parameters and gradients (fp32 master weights in the optimizer)."""

    auto_cast: bool = False
    """Cast floating-point forward inputs to fp16."""

    loss_scale: float = 0.0
    """Static loss scale; ``0`` selects dynamic loss scaling. Must be a finite number ≥ 0."""

    initial_scale_power: int = 16
    """Dynamic scaling starts at ``2**initial_scale_power``."""

    loss_scale_window: int = 1000
    """Overflow-free steps before the dynamic scale is doubled."""

    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale is lowered (upstream 'delayed shift')."""

    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget on every overflow-free step, not only when the scale grows."""

    min_loss_scale: int = 1
    """Floor of the dynamic loss scale."""

    fp16_master_weights_and_grads: bool = False
    """Keep the optimizer's master weights and gradients in fp16 (ZeRO only)."""

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale_is_number(cls, value: Any) -> Any:
        # bool is an int subclass; "loss_scale": true is almost certainly a mistake, not a scale of 1.
        if isinstance(value, bool):
            raise ValueError("must be a number (0 for dynamic scaling), not a bool")
        return value

    @field_validator("loss_scale")
    @classmethod
    def _loss_scale_finite(cls, value: float) -> float:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"must be a finite number >= 0 (0 = dynamic); got {value}")
        return value

    @model_validator(mode="after")
    def _dynamic_args_valid(self) -> DeepSpeedFP16Config:
        if self.loss_scale == 0:
            if self.loss_scale_window <= 0:
                raise ValueError(
                    f"loss_scale_window must be > 0 with dynamic loss scaling; got {self.loss_scale_window}"
                )
            if self.min_loss_scale <= 0:
                raise ValueError(f"min_loss_scale must be > 0 with dynamic loss scaling; got {self.min_loss_scale}")
        return self

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when the loss scale adapts (``loss_scale == 0``)."""
        return self.loss_scale == 0

    def initial_dynamic_scale(self) -> int:
        """The first dynamic loss scale, ``2**initial_scale_power``."""
        return 2**self.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """Arguments for the dynamic loss scaler, keyed by its upstream parameter names."""
        return {
            INITIAL_LOSS_SCALE: self.initial_dynamic_scale(),
            SCALE_WINDOW: self.loss_scale_window,
            DELAYED_SHIFT: self.hysteresis,
            CONSECUTIVE_HYSTERESIS: self.consecutive_hysteresis,
            MIN_LOSS_SCALE: self.min_loss_scale,
        }


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    """The ``bf16`` block (legacy spelling ``bfloat16``): bf16 working weights, no loss scaling."""

    config_block: ClassVar[str] = "bf16"

    enabled: bool = False
    """Train with bf16 parameters and gradients."""

    immediate_grad_update: bool = False
    """Fold each gradient into the fp32 accumulator as soon as it is produced (BF16 optimizer)."""

    check_grad_overflow: bool = True
    """Check gradients for inf/nan before the optimizer step and skip the step on overflow. With ZeRO 1-3, the
    optimizer state on the device, and an optimizer that skips on a device flag (torch's fused Adam/AdamW/SGD/Adagrad,
    or ``FusedAdam`` on CUDA), the check runs on the device: the update is queued before the host reads the outcome.
    Otherwise the host reads the norm before the update."""

    bf16_master_weights_and_grads: bool = False
    """Keep the optimizer's master weights and gradients in bf16. The optimizer's states follow the master dtype, so
    deepspeed-lean needs ``bf16_optimizer_states`` true as well (bf16 masters with fp32 states are refused)."""

    bf16_optimizer_states: bool = False
    """Keep optimizer states in bf16 as well; requires ``bf16_master_weights_and_grads``."""

    @model_validator(mode="after")
    def _optimizer_states_need_master(self) -> DeepSpeedBF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError("bf16_optimizer_states requires bf16_master_weights_and_grads to be true")
        return self


def get_float16_config(param_dict: dict) -> DeepSpeedFP16Config:
    """Build the ``fp16`` block from a whole DeepSpeed config dict."""
    return DeepSpeedFP16Config(**param_dict.get("fp16", {}))


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    """Build the ``bf16`` block (or its legacy ``bfloat16`` spelling) from a whole DeepSpeed config dict."""
    block = param_dict.get("bf16", param_dict.get("bfloat16", {}))
    return DeepSpeedBF16Config(**block)


_DTYPE_ALIASES = {
    torch.float16: ("torch.float16", "fp16", "float16", "half"),
    torch.float32: ("torch.float32", "fp32", "float32", "float"),
    torch.int8: ("torch.int8", "int8"),
    torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16"),
}


class DtypeEnum(Enum):
    """Data types by upstream name; ``DtypeEnum("half").value`` is ``torch.float16`` (aliases accepted)."""

    fp16 = torch.float16
    fp32 = torch.float32
    int8 = torch.int8
    bf16 = torch.bfloat16

    @classmethod
    def _missing_(cls, value: object) -> DtypeEnum | None:
        name = str(value).lower()
        for member in cls:
            if name in _DTYPE_ALIASES[member.value]:
                return member
        return None


_FLOAT_DTYPE_NAMES = sorted(
    {alias for d in (torch.float16, torch.float32, torch.bfloat16) for alias in _DTYPE_ALIASES[d]}
)


def validate_float_dtype_name(value: str | None) -> str | None:
    """Validate a dtype name (``fp16``/``bf16``/``fp32`` or an alias); returns it unchanged."""
    if value is not None and str(value).lower() not in _FLOAT_DTYPE_NAMES:
        raise ValueError(f"must be one of {_FLOAT_DTYPE_NAMES} (or null); got {value!r}")
    return value


@overload
def to_torch_dtype(value: str) -> torch.dtype: ...
@overload
def to_torch_dtype(value: None) -> None: ...
@overload
def to_torch_dtype(value: str | None) -> torch.dtype | None: ...


def to_torch_dtype(value: str | None) -> torch.dtype | None:
    """``None`` or the torch dtype named by ``value`` (any :class:`DtypeEnum` alias)."""
    return None if value is None else DtypeEnum(value).value


class DataTypesConfig(DeepSpeedLenientConfigModel):
    """``data_types`` block: dtype names ``fp16``/``bf16``/``fp32`` (aliases such as ``half`` accepted)."""

    config_block: ClassVar[str] = "data_types"

    grad_accum_dtype: str | None = None
    """dtype gradients are accumulated in; unset = the model's dtype."""
    param_dtype: str | None = None
    """dtype of the working parameters; must agree with the fp16/bf16 blocks."""
    buffer_dtype: str | None = None
    """dtype module buffers are cast to; unset keeps their loaded dtype."""

    _names_valid = field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype")(validate_float_dtype_name)
