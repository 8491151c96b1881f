"""Upstream top-level names whose features deepspeed-lean does not implement (yet).

They exist so that ``import deepspeed`` exposes upstream's surface (integrations probe for the names);
using one raises :class:`NotImplementedError` naming the feature, never a silent fallback.
"""

from __future__ import annotations

from typing import Any, NoReturn

_WHY = "is not implemented in deepspeed-lean (see docs/compat.md); it covers ZeRO training, not {what}"


def _refuse(name: str, what: str) -> NoReturn:
    raise NotImplementedError(f"deepspeed.{name} " + _WHY.format(what=what))


def init_inference(model: Any = None, config: Any = None, **kwargs: Any) -> NoReturn:
    """Upstream's inference engine entry point: not implemented."""
    _refuse("init_inference", "the inference engine")


def default_inference_config() -> NoReturn:
    """Upstream's inference config defaults: not implemented."""
    _refuse("default_inference_config", "the inference engine")


def tp_model_init(
    model: Any = None, tp_size: int = 1, dtype: Any = None, config: Any = None, **kwargs: Any
) -> NoReturn:
    """Upstream's AutoTP model initialisation: not implemented."""
    _refuse("tp_model_init", "tensor parallelism (AutoTP)")


def _refusing_class(name: str, what: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _refuse(name, what)

    return type(name, (), {"__init__": __init__, "__doc__": f"Upstream's ``{name}``: not implemented ({what})."})


InferenceEngine = _refusing_class("InferenceEngine", "the inference engine")
DeepSpeedHybridEngine = _refusing_class("DeepSpeedHybridEngine", "the hybrid (RLHF) engine")
DeepSpeedTransformerLayer = _refusing_class("DeepSpeedTransformerLayer", "fused transformer kernels")
DeepSpeedTransformerConfig = _refusing_class("DeepSpeedTransformerConfig", "fused transformer kernels")
