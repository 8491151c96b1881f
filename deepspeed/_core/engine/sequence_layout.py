"""How the engine lays out ranks under sequence parallelism (SP).

With SP size ``sp`` the ranks form contiguous SP groups of ``sp`` (one sample's sequence shards each) and
``world / sp`` data-parallel replicas:

* data: ranks of one SP group read the same batch (the data-parallel rank is ``rank // sp``) and the batch
  arithmetic counts ``world / sp`` data-parallel ranks;
* ZeRO: parameters are replicated across an SP group, so ZeRO shards over every rank, and gradients are averaged
  over every rank. That average is exact: with each SP rank's loss the mean loss of its sequence (the SP ranks'
  losses agree, or their local means do over equal token counts), the sum of the SP ranks' gradients is ``sp``
  times the sequence's gradient (each rank's backward seeds its own loss and the exchanges carry the rest), so
  dividing the sum over all ``world`` ranks by ``world`` gives the mean over the ``world / sp`` replicas;
* gradient communication: under SP the gradients are reduced in ``seq_parallel_communication_data_type``
  (fp32 by default) instead of ``communication_data_type``, so a 16-bit model's SP ranks' partial gradients are
  summed without rounding the sum to 16 bits;
* checkpoints: model states are written by rank 0 of that all-rank group, ZeRO shards by each rank, and there is
  no model parallelism (mp rank 0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.config.base import DeepSpeedConfigError
from deepspeed._core.sequence import groups as sp_groups
from deepspeed._foundation.logging import logger


@dataclass(frozen=True)
class SequenceLayout:
    """The engine's groups: ``zero_group`` shards and reduces, ``data_rank``/``data_world_size`` feed data."""

    sequence_parallel_size: int
    seq_parallel_group: Any
    zero_group: Any
    zero_world_size: int
    data_rank: int
    data_world_size: int


def requested_size(config: dict, mpu: Any) -> int:
    """The SP size the config and the mpu ask for; raises when they disagree. Local: no communication."""
    key = config.get("sequence_parallel_size")
    if not sp_groups.is_sequence_parallel_unit(mpu):
        if mpu is not None and int(key or 1) > 1:
            raise DeepSpeedConfigError(
                f"sequence_parallel_size={key} cannot be combined with a model-parallel mpu "
                f"({type(mpu).__name__}); pass the sequence-parallel mpu (parallel_state_sp) or no mpu"
            )
        return int(key or 1)
    size = int(mpu.get_sequence_parallel_world_size())
    if key not in (None, 1, size):
        raise DeepSpeedConfigError(
            f"sequence_parallel_size={key} in the config but the mpu's sequence parallel size is {size}; "
            "set them equal or leave the key out"
        )
    return size


def with_sequence_parallel_comm_dtype(plan: Any, size: int, dtype: torch.dtype, *, key_given: bool) -> Any:
    """``plan`` with gradients reduced in ``dtype`` (``seq_parallel_communication_data_type``) when ``size`` > 1.

    Without SP the key changes nothing; when the config sets it anyway, one warning says so.
    """
    if size <= 1:
        if key_given:
            logger.warning(
                "seq_parallel_communication_data_type has no effect without sequence parallelism "
                "(sequence_parallel_size is 1); gradients are reduced in communication_data_type"
            )
        return plan
    return dataclasses.replace(plan, precision=dataclasses.replace(plan.precision, comm_dtype=dtype))


def check_pipeline(size: int, pipeline: bool) -> None:
    """Refuse SP together with pipeline parallelism (raised on every rank before any collective)."""
    if pipeline and size > 1:
        raise DeepSpeedConfigError(
            f"sequence_parallel_size={size} cannot be combined with pipeline parallelism (a PipelineModule); "
            "use sequence_parallel_size=1 or a non-pipeline model"
        )


def build(size: int, mpu: Any) -> tuple[SequenceLayout, Any]:
    """The layout for SP ``size`` (> 1) and the SP mpu to use: ``mpu`` if it is one, else the SP groups module,
    whose groups are created here when they do not exist yet (collective)."""
    if not sp_groups.is_sequence_parallel_unit(mpu):
        sp_groups.ensure_sequence_parallel(size, asked_by="the config")
        mpu = sp_groups
    zero_group = mpu.get_sequence_data_parallel_group()
    layout = SequenceLayout(
        sequence_parallel_size=size,
        seq_parallel_group=mpu.get_sequence_parallel_group(),
        zero_group=zero_group,
        zero_world_size=dist.get_world_size(group=zero_group),
        data_rank=dist.get_rank() // size,
        data_world_size=dist.get_world_size() // size,
    )
    return layout, mpu
