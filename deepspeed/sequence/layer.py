"""``deepspeed.sequence.layer``: the differentiable dimension-0 all-to-all that Ulysses attention exchanges with.

Implemented in :mod:`deepspeed._core.sequence.exchange`.
"""

from __future__ import annotations

from deepspeed._core.sequence.exchange import dim_zero_all_to_all as _dim_zero_all_to_all
from deepspeed._core.sequence.exchange import register_all_to_all_group

__all__ = ["_dim_zero_all_to_all", "register_all_to_all_group"]
