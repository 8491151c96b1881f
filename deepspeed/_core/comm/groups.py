"""The process group a ZeRO-3 parameter is sharded over, as the collectives and the parameter side see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepspeed._core.comm import dist


@dataclass(frozen=True)
class ShardGroup:
    """The process group a parameter is sharded over, with this process's rank in it."""

    handle: Any
    rank: int
    world_size: int

    @classmethod
    def resolve(cls, handle: Any = None) -> ShardGroup:
        """The group ``handle`` (``None``: the world); a single-rank group when no process group exists."""
        if not dist.is_initialized():
            if handle is not None:
                raise ValueError("a process group was given but deepspeed.comm is not initialized")
            return cls(None, 0, 1)
        return cls(handle, dist.get_rank(group=handle), dist.get_world_size(group=handle))

    def global_rank(self, group_rank: int) -> int:
        """The global rank of member ``group_rank`` (identity for the world or a single-rank group)."""
        if self.handle is None:
            return group_rank
        return dist.get_global_rank(self.handle, group_rank)
