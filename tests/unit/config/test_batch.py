"""The batch-size triangle: every combination of given keys, world-size sources, and failures."""

from __future__ import annotations

import pytest

from deepspeed._core.config.batch import data_parallel_world_size, resolve_batch
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@pytest.mark.parametrize(
    "given,expected",
    [
        ({TBS: 32, MICRO: 4, GAS: 2}, (32, 4, 2)),
        ({TBS: 32, MICRO: 4}, (32, 4, 2)),
        ({TBS: 32, GAS: 2}, (32, 4, 2)),
        ({MICRO: 4, GAS: 2}, (32, 4, 2)),
        ({TBS: 32}, (32, 8, 1)),
        ({MICRO: 4}, (16, 4, 1)),
    ],
)
def test_triangle_combinations_world_4(given: dict, expected: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = DeepSpeedConfig(dict(given))
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected
    assert cfg.world_size == 4 and cfg.plan.batch.dp_world_size == 4


@pytest.mark.parametrize(
    "given,pattern",
    [
        ({}, "Either train_batch_size or train_micro_batch_size_per_gpu"),
        ({GAS: 4}, "Either train_batch_size or train_micro_batch_size_per_gpu"),
        ({TBS: 30, MICRO: 4, GAS: 2}, "Check batch related parameters.*30 != 4 \\* 2 \\* 4"),
        ({TBS: 30, MICRO: 4}, "Check batch related parameters.*derived"),
        ({TBS: 6}, "Check batch related parameters"),
        ({TBS: 0}, "train_batch_size: 0 has to be greater than 0"),
        ({MICRO: -2}, "train_micro_batch_size_per_gpu: -2 has to be greater than 0"),
        ({TBS: 16, GAS: 0}, "gradient_accumulation_steps: 0 has to be greater than 0"),
    ],
)
def test_triangle_failures(given: dict, pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(DeepSpeedConfigError, match=pattern):
        DeepSpeedConfig(dict(given))


def test_non_integer_batch_size_names_key() -> None:
    with pytest.raises(DeepSpeedConfigError, match="train_micro_batch_size_per_gpu"):
        DeepSpeedConfig({MICRO: 2.5})


def test_top_level_auto_batch_keys_are_derived() -> None:
    cfg = DeepSpeedConfig({TBS: "auto", MICRO: 4, GAS: "auto"})
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (4, 1)


def test_all_auto_batch_keys_fail_clearly() -> None:
    with pytest.raises(DeepSpeedConfigError, match="Either train_batch_size"):
        DeepSpeedConfig({TBS: "auto", MICRO: "auto", GAS: 1})


class _Mpu:
    def get_data_parallel_world_size(self) -> int:
        return 3


def test_world_size_from_mpu_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = DeepSpeedConfig({MICRO: 2, GAS: 2}, mpu=_Mpu())
    assert cfg.world_size == 3 and cfg.train_batch_size == 12


def test_sequence_parallel_divides_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert DeepSpeedConfig({MICRO: 1, "sequence_parallel_size": 4}).world_size == 2
    with pytest.raises(DeepSpeedConfigError, match="sequence_parallel_size"):
        data_parallel_world_size(sequence_parallel_size=3)


def test_bad_world_size_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(DeepSpeedConfigError, match="WORLD_SIZE"):
        DeepSpeedConfig({MICRO: 1})


def test_resolve_batch_is_pure() -> None:
    plan = resolve_batch(None, 3, 5, 7)
    assert plan.train_batch_size == 105 and plan.gradient_accumulation_steps == 5


def test_setters_update_plan_and_recheck() -> None:
    cfg = DeepSpeedConfig({TBS: 8, MICRO: 2})
    assert cfg.plan.batch.gradient_accumulation_steps == 4
    cfg.train_batch_size = 16
    cfg.gradient_accumulation_steps = 8
    assert cfg.plan.batch == type(cfg.plan.batch)(16, 2, 8, 1)
    cfg.gradient_accumulation_steps = 3
    with pytest.raises(DeepSpeedConfigError, match="Check batch related parameters"):
        _ = cfg.plan
