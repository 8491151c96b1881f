"""Lion optimizers (pure-torch implementations)."""

from __future__ import annotations

from deepspeed.ops.lion.lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
