"""Checkpoint engines at upstream's path (``deepspeed.runtime.checkpoint_engine``).

The engine's own ``save_checkpoint``/``load_checkpoint`` write through the core's crash-safe file I/O directly;
these classes serve code that writes or reads single checkpoint files through upstream's interface.
"""

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

__all__ = ["CheckpointEngine", "TorchCheckpointEngine"]
