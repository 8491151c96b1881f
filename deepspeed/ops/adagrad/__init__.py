"""Adagrad for ZeRO optimizer offload."""

from __future__ import annotations

from deepspeed.ops.adagrad.cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
