"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: upstream's import path for the long-sequence API.

The implementations live in :mod:`deepspeed._core.sequence`; this module re-exports them under upstream's names.
"""

from __future__ import annotations

# Tiled compute along the sequence.
from deepspeed._core.sequence.tiled import (
    AutogradComputeMLP,
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

__all__ = [
    "AutogradComputeMLP",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "sequence_tiled_compute",
]
