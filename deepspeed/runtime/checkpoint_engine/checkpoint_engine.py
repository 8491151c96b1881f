"""``CheckpointEngine``: upstream's interface of an object that writes and reads checkpoint files."""

from __future__ import annotations

import os
from typing import Any


class CheckpointEngine:
    """Writes and reads the files of one checkpoint (upstream's base class; subclass it for another storage).

    Args:
        config_params: the engine's ``checkpoint`` settings, kept for subclasses.
    """

    def __init__(self, config_params: Any = None) -> None:
        self.config_params = config_params

    def create(self, info: Any) -> None:
        """Start writing checkpoint ``info`` (a tag or commit info)."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Create the checkpoint folder ``path``."""
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        """Write ``state_dict`` to ``path``."""
        raise NotImplementedError(f"{type(self).__name__}.save")

    def load(self, path: str, map_location: Any = None) -> Any:
        """Read the object stored at ``path``."""
        raise NotImplementedError(f"{type(self).__name__}.load")

    def commit(self, info: Any) -> bool:
        """Finish checkpoint ``info``; true when its files are complete."""
        return True

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Whether data-parallel rank ``dp_rank`` writes the files shared by its replicas."""
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        """Whether saving runs apart from training (never here)."""
        return False
