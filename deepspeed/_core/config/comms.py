"""``comms_logger`` config block (upstream keys) and the holder the engine reads.

``deepspeed/comm/config.py`` re-exports both under upstream's path.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from deepspeed._core.config.base import DeepSpeedConfigModel

COMMS_LOGGER = "comms_logger"


class CommsLoggerConfig(DeepSpeedConfigModel):
    """``comms_logger``: record size and latency of collectives."""

    config_block: ClassVar[str] = COMMS_LOGGER

    enabled: bool = False
    """Turn the communication logger on."""

    prof_all: bool = True
    """Profile every collective (otherwise only those in ``prof_ops``)."""

    prof_ops: list[str] = Field(default_factory=list)
    """Names of the collectives to profile when ``prof_all`` is false."""

    verbose: bool = False
    """Log every profiled collective as it completes."""

    debug: bool = False
    """Add the calling function's name to each record."""


class DeepSpeedCommsConfig:
    """Holder read by the engine: ``comms_logger_enabled`` is true when the block is present at all.

    Args:
        ds_config: the whole DeepSpeed config dict.
    """

    def __init__(self, ds_config: dict) -> None:
        self.comms_logger_enabled = COMMS_LOGGER in ds_config
        self.comms_logger = CommsLoggerConfig(**ds_config.get(COMMS_LOGGER, {}))

    @classmethod
    def from_block(cls, block: CommsLoggerConfig, present: bool) -> DeepSpeedCommsConfig:
        """The holder for an already validated ``comms_logger`` block (``present``: the user's config has it), so
        that ``DeepSpeedConfig`` does not parse the block a second time."""
        holder = cls.__new__(cls)
        holder.comms_logger_enabled = present
        holder.comms_logger = block
        return holder
