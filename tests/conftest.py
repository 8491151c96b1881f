"""Session-wide test setup: CPU accelerator by default, markers, GPU skips, distributed-test hooks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Before anything imports deepspeed: tests run on the CPU accelerator unless the caller asks otherwise.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# Make ``tests._harness`` importable however pytest was started (``pytest`` or ``python -m pytest``).
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from tests import _harness  # noqa: E402


class _NO_PARAMS:  # stands in for the callspec of unparametrized items
    params: dict = {}


def pytest_configure(config: pytest.Config) -> None:
    """Register markers (also listed in pyproject.toml; repeating them keeps this file self-contained)."""
    config.addinivalue_line("markers", "world_size(n): number of processes a distributed test runs in")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped on CPU-only machines)")


def _gpu_skip_reason() -> str | None:
    if os.environ.get("DS_ACCELERATOR", "cpu") != "cuda":
        return "gpu test: set DS_ACCELERATOR=cuda on a machine with a CUDA device to run it"
    import torch

    if not torch.cuda.is_available():
        return "gpu test: DS_ACCELERATOR=cuda but no CUDA device is visible"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests when no CUDA accelerator is selected; pre-start the rank forkserver if needed."""
    if any(
        "dist" in item.path.parts or _harness.WORLD_SIZE_FIXTURE in getattr(item, "callspec", _NO_PARAMS).params
        for item in items
    ):
        _harness.warm_up()
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    reason = _gpu_skip_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _ds_world_size() -> None:
    """Placeholder overridden by the world-size parametrization of distributed tests."""
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``DistributedTest`` methods and ``world_size``-marked tests over their world sizes."""
    _harness.parametrize_world_size(metafunc)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run distributed tests inside their ranks; every other test runs normally."""
    return _harness.run_test_item(pyfuncitem)
