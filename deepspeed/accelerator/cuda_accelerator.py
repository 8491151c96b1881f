"""CUDA accelerator. This is the only module of the package that touches ``torch.cuda``.

Nothing here runs at import time, so importing the package never creates a CUDA context
(``deepspeed/__init__`` also sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` so :func:`cuda_is_available` asks NVML
instead of initialising the driver).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator


def cuda_is_available() -> bool:
    """True when torch was built with CUDA and a device is visible (context-free check)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return torch.cuda.is_available()


# (substrings of torch.cuda.get_device_name(), dense fp16/bf16 FLOPS, fp32 FLOPS), most specific first.
_PEAK_FLOPS: tuple[tuple[tuple[str, ...], float, float], ...] = (
    (("H100", "PCIe"), 756e12, 51.2e12),
    (("H100", "NVL"), 835e12, 60e12),
    (("H100",), 989.4e12, 66.9e12),
    (("H200",), 989.4e12, 66.9e12),
    (("A100",), 312e12, 19.5e12),
    (("V100",), 125e12, 15.7e12),
)


class CUDA_Accelerator(DeepSpeedAccelerator):
    """Accelerator implementation over ``torch.cuda`` (communication backend: nccl)."""

    def __init__(self) -> None:
        super().__init__()
        self._name = "cuda"
        self._communication_backend_name: str = "nccl"

    def is_synchronized_device(self) -> bool:
        """CUDA kernels run asynchronously on streams."""
        return False

    def use_host_timers(self) -> bool:
        """Host timers would miss queued kernels; use CUDA events."""
        return False

    def resolves_data_dependency(self) -> bool:
        """Cross-stream dependencies need explicit event waits."""
        return False

    def handles_memory_backpressure(self) -> bool:
        """The host can run ahead of the allocator; callers may need to synchronize."""
        return False

    def device_name(self, device_index: int | None = None) -> str:
        """``'cuda'`` or ``'cuda:<index>'``."""
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        """``torch.cuda.device`` context for ``device_index``."""
        return torch.cuda.device(device_index)

    def set_device(self, device_index: int) -> None:
        """``torch.cuda.set_device``."""
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """``torch.cuda.current_device``."""
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        """``'cuda:<current index>'``."""
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        """``torch.cuda.device_count``."""
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        """``torch.cuda.synchronize``."""
        torch.cuda.synchronize(device_index)

    def random(self) -> Any:
        """``torch.random``."""
        return torch.random

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a CUDA generator state."""
        if device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """Snapshot of a CUDA generator state."""
        return torch.cuda.get_rng_state() if device_index is None else torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed: int) -> None:
        """Seed the current device's generator."""
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed every device's generator."""
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        """Initial seed of the current device's generator."""
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        """Default generator of ``device_index``."""
        return torch.cuda.default_generators[device_index]

    @property
    def Stream(self) -> type:
        """``torch.cuda.Stream``."""
        return torch.cuda.Stream

    def stream(self, stream: Any) -> Any:
        """``torch.cuda.stream`` context."""
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        """``torch.cuda.current_stream``."""
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        """``torch.cuda.default_stream``."""
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self) -> type:
        """``torch.cuda.Event``."""
        return torch.cuda.Event

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache``."""
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """``torch.cuda.memory_allocated``."""
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """``torch.cuda.max_memory_allocated``."""
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Reset the allocated-bytes peak (via ``reset_peak_memory_stats``; the old API is deprecated)."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        """``torch.cuda.memory_reserved``."""
        return torch.cuda.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        """``torch.cuda.max_memory_reserved``."""
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Reset the reserved-bytes peak."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """``torch.cuda.memory_stats``."""
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """``torch.cuda.reset_peak_memory_stats``."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        """``torch.cuda.memory_reserved``."""
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """``torch.cuda.max_memory_reserved``."""
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        """Capacity of the device in bytes."""
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def peak_flops(self, dtype: torch.dtype, device_index: int | None = None) -> float | None:
        """Dense peak FLOPS of the known data-centre GPUs (datasheet figures, no sparsity); ``None`` otherwise.

        fp32 is the plain (non-TF32) rate, as PyTorch runs fp32 matrix products unless TF32 is allowed.
        """
        name = torch.cuda.get_device_name(device_index)
        for marker, half, single in _PEAK_FLOPS:
            if all(part in name for part in marker):
                if dtype in (torch.float16, torch.bfloat16):
                    return half
                return single if dtype == torch.float32 else None
        return None

    def available_memory(self, device_index: int | None = None) -> int:
        """Free bytes as reported by the driver (other processes' use included)."""
        free, _total = torch.cuda.mem_get_info(device_index)
        return free

    def memory_history_supported(self) -> bool:
        """True when a CUDA device is usable."""
        return torch.cuda.is_available()

    def record_memory_history(self, enabled: bool, max_entries: int = 1_000_000) -> None:
        """``torch.cuda.memory._record_memory_history``: every action with its Python stack (alloc and free), or
        off. Turning it on clears an older history where torch supports that (``clear_history``, torch >= 2.5)."""
        record = torch.cuda.memory._record_memory_history
        if not enabled:
            record(enabled=None)
            return
        options: dict[str, Any] = {"context": "all", "stacks": "python", "max_entries": max_entries}
        if (
            "clear_history"
            in inspect.signature(getattr(torch.cuda.memory, "_record_memory_history_impl", record)).parameters
        ):
            options["clear_history"] = True
        record(enabled="all", **options)

    def memory_snapshot(self) -> dict[str, Any] | None:
        """``torch.cuda.memory._snapshot()``: segments alive now and the recorded trace of every device."""
        return torch.cuda.memory._snapshot()

    def is_bf16_supported(self) -> bool:
        """``torch.cuda.is_bf16_supported`` (False when no device is usable)."""
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """float16 needs compute capability 6.0 or newer."""
        if not torch.cuda.is_available():
            return False
        major, _minor = torch.cuda.get_device_capability()
        return major >= 6

    def supported_dtypes(self) -> list[torch.dtype]:
        """float32 plus whichever of float16/bfloat16 the device supports."""
        dtypes = [torch.float]
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def is_available(self) -> bool:
        """``torch.cuda.is_available``."""
        return torch.cuda.is_available()

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        """Open an NVTX range."""
        if hasattr(torch.cuda.nvtx, "range_push"):
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        """Close the innermost NVTX range."""
        if hasattr(torch.cuda.nvtx, "range_pop"):
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        """``torch.cuda._lazy_call``: run once CUDA is initialised."""
        torch.cuda._lazy_call(callback)

    def communication_backend_name(self) -> str:
        """``'nccl'``."""
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        """Triton needs compute capability 7.0 or newer."""
        if not torch.cuda.is_available():
            return False
        major, _minor = torch.cuda.get_device_capability()
        return major >= 7

    def create_graph(self) -> Any:
        """A new ``torch.cuda.CUDAGraph``."""
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        """``torch.cuda.graph`` capture context."""
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        """Replay a captured graph."""
        graph.replay()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """Page-locked copy of ``tensor`` (needed for truly asynchronous host/device copies)."""
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """``tensor.is_pinned()``."""
        return tensor.is_pinned()

    def register_host_memory(self, tensor: torch.Tensor) -> bool:
        """``cudaHostRegister`` over ``tensor``'s bytes: page-locked without the caching host allocator's
        power-of-two rounding."""
        nbytes = tensor.numel() * tensor.element_size()
        try:
            runtime = torch.cuda.cudart()
            return bool(runtime.cudaHostRegister(tensor.data_ptr(), nbytes, 0) == runtime.cudaError.success)
        except (AttributeError, RuntimeError):  # a build without the runtime bindings: pin a copy instead
            return False

    def unregister_host_memory(self, tensor: torch.Tensor) -> None:
        """``cudaHostUnregister`` of a tensor registered by :meth:`register_host_memory`."""
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """True for CUDA tensors."""
        return tensor.device.type == "cuda"

    def op_builder_dir(self) -> str:
        """``deepspeed.ops.op_builder``."""
        return "deepspeed.ops.op_builder"

    def export_envs(self) -> list[str]:
        """NCCL settings must reach every node."""
        return ["NCCL"]

    def visible_devices_envs(self) -> list[str]:
        """``CUDA_VISIBLE_DEVICES``."""
        return ["CUDA_VISIBLE_DEVICES"]
