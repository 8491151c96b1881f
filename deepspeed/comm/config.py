"""Upstream names of ``deepspeed.comm.config``: the ``comms_logger`` block.

The implementation lives in ``deepspeed/_core/config/comms.py``.
"""

from __future__ import annotations

from deepspeed._core.config.comms import CommsLoggerConfig, DeepSpeedCommsConfig

__all__ = ["CommsLoggerConfig", "DeepSpeedCommsConfig"]
