"""Upstream module path of ``FusedLion``."""

from __future__ import annotations

from deepspeed.ops.lion.lion import FusedLion

__all__ = ["FusedLion"]
