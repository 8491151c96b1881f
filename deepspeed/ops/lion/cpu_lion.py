"""Upstream module path of ``DeepSpeedCPULion``."""

from __future__ import annotations

from deepspeed.ops.lion.lion import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
