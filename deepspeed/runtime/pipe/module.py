"""``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec`` (``deepspeed.runtime.pipe.module``).

``activation_checkpoint_func=None`` means ``deepspeed.checkpointing.checkpoint``. Implementation:
:mod:`deepspeed._core.pipe.module` (partitioning in :mod:`deepspeed._core.pipe.partition`).
"""

from deepspeed._core.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed._core.pipe.partition import PartitionError, partition_balanced, partition_uniform

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "PartitionError", "partition_balanced", "partition_uniform"]
