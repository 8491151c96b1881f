"""``deepspeed.accelerator``: the device abstraction every component uses instead of ``torch.cuda``."""

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from deepspeed.accelerator.real_accelerator import get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "set_accelerator", "is_current_accelerator_supported"]
