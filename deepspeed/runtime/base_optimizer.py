"""Optimizer base classes at upstream's path (``deepspeed.runtime.base_optimizer``).

Every optimizer the engine wraps derives from the core's
:class:`deepspeed._core.optim.base.EngineOptimizer`; upstream's two base names are aliases of
it, so ``isinstance(engine.optimizer, DeepSpeedOptimizer)`` and ``isinstance(..., ZeROOptimizer)`` hold
for every stage.
"""

from __future__ import annotations

from deepspeed._core.optim.base import EngineOptimizer

DeepSpeedOptimizer = EngineOptimizer
ZeROOptimizer = EngineOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
