"""``TorchCheckpointEngine``: checkpoint files through ``torch.save`` / ``torch.load``, over the core's file I/O."""

from __future__ import annotations

from typing import Any

from deepspeed._core.checkpoint.files import LoadTrust, atomic_save, load_file
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine


class TorchCheckpointEngine(CheckpointEngine):
    """Saves each file crash-safely (written beside, then renamed into place) and loads it weights-only with the
    checkpoint allow-list unless ``DS_CHECKPOINT_TRUSTED`` is set (docs/checkpoints.md)."""

    def save(self, state_dict: Any, path: str) -> None:
        """Write ``state_dict`` to ``path``; a crash leaves the previous file, never a truncated one."""
        atomic_save(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        """Read ``path``; a missing, truncated or unsafe file raises an error that names it."""
        return load_file(path, None, LoadTrust.from_env(), "cpu" if map_location is None else map_location)
