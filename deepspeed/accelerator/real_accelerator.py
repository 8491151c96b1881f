"""Choosing the process-wide accelerator.

Order: an object given to :func:`set_accelerator`; else ``DS_ACCELERATOR`` (``cuda`` or ``cpu``); else CUDA when a
device is visible, CPU otherwise. The choice is made once, on the first :func:`get_accelerator` call.
"""

from __future__ import annotations

import os

from deepspeed._foundation.logging import logger
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]

ds_accelerator: DeepSpeedAccelerator | None = None


def _requested_name() -> str | None:
    name = os.environ.get("DS_ACCELERATOR")
    if name is None or name == "":
        return None
    name = name.lower()
    if name not in SUPPORTED_ACCELERATOR_LIST:
        raise ValueError(
            f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']!r} is not supported; "
            f"valid values: {SUPPORTED_ACCELERATOR_LIST}"
        )
    return name


def _build(name: str) -> DeepSpeedAccelerator:
    if name == "cuda":
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator, cuda_is_available

        if not cuda_is_available():
            raise ValueError("DS_ACCELERATOR=cuda but torch reports no usable CUDA device; use DS_ACCELERATOR=cpu")
        return CUDA_Accelerator()
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    return CPU_Accelerator()


def _detect_name() -> str:
    from deepspeed.accelerator.cuda_accelerator import cuda_is_available

    return "cuda" if cuda_is_available() else "cpu"


def get_accelerator() -> DeepSpeedAccelerator:
    """The process-wide :class:`DeepSpeedAccelerator`, chosen on first call (see module docstring)."""
    global ds_accelerator
    if ds_accelerator is None:
        requested = _requested_name()
        name = requested or _detect_name()
        ds_accelerator = _build(name)
        how = "set by DS_ACCELERATOR" if requested else "auto detect"
        logger.debug(f"Setting ds_accelerator to {name} ({how})")
    return ds_accelerator


def set_accelerator(accel_obj: DeepSpeedAccelerator) -> None:
    """Replace the process-wide accelerator (tests and custom devices)."""
    global ds_accelerator
    if not isinstance(accel_obj, DeepSpeedAccelerator):
        raise TypeError(f"set_accelerator expects a DeepSpeedAccelerator, got {type(accel_obj).__name__}")
    ds_accelerator = accel_obj


def is_current_accelerator_supported() -> bool:
    """True when the active accelerator is one this package implements."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


def _reset_accelerator_for_tests() -> None:
    # Lets tests re-run selection under a different DS_ACCELERATOR without a new process.
    global ds_accelerator
    ds_accelerator = None
