"""``seq_parallel_communication_data_type`` replaces the gradient communication dtype under SP, and warns without SP.

The engine applies :func:`with_sequence_parallel_comm_dtype` to its plan; tests/dist/test_ulysses_sp_precision.py
checks the dtype the gradient reduction then sends.
"""

from __future__ import annotations

import logging

import torch

from deepspeed._core.engine.sequence_layout import with_sequence_parallel_comm_dtype
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.utils.logging import logger


def _plan(**extra: object):
    return DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, **extra}).plan


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _apply(size: int, dtype: torch.dtype, key_given: bool):
    handler = _Records()
    logger.addHandler(handler)
    try:
        plan = with_sequence_parallel_comm_dtype(_plan(), size, dtype, key_given=key_given)
    finally:
        logger.removeHandler(handler)
    return plan.precision.comm_dtype, [m for m in handler.messages if "seq_parallel_communication_data_type" in m]


def test_under_sp_the_gradients_are_reduced_in_the_sp_dtype() -> None:
    assert _plan().precision.comm_dtype == torch.bfloat16  # without SP a bf16 model communicates in bf16
    assert _apply(2, torch.float32, key_given=False) == (torch.float32, [])
    assert _apply(4, torch.float16, key_given=True) == (torch.float16, [])


def test_without_sp_the_key_warns_that_it_does_nothing() -> None:
    dtype, warnings = _apply(1, torch.float32, key_given=True)
    assert dtype == torch.bfloat16
    assert len(warnings) == 1 and "no effect without sequence parallelism" in warnings[0], warnings
    assert _apply(1, torch.float32, key_given=False) == (torch.bfloat16, [])
