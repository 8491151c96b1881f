"""``activation_checkpointing`` config block (upstream keys and defaults).

Upstream reads this block key by key, so unknown keys are ignored (logged), not rejected. The engine does not
apply it by itself: ``deepspeed.checkpointing.configure(mpu, deepspeed_config=...)`` reads it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from deepspeed._core.config.base import DeepSpeedLenientConfigModel

ACT_CHKPT = "activation_checkpointing"


class DeepSpeedActivationCheckpointingConfig(DeepSpeedLenientConfigModel):
    """The ``activation_checkpointing`` block.

    Args:
        param_dict: optional whole DeepSpeed config dict (upstream constructor form); its
            ``activation_checkpointing`` block is read. Keyword arguments give the block's keys directly.
    """

    config_block: ClassVar[str] = ACT_CHKPT

    partition_activations: bool = False
    """Partition checkpointed activations across model-parallel ranks."""

    contiguous_memory_optimization: bool = False
    """Copy partitioned activations into one contiguous buffer (needs ``partition_activations``)."""

    cpu_checkpointing: bool = False
    """Move checkpointed activations to CPU memory."""

    number_checkpoints: int | None = Field(None, ge=0)
    """Number of checkpoints in the model; required for contiguous memory optimization."""

    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device at each checkpoint boundary (for profiling)."""

    profile: bool = False
    """Time the forward/recompute of checkpointed functions."""

    def __init__(self, param_dict: dict | None = None, **data: Any) -> None:
        if param_dict is not None:
            data = {**param_dict.get(ACT_CHKPT, {}), **data}
        super().__init__(**data)
