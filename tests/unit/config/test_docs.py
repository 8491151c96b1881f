"""Every config field is documented where declared and listed in docs/config.md."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from deepspeed.comm.config import CommsLoggerConfig
from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig
from deepspeed.runtime.config import (
    AioConfig,
    CheckpointConfig,
    DeepSpeedFlopsProfilerConfig,
    MemoryTimelineConfig,
    OptimizerBlockConfig,
    SchedulerBlockConfig,
    _RootConfig,
)
from deepspeed.runtime.precision_config import DataTypesConfig, DeepSpeedBF16Config, DeepSpeedFP16Config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig

MODELS = [
    _RootConfig,
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadParamConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedFP16Config,
    DeepSpeedBF16Config,
    DataTypesConfig,
    OptimizerBlockConfig,
    SchedulerBlockConfig,
    DeepSpeedActivationCheckpointingConfig,
    DeepSpeedFlopsProfilerConfig,
    CheckpointConfig,
    AioConfig,
    CommsLoggerConfig,
    TensorBoardConfig,
    WandbConfig,
    CSVConfig,
    CometConfig,
    MemoryTimelineConfig,
]
DOC = (Path(__file__).resolve().parents[3] / "docs" / "config.md").read_text()


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_fields_documented(model: type[BaseModel]) -> None:
    for name, info in model.model_fields.items():
        assert info.description, f"{model.__name__}.{name} has no description"
        assert f"`{name}`" in DOC, f"{model.__name__}.{name} missing from docs/config.md"


def test_lean_switches_explained() -> None:
    for key in (
        "lean_inplace_flatten",
        "lean_eager_grad_release",
        "lean_stream_ordered_release",
        "lean_grads_in_param_shards",
        "lean_gather_from_master",
        "lean_block_fetch_units",
        "lean_unit_grad_reduce",
    ):
        assert DOC.count(key) >= 2  # the switch table and the key reference
