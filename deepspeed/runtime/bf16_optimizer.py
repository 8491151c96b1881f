"""``deepspeed.runtime.bf16_optimizer.BF16_Optimizer`` (see deepspeed/runtime/_wrapper_kinds.py)."""

from __future__ import annotations

from typing import Any

from deepspeed.runtime._wrapper_kinds import UpstreamWrapperType, is_bf16_optimizer, refuse_construction

__all__ = ["BF16_Optimizer"]


class BF16_Optimizer(metaclass=UpstreamWrapperType):
    """The engine optimizer of a bf16 run accumulating gradients in fp32 under ZeRO stage 0 or 1 (isinstance
    only; building one by hand raises ``NotImplementedError`` naming ``deepspeed.initialize``)."""

    stands_for = staticmethod(is_bf16_optimizer)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_construction("BF16_Optimizer")
