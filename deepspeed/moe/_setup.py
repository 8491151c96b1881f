"""Engine set-up for models with MoE layers: validate the combination, create the expert groups.

Runs on every rank before any optimizer is built; everything it rejects is rejected identically on all
ranks before the first group-creating collective, so no rank is left waiting.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed._core.moe.checkpoint import MoECheckpointLayout, describe
from deepspeed._core.moe.layer import MoECore
from deepspeed._core.moe.params import ExpertGroup, moe_layers
from deepspeed.utils import groups


def configure_moe(
    module: torch.nn.Module, zero_stage: int, mpu: Any, use_data_before_expert_parallel: bool = False
) -> dict[str, ExpertGroup]:
    """Create the expert-parallel groups of ``module``'s MoE layers; ``{}`` without MoE layers.

    Args:
        module: the model.
        zero_stage: configured ZeRO stage (stage 3 is refused with MoE).
        mpu: model-parallel unit, if any (refused with MoE).
        use_data_before_expert_parallel: the ``use_data_before_expert_parallelism`` config key.
    """
    layers = moe_layers(module)
    if not layers:
        return {}
    if zero_stage == 3:
        raise NotImplementedError(
            "zero_optimization.stage=3 with MoE layers is not supported by deepspeed-lean; use stage 0, 1 or 2"
        )
    if mpu is not None:
        raise NotImplementedError(
            "MoE layers with a model-parallel unit (mpu) are not supported by deepspeed-lean; MoE runs with "
            "data and expert parallelism only"
        )
    # Sizes are validated for all layers first, then groups are created in one deterministic order.
    sizes = sorted({layer.ep_size for layer in layers})
    for size in sizes:
        groups._create_expert_and_data_parallel(size, use_data_before_expert_parallel_=use_data_before_expert_parallel)
    for layer in layers:
        layer.set_ep_group(groups._get_expert_parallel_group(layer.expert_group_name))
    return {
        name: ExpertGroup(name, groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name))
        for name in sorted({layer.expert_group_name for layer in layers})
    }


def moe_checkpoint_layout(module: torch.nn.Module) -> MoECheckpointLayout:
    """Where this rank's experts go in a checkpoint (ranks in each layer's expert groups)."""
    names = {layer.expert_group_name for layer in moe_layers(module)}
    ranks_of = {
        name: (groups._get_expert_parallel_rank(name), groups._get_expert_data_parallel_rank(name)) for name in names
    }
    return describe(module, MoECore, ranks_of, groups._get_max_expert_size_name())
