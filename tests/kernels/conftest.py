"""Fixtures for the kernel tests: JIT-built ops (cached in TORCH_EXTENSIONS_DIR), skipped with a reason."""

from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch

SLOW_ENV = "DS_KERNEL_SLOW_TESTS"


def _load_or_skip(builder_cls: type) -> ModuleType:
    builder = builder_cls()
    if not builder.is_compatible():
        pytest.skip(f"{builder.NAME} cannot be built here: {builder.error_log}")
    return builder.load()


@pytest.fixture(scope="session")
def cpu_adam_op() -> ModuleType:
    """The built cpu_adam module (ninja + g++ JIT; ~1 min the first time, cached afterwards)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    return _load_or_skip(CPUAdamBuilder)


@pytest.fixture(scope="session")
def utils_op() -> ModuleType:
    """The built utils module (CPU copy path here; with the CUDA kernel on a CUDA machine)."""
    from deepspeed.ops.op_builder import UtilsBuilder

    return _load_or_skip(UtilsBuilder)


@pytest.fixture()
def cuda_device() -> str:
    """'cuda' when a GPU is visible, else a visible skip."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the H200 machine)")
    return "cuda"


@pytest.fixture()
def slow_enabled() -> None:
    """Skip unless the slow kernel checks were asked for."""
    if os.environ.get(SLOW_ENV) != "1":
        pytest.skip(f"slow compile check; run with {SLOW_ENV}=1")
