"""Monitor config blocks: top-level ``tensorboard``, ``wandb``, ``csv_monitor`` and ``comet``, and the ``timers``
block (upstream keys).

Re-exported by ``deepspeed.monitor.config`` and ``deepspeed.utils.config`` (the timers block).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from deepspeed._core.config.base import DeepSpeedConfigModel

MONITOR_BLOCKS = ("tensorboard", "wandb", "csv_monitor", "comet")


class TensorBoardConfig(DeepSpeedConfigModel):
    """``tensorboard``: write scalar events for TensorBoard."""

    config_block: ClassVar[str] = "tensorboard"

    enabled: bool = False
    """Turn the TensorBoard monitor on."""

    output_path: str = ""
    """Directory for event files (empty: the default ``runs`` location)."""

    job_name: str = "DeepSpeedJobName"
    """Sub-directory name for this run's events."""


class WandbConfig(DeepSpeedConfigModel):
    """``wandb``: log to Weights & Biases."""

    config_block: ClassVar[str] = "wandb"

    enabled: bool = False
    """Turn the W&B monitor on."""

    group: str | None = None
    """W&B run group."""

    team: str | None = None
    """W&B entity (team)."""

    project: str = "deepspeed"
    """W&B project name."""


class CSVConfig(DeepSpeedConfigModel):
    """``csv_monitor``: append scalars to CSV files."""

    config_block: ClassVar[str] = "csv_monitor"

    enabled: bool = False
    """Turn the CSV monitor on."""

    output_path: str = ""
    """Directory for the CSV files."""

    job_name: str = "DeepSpeedJobName"
    """Sub-directory name for this run's files."""


class CometConfig(DeepSpeedConfigModel):
    """``comet``: log to Comet ML."""

    config_block: ClassVar[str] = "comet"

    enabled: bool = False
    """Turn the Comet monitor on."""

    samples_log_interval: int = 100
    """Log every this many samples."""

    project: str | None = None
    """Comet project name."""

    workspace: str | None = None
    """Comet workspace."""

    api_key: str | None = None
    """Comet API key (falls back to Comet's own configuration when unset)."""

    experiment_name: str | None = None
    """Name of the Comet experiment."""

    experiment_key: str | None = None
    """Key of an existing experiment to resume."""

    online: bool | None = None
    """Log online (true) or offline (false); unset uses Comet's default."""

    mode: str | None = None
    """Comet start mode (``get``, ``create``, ``get_or_create``)."""


class DeepSpeedMonitorConfig(DeepSpeedConfigModel):
    """All monitor blocks together; ``enabled`` is true when any monitor is on."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor settings."""

    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor settings."""

    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    """CSV monitor settings."""

    comet: CometConfig = Field(default_factory=CometConfig)
    """Comet monitor settings."""

    @model_validator(mode="after")
    def _any_enabled(self) -> DeepSpeedMonitorConfig:
        # Derived, not a JSON key: stored outside the field set so it never round-trips into a config dump.
        self.__dict__["enabled"] = any(
            block.enabled for block in (self.tensorboard, self.wandb, self.csv_monitor, self.comet)
        )
        return self


def get_monitor_config(param_dict: dict) -> DeepSpeedMonitorConfig:
    """Build the monitor config from the four top-level monitor blocks of a DeepSpeed config dict."""
    return DeepSpeedMonitorConfig(**{key: param_dict.get(key, {}) for key in MONITOR_BLOCKS})


class DeepSpeedThroughputTimerConfig(DeepSpeedConfigModel):
    """``timers.throughput``: the engine's samples-per-second timer."""

    config_block: ClassVar[str] = "timers.throughput"

    enabled: bool = True
    """Time the steps and log samples per second every ``steps_per_print`` optimizer steps."""

    synchronized: bool = True
    """Wait for the device before reading the clock (exact, but each timed step waits for its kernels)."""


class TimersConfig(DeepSpeedConfigModel):
    """``timers``: the engine's timers."""

    config_block: ClassVar[str] = "timers"

    throughput: DeepSpeedThroughputTimerConfig = Field(default_factory=DeepSpeedThroughputTimerConfig)
    """The throughput timer."""


def get_timers_config(param_dict: dict) -> DeepSpeedThroughputTimerConfig:
    """The ``timers.throughput`` settings of a DeepSpeed config dict (defaults when absent)."""
    return TimersConfig(**param_dict.get("timers", {})).throughput
