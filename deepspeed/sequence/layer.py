"""``deepspeed.sequence.layer``: the sequence-parallel exchanges and the layer-level Ulysses attention.

Implemented in :mod:`deepspeed._core.sequence.exchange` (the dimension-0 all-to-all Hugging Face Ulysses attention
uses) and :mod:`deepspeed._core.sequence.distributed_attention` (``_SeqAllToAll``, ``DistributedAttention``,
``single_all_to_all``, ``uneven_heads_all2all``).
"""

from __future__ import annotations

from deepspeed._core.sequence.distributed_attention import (
    DistributedAttention,
    apply_rotary_pos_emb,
    single_all_to_all,
    uneven_heads_all2all,
)
from deepspeed._core.sequence.distributed_attention import SeqAllToAll as _SeqAllToAll
from deepspeed._core.sequence.exchange import dim_zero_all_to_all as _dim_zero_all_to_all
from deepspeed._core.sequence.exchange import register_all_to_all_group

__all__ = [
    "DistributedAttention",
    "_SeqAllToAll",
    "_dim_zero_all_to_all",
    "apply_rotary_pos_emb",
    "register_all_to_all_group",
    "single_all_to_all",
    "uneven_heads_all2all",
]
