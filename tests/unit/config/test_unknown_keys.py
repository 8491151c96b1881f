"""Unknown keys: at the top level one warning per run, on the first rank only, with a "did you mean" hint; inside a
strict block an error naming the block, with the same hint."""

from __future__ import annotations

import logging

import pytest

from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from tests._harness import run_distributed

TYPO = {"train_batch_size": 2, "gradient_acumulation_steps": 1}


def _unknown_key_warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING and "ignoring unknown" in r.getMessage()]


def test_top_level_typo_warns_once_with_a_hint(ds_logs: list[logging.LogRecord]) -> None:
    DeepSpeedConfig(dict(TYPO))
    DeepSpeedConfig(dict(TYPO))  # the engine and zero.Init read the same config again
    warnings = _unknown_key_warnings(ds_logs)
    assert len(warnings) == 1, warnings
    assert "'gradient_acumulation_steps' (did you mean 'gradient_accumulation_steps'?)" in warnings[0]


def test_a_new_unknown_key_still_warns(ds_logs: list[logging.LogRecord]) -> None:
    DeepSpeedConfig(dict(TYPO))
    DeepSpeedConfig({**TYPO, "stps_per_print": 5})
    warnings = _unknown_key_warnings(ds_logs)
    assert len(warnings) == 2 and "did you mean 'steps_per_print'" in warnings[1], warnings
    assert "gradient_acumulation_steps" not in warnings[1]


def test_only_the_first_rank_warns_before_the_process_group(
    ds_logs: list[logging.LogRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    DeepSpeedConfig(dict(TYPO))
    assert not _unknown_key_warnings(ds_logs)


def _warnings_on_this_rank() -> list[str]:
    from deepspeed._core.config import enforce
    from deepspeed.utils.logging import logger

    enforce._warned.clear()
    records: list[str] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        for _ in range(2):
            DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "gradient_acumulation_steps": 1})
    finally:
        logger.removeHandler(handler)
    return [message for message in records if "ignoring unknown" in message]


def test_one_warning_per_run_in_a_world_of_two() -> None:
    rank0, rank1 = run_distributed(_warnings_on_this_rank, 2, timeout=60)
    assert len(rank0) == 1 and "did you mean 'gradient_accumulation_steps'" in rank0[0], rank0
    assert rank1 == []


@pytest.mark.parametrize(
    "config, names",
    [
        ({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 10}}, ["zero_optimization", "'reduce_bucket_size'"]),
        ({"bf16": {"enable": True}}, ["bf16", "'enabled'"]),
        ({"zero_optimization": {"offload_optimizer": {"pin_memroy": True}}}, ["offload_optimizer", "'pin_memory'"]),
    ],
)
def test_nested_typo_in_a_strict_block_is_an_error_with_a_hint(config: dict, names: list[str]) -> None:
    with pytest.raises(DeepSpeedConfigError) as err:
        DeepSpeedConfig({"train_batch_size": 2, **config})
    assert "did you mean" in str(err.value)
    for name in names:
        assert name in str(err.value)
