"""CUDA kernels against torch (flatten/unflatten, fused Adam). Run on a GPU machine; skipped elsewhere.

The checks themselves are plain functions in cuda_checks.py, shared with benchmarks/kernels/bench_ops.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.gpu


def _load_checks() -> ModuleType:
    path = Path(__file__).with_name("cuda_checks.py")
    spec = importlib.util.spec_from_file_location("ds_kernel_cuda_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECKS = _load_checks()


@pytest.mark.parametrize("check", CHECKS.ALL_CHECKS, ids=lambda c: c.__name__)
def test_cuda_check(cuda_device: str, check: object) -> None:
    check(cuda_device)  # type: ignore[operator]
