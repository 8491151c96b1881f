"""``deepspeed.comm.ReduceOp``: the reduction names DeepSpeed callers pass to collectives.

The backend converts these to ``torch.distributed.ReduceOp``; a torch ``ReduceOp`` is also accepted as-is.
"""

from __future__ import annotations

from enum import Enum


class ReduceOp(Enum):
    """Reduction operators understood by every ``deepspeed.comm`` collective."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8
