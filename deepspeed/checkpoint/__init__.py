"""Checkpoint format helpers: key constants (``deepspeed.checkpoint.constants``) and
``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``.

Saving and loading themselves are engine methods (``DeepSpeedEngine.save_checkpoint`` /
``load_checkpoint``); consolidation into a single fp32 state dict is ``deepspeed.utils.zero_to_fp32``.
"""

from deepspeed.checkpoint import constants
from deepspeed.checkpoint.constants import *  # noqa: F403 - upstream's package exposes every key constant
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

__all__ = ["constants", "clone_tensors_for_torch_save", *(n for n in dir(constants) if n.isupper())]
