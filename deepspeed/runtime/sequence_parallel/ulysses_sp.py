"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: upstream's import path for the long-sequence API.

The implementations live in :mod:`deepspeed._core.sequence`; this module re-exports them under upstream's names.
"""

from __future__ import annotations

# Sequence parallelism: the attention wrapper and the data-loader adapter.
from deepspeed._core.sequence.loader import UlyssesSPDataLoaderAdapter

# Tiled compute along the sequence.
from deepspeed._core.sequence.tiled import (
    AutogradComputeMLP,
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)
from deepspeed._core.sequence.ulysses import UlyssesSPAttentionHF

__all__ = [
    "AutogradComputeMLP",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_tiled_compute",
]
