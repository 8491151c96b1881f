"""Upstream names for features we do not implement exist, and fail loudly (never silently) when used."""

from __future__ import annotations

import pytest

import deepspeed

CALLS = {
    "init_inference": lambda: deepspeed.init_inference(None),
    "default_inference_config": lambda: deepspeed.default_inference_config(),
    "tp_model_init": lambda: deepspeed.tp_model_init(None, tp_size=2),
    "InferenceEngine": lambda: deepspeed.InferenceEngine(None),
    "DeepSpeedHybridEngine": lambda: deepspeed.DeepSpeedHybridEngine(),
    "DeepSpeedTransformerLayer": lambda: deepspeed.DeepSpeedTransformerLayer(),
    "DeepSpeedTransformerConfig": lambda: deepspeed.DeepSpeedTransformerConfig(),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_unsupported_feature_raises_naming_itself(name: str) -> None:
    with pytest.raises(NotImplementedError, match=name):
        CALLS[name]()


def test_capability_probes_are_real() -> None:
    import importlib.util

    assert deepspeed.is_compile_supported() is True  # torch >= 2.0 has torch.compile
    assert deepspeed.HAS_TRITON == (importlib.util.find_spec("triton") is not None)
