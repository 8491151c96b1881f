"""Shared fixtures for config-layer tests (pure parsing: no process group, no accelerator)."""

from __future__ import annotations

import logging

import pytest

from deepspeed._core.config import enforce
from deepspeed.utils.logging import logger


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def ds_logs():
    """Records emitted on the DeepSpeed logger (it does not propagate, so caplog cannot see them)."""
    handler = _ListHandler()
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


@pytest.fixture(autouse=True)
def _single_process_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts from a world size of 1 unless it sets WORLD_SIZE itself."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warnings given once per process (no-effect keys, unknown top-level keys) start unsaid in every test."""
    monkeypatch.setattr(enforce, "_warned", set())
