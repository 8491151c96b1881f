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


def _lean_switches() -> list[str]:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return [name for name in DeepSpeedZeroConfig.model_fields if name.startswith("lean_")]


def test_lean_switches_explained() -> None:
    """Every lean switch the schema declares is in the README's table, examples/README.md and docs/config.md."""
    root = Path(__file__).resolve().parents[3]
    readme = (root / "README.md").read_text()
    examples = (root / "examples" / "README.md").read_text()
    switches = _lean_switches()
    assert len(switches) >= 8
    for key in switches:
        assert DOC.count(key) >= 2, f"{key}: docs/config.md needs its switch-table row and its key reference"
        assert f"| `{key}` |" in readme, f"{key} missing from the README's lean switch table"
        assert f"| `{key}` |" in examples, f"{key} missing from examples/README.md's lean switch table"
