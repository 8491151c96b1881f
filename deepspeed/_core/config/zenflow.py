"""``zero_optimization.zenflow`` block: upstream's keys and defaults for the one-step-delayed update family.

What the keys do is in docs/offload.md ("ZenFlow"); the numerics live in ``deepspeed/_core/optim/zenflow.py``.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from deepspeed._core.config.base import DeepSpeedConfigModel

SELECT_STRATEGIES = ("auto", "step", "epoch")


class ZenFlowConfig(DeepSpeedConfigModel):
    """``zenflow``: update the most important columns of each 2-D weight every step and the rest of the gradients,
    accumulated, every ``update_interval`` steps on the host (optionally one step late, overlapped)."""

    config_block: ClassVar[str] = "zero_optimization.zenflow"

    topk_ratio: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of the columns of each 2-D weight (those of largest gradient norm) updated every step; strictly
    between 0 and 1. The number of columns is rounded up, so a ratio close to 1 selects every column of a narrow
    weight."""

    select_strategy: str = "auto"
    """When the columns are selected again: ``"step"`` (every ``select_interval`` steps), ``"epoch"`` (every
    ``select_interval`` epochs) or ``"auto"`` (``"epoch"`` with ``select_interval`` 1)."""

    select_interval: str | int = "auto"
    """Steps or epochs between selections (``"auto"`` only with ``select_strategy: "auto"``)."""

    update_interval: str | int = "auto"
    """Steps between host updates of the remaining gradients (an integer >= 1), or ``"auto"``: a host update once
    the gradient mass accumulated in the remaining columns of at least ``auto_ratio`` of the 2-D weights has caught
    up with what their selected columns receive per step."""

    overlap_step: bool = False
    """Run the host update in the background and apply it at the next step boundary (one step late)."""

    offload: bool = False
    """Upstream: keep the selected columns' optimizer state on the host. Here all optimizer state lives with the
    host master already."""

    auto_ratio: float = Field(0.99, ge=0.0, le=1.0)
    """``update_interval: "auto"``: share of the 2-D weights that must be due before a host update runs."""

    full_warm_up_rounds: int = Field(0, ge=0)
    """Steps at the start that update every element in full (no selection)."""

    pt_reserved_cores_perc: float = Field(0.5, ge=0.0, le=1.0)
    """Upstream: share of host cores reserved for PyTorch threads; the host update here runs on torch's pool."""

    steps_per_epoch: int | None = Field(None, ge=1)
    """Steps per epoch for ``select_strategy: "epoch"`` (upstream fills it from the training data loader; here it
    is also taken from the loader given to ``deepspeed.initialize`` when unset)."""

    @model_validator(mode="after")
    def _check_intervals(self) -> ZenFlowConfig:
        if self.select_strategy not in SELECT_STRATEGIES:
            raise ValueError(f"select_strategy must be one of {list(SELECT_STRATEGIES)}; got {self.select_strategy!r}")
        for name in ("select_interval", "update_interval"):
            value = getattr(self, name)
            if isinstance(value, str) and value != "auto":
                raise ValueError(f"{name} must be 'auto' or an integer >= 1; got {value!r}")
            if isinstance(value, int) and value < 1:
                raise ValueError(f"{name} must be 'auto' or an integer >= 1; got {value!r}")
        if self.select_strategy == "auto" and isinstance(self.select_interval, int):
            raise ValueError(
                "select_interval is set by select_strategy 'auto' (every epoch); give select_strategy 'step' or "
                "'epoch' to choose it"
            )
        if self.select_strategy != "auto" and isinstance(self.select_interval, str):
            raise ValueError(f"select_strategy {self.select_strategy!r} needs an integer select_interval")
        if (
            self.select_strategy == "step"
            and isinstance(self.select_interval, int)
            and isinstance(self.update_interval, int)
            and self.select_interval < self.update_interval
        ):
            raise ValueError(
                f"select_interval ({self.select_interval}) must be >= update_interval ({self.update_interval}): "
                "columns are selected again only after the accumulated gradients were applied"
            )
        return self
