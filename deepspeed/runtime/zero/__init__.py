"""``deepspeed.zero`` / ``deepspeed.runtime.zero``: ZeRO-3 parameter partitioning entry points (upstream names)."""

from typing import Any

from deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "ZeroParamType",
    "register_external_parameter",
    "unregister_external_parameter",
]


def __getattr__(name: str) -> Any:
    # Lazy: the optimizer module pulls in the engine side.
    if name in ("unwrap_model_for_generation", "DeepSpeedZeroOptimizer_Stage3"):
        from deepspeed.runtime.zero import stage3

        return getattr(stage3, name)
    raise AttributeError(f"module 'deepspeed.runtime.zero' has no attribute {name!r}")
