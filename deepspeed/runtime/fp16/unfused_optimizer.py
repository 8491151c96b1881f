"""``deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer`` (see deepspeed/runtime/_wrapper_kinds.py)."""

from __future__ import annotations

from typing import Any

from deepspeed.runtime._wrapper_kinds import UpstreamWrapperType, is_fp16_unfused_optimizer, refuse_construction

__all__ = ["FP16_UnfusedOptimizer"]


class FP16_UnfusedOptimizer(metaclass=UpstreamWrapperType):
    """The engine optimizer of a 16-bit run without ZeRO over any optimizer but ``FusedAdam`` (isinstance only;
    building one by hand raises ``NotImplementedError`` naming ``deepspeed.initialize``)."""

    stands_for = staticmethod(is_fp16_unfused_optimizer)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_construction("FP16_UnfusedOptimizer")
