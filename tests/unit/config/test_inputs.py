"""Config input forms: dict, JSON/hjson file, base64 string, raw JSON string, and their failure modes."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from deepspeed._core.config.load import load_config_dict
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

BASE = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}


def test_dict_is_kept_by_reference() -> None:
    cfg = DeepSpeedConfig(BASE)
    assert cfg._param_dict is BASE
    assert cfg.gradient_accumulation_steps == 4


def test_json_file_and_pathlike(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BASE))
    for source in (str(path), path):
        cfg = DeepSpeedConfig(source)
        assert cfg._param_dict == BASE
        assert cfg.zero_optimization_stage == 2


def test_hjson_file_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "ds.hjson"
    path.write_text("""
    {
      # batch settings
      train_batch_size: 32
      train_micro_batch_size_per_gpu: 8   // trailing comment
      zero_optimization: { stage: 3, stage3_prefetch_bucket_size: 1e6 }
    }
    """)
    cfg = DeepSpeedConfig(str(path))
    assert cfg.gradient_accumulation_steps == 4
    assert cfg.zero_config.prefetch_bucket_size == 1_000_000


def test_duplicate_keys_in_file_rejected(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(DeepSpeedConfigError, match="Duplicate key.*train_batch_size"):
        DeepSpeedConfig(str(path))


def test_non_json_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"train_batch_size": 8,, ]')
    with pytest.raises(DeepSpeedConfigError, match="broken.json.*not valid JSON"):
        DeepSpeedConfig(str(path))


def test_file_whose_top_level_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(DeepSpeedConfigError, match="JSON object at the top level"):
        DeepSpeedConfig(str(path))


def test_missing_file_is_reported_as_missing(tmp_path: Path) -> None:
    with pytest.raises(DeepSpeedConfigError, match="not found"):
        DeepSpeedConfig(str(tmp_path / "nope.json"))


def test_base64_string() -> None:
    encoded = base64.urlsafe_b64encode(json.dumps(BASE).encode()).decode()
    assert load_config_dict(encoded) == BASE
    assert DeepSpeedConfig(encoded).train_batch_size == 16


def test_raw_json_string() -> None:
    cfg = DeepSpeedConfig(json.dumps(BASE))
    assert cfg.train_micro_batch_size_per_gpu == 4


def test_raw_json_string_that_does_not_parse() -> None:
    with pytest.raises(DeepSpeedConfigError, match="looks like JSON"):
        DeepSpeedConfig('{"train_batch_size": 8,')


def test_garbage_string() -> None:
    with pytest.raises(DeepSpeedConfigError, match="neither an existing file path"):
        DeepSpeedConfig("definitely not a config!")


def test_wrong_type() -> None:
    with pytest.raises(DeepSpeedConfigError, match="must be a dict"):
        DeepSpeedConfig(42)  # type: ignore[arg-type]


def test_error_is_a_value_error() -> None:
    assert issubclass(DeepSpeedConfigError, ValueError)
