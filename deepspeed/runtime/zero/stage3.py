"""``DeepSpeedZeroOptimizer_Stage3`` and ``unwrap_model_for_generation`` at upstream's import path.

The engine builds :class:`deepspeed._core.optim.stage3.Stage3Optimizer` directly; this module gives it
upstream's public name and the generation helper RL libraries import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from deepspeed._core.optim.sharded import INIT_OPTIMIZER_TIMER, OPTIMIZER_STEP_TIMER  # noqa: F401 - upstream names

# Upstream's names of the NVMe swap timers.
from deepspeed._core.optim.sharded import OPTIMIZER_SWAP_IN_TIMER as OPTIMIZER_SWAP_IN_STATE_TIMER  # noqa: F401
from deepspeed._core.optim.sharded import OPTIMIZER_SWAP_OUT_TIMER as OPTIMIZER_SWAP_OUT_STATE_TIMER  # noqa: F401
from deepspeed._core.optim.stage3 import Stage3Optimizer
from deepspeed.runtime.zero.partition_parameters import GatheredParameters

DeepSpeedZeroOptimizer_Stage3 = Stage3Optimizer


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[torch.nn.Module]:
    """Gather every parameter of ``model`` (an engine or a module) for the duration of the block.

    Generation runs many small forwards; gathering once avoids a fetch/release per token. The whole
    model is materialised on each rank while the block runs, as upstream does.
    """
    module = getattr(model, "module", model)
    with GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield module
