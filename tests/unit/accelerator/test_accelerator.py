"""Accelerator selection and the CPU accelerator's method surface (no process group, no GPU needed)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import time

import pytest
import torch

from deepspeed.accelerator import (
    DeepSpeedAccelerator,
    get_accelerator,
    is_current_accelerator_supported,
    real_accelerator,
    set_accelerator,
)
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

# Names integrations call (spec 1.10); each must exist on every accelerator.
PUBLIC_METHODS = [
    "device_name",
    "current_device_name",
    "device",
    "set_device",
    "current_device",
    "device_count",
    "synchronize",
    "Stream",
    "stream",
    "current_stream",
    "default_stream",
    "Event",
    "random",
    "manual_seed",
    "manual_seed_all",
    "get_rng_state",
    "set_rng_state",
    "initial_seed",
    "default_generator",
    "empty_cache",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
    "reset_max_memory_allocated",
    "reset_peak_memory_stats",
    "memory_stats",
    "memory_cached",
    "total_memory",
    "available_memory",
    "is_bf16_supported",
    "is_fp16_supported",
    "supported_dtypes",
    "communication_backend_name",
    "is_synchronized_device",
    "resolves_data_dependency",
    "handles_memory_backpressure",
    "use_host_timers",
    "pin_memory",
    "is_pinned",
    "on_accelerator",
    "range_push",
    "range_pop",
    "lazy_call",
    "FloatTensor",
    "HalfTensor",
    "BFloat16Tensor",
    "LongTensor",
    "IntTensor",
    "ByteTensor",
    "DoubleTensor",
    "visible_devices_envs",
    "set_visible_devices_envs",
    "export_envs",
    "get_op_builder",
    "create_op_builder",
    "op_builder_dir",
    "build_extension",
    "get_compile_backend",
    "set_compile_backend",
    "is_available",
    "is_triton_supported",
    "create_graph",
    "capture_to_graph",
    "replay_graph",
]


@pytest.fixture
def fresh_selection(monkeypatch: pytest.MonkeyPatch):
    """Re-run accelerator selection under a patched environment, restoring the session's choice afterwards."""
    saved = real_accelerator.ds_accelerator
    real_accelerator._reset_accelerator_for_tests()
    yield monkeypatch
    real_accelerator.ds_accelerator = saved


def test_env_selects_cpu(fresh_selection: pytest.MonkeyPatch) -> None:
    fresh_selection.setenv("DS_ACCELERATOR", "cpu")
    accel = get_accelerator()
    assert isinstance(accel, CPU_Accelerator) and accel._name == "cpu"
    assert accel.communication_backend_name() == "gloo"
    assert get_accelerator() is accel and is_current_accelerator_supported()


def test_bogus_env_names_valid_values(fresh_selection: pytest.MonkeyPatch) -> None:
    fresh_selection.setenv("DS_ACCELERATOR", "bogus")
    with pytest.raises(ValueError, match=r"DS_ACCELERATOR='bogus'.*\['cuda', 'cpu'\]"):
        get_accelerator()


def test_auto_detect_follows_cuda_availability(fresh_selection: pytest.MonkeyPatch) -> None:
    fresh_selection.delenv("DS_ACCELERATOR", raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert get_accelerator().device_name() == expected


def test_cuda_request_without_device_is_clear(fresh_selection: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    fresh_selection.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(ValueError, match="no usable CUDA device"):
        get_accelerator()


def test_set_accelerator_checks_type(fresh_selection: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError):
        set_accelerator("cpu")  # type: ignore[arg-type]
    accel = CPU_Accelerator()
    set_accelerator(accel)
    assert get_accelerator() is accel


@pytest.mark.parametrize("cls", [CPU_Accelerator, CUDA_Accelerator])
def test_method_surface(cls: type) -> None:
    assert issubclass(cls, DeepSpeedAccelerator) and not inspect.isabstract(cls)
    missing = [name for name in PUBLIC_METHODS if not hasattr(cls, name)]
    assert not missing


def test_cuda_accelerator_pure_methods() -> None:
    accel = CUDA_Accelerator()  # constructing must not touch the driver
    assert accel.device_name() == "cuda" and accel.device_name(1) == "cuda:1"
    assert accel.communication_backend_name() == "nccl"
    assert accel.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"] and accel.export_envs() == ["NCCL"]
    env: dict[str, str] = {}
    accel.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}
    assert not accel.is_synchronized_device()


def test_cpu_streams_and_events_are_noops() -> None:
    accel = CPU_Accelerator()
    stream = accel.Stream()
    with accel.stream(stream):
        start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
        start.record()
        time.sleep(0.01)
        end.record(stream)
    stream.wait_event(end)
    stream.wait_stream(accel.current_stream())
    end.wait(stream)
    end.synchronize()
    stream.synchronize()
    assert stream.query() and end.query() and accel.current_stream() == accel.default_stream()
    assert 5.0 <= start.elapsed_time(end) < 5000.0
    with pytest.raises(RuntimeError):
        accel.Event().elapsed_time(end)


def test_cpu_memory_numbers_track_allocation() -> None:
    accel = CPU_Accelerator()
    accel.reset_peak_memory_stats()
    before = accel.memory_allocated()
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched so it is resident
    after = accel.memory_allocated()
    assert after - before > 32 * 1024 * 1024
    del block
    assert accel.max_memory_allocated() >= after
    assert 0 < accel.available_memory() <= accel.total_memory()
    assert accel.memory_stats()["allocated_bytes.all.peak"] >= after


def test_cpu_dtypes_rng_tensors_and_misc() -> None:
    accel = CPU_Accelerator()
    assert accel.is_bf16_supported() and torch.bfloat16 in accel.supported_dtypes()
    state = accel.get_rng_state()
    first = torch.rand(3)
    accel.set_rng_state(state)
    assert torch.equal(first, torch.rand(3))
    accel.manual_seed(1234)
    assert accel.initial_seed() == 1234 and accel.default_generator(0) is torch.default_generator
    assert accel.LongTensor([1, 2]).dtype == torch.long and accel.BFloat16Tensor([1.0]).dtype == torch.bfloat16
    assert accel.FloatTensor([1.0]).device.type == "cpu" and accel.on_accelerator(torch.zeros(1))
    t = torch.zeros(2)
    assert accel.pin_memory(t) is t
    calls = []
    accel.lazy_call(lambda: calls.append(1))
    assert calls == [1]
    assert accel.get_op_builder("NoSuchBuilder") is None and accel.create_op_builder("NoSuchBuilder") is None
    assert accel.device_name(3) == "cpu" and accel.current_device_name() == "cpu"
    with pytest.raises(ValueError, match="valid backends"):
        accel.set_compile_backend("no-such-backend")
    assert accel.get_compile_backend() == "inductor"


def test_import_creates_no_cuda_context() -> None:
    if not torch.cuda.is_available():
        pytest.skip("vacuous without a CUDA device (nothing could create a context)")
    code = (
        "import deepspeed, torch; from deepspeed.accelerator import get_accelerator; get_accelerator(); "
        "import deepspeed.comm; print(torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
