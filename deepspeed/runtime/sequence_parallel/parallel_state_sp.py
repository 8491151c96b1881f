"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: the sequence-parallel groups, usable as an ``mpu``.

The state and functions live in :mod:`deepspeed._core.sequence.groups`; ``register_with_transformers`` returns that
module, which answers the same queries.
"""

from __future__ import annotations

from deepspeed._core.sequence.groups import (
    _release_sequence_parallel_groups,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
    get_sequence_data_parallel_group,
    get_sequence_data_parallel_rank,
    get_sequence_data_parallel_world_size,
    get_sequence_parallel_group,
    get_sequence_parallel_rank,
    get_sequence_parallel_world_size,
    initialize_sequence_parallel,
)

__all__ = [
    "_release_sequence_parallel_groups",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]
