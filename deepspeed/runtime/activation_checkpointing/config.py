"""Upstream names of ``deepspeed.runtime.activation_checkpointing.config``: the ``activation_checkpointing`` block.

The implementation lives in ``deepspeed/_core/config/activation.py``.
"""

from __future__ import annotations

from deepspeed._core.config.activation import ACT_CHKPT, DeepSpeedActivationCheckpointingConfig

__all__ = ["ACT_CHKPT", "DeepSpeedActivationCheckpointingConfig"]
