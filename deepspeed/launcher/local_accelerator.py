"""What the launcher needs to know about this machine's accelerator, asked lazily.

``deepspeed.accelerator`` imports torch, which costs seconds; the launcher only asks it when it must
count local devices. Only CUDA devices become launcher slots: any other accelerator (or none, or an
accelerator package that cannot be imported) means "no GPU here", and the launcher falls back to CPU
processes over gloo.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from deepspeed._foundation.logging import logger

# Names used when the accelerator cannot be asked (CPU-only installs, or before it is importable).
DEFAULT_VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
CPU_ACCELERATOR_NAME = "cpu"


def _forced_cpu(environ: Mapping[str, str]) -> bool:
    # DS_ACCELERATOR=cpu is an explicit choice; honouring it also spares the torch import.
    return environ.get("DS_ACCELERATOR", "").lower() == CPU_ACCELERATOR_NAME


def _get_accelerator() -> object | None:
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError as err:
        logger.debug(f"deepspeed.accelerator unavailable ({err}); treating this machine as CPU-only")
        return None
    return get_accelerator()


def _local_device_count() -> int:
    """Number of local CUDA devices the launcher may use as slots; 0 means "start CPU processes"."""
    if _forced_cpu(os.environ):
        return 0
    accelerator = _get_accelerator()
    if accelerator is None or accelerator.device_name() != "cuda":  # type: ignore[attr-defined]
        return 0
    return int(accelerator.device_count())  # type: ignore[attr-defined]


def visible_devices_env() -> str:
    """Name of the variable that restricts which devices a process sees (``CUDA_VISIBLE_DEVICES``)."""
    # The runner reads (and removes) this before counting devices, so it must not import torch here:
    # torch caches its device count at first use, with whatever restriction was then in force.
    return DEFAULT_VISIBLE_DEVICES_ENV


def accelerator_export_envs() -> list[str]:
    """Variable-name prefixes the accelerator wants exported to other nodes (CUDA: ``NCCL``)."""
    if _forced_cpu(os.environ):
        return []
    accelerator = _get_accelerator()
    if accelerator is None:
        return []
    return list(accelerator.export_envs())  # type: ignore[attr-defined]
