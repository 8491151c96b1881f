"""The :class:`DeepSpeedAccelerator` interface: one object per process that hides the device runtime.

Method names and signatures follow upstream DeepSpeed because integrations (Megatron-DeepSpeed, GPT-NeoX,
training scripts) call them directly. Device-specific behaviour is abstract; the few pieces that are the same
on every device (tensor factories, compile backend bookkeeping, op-builder lookup) live here once.
"""

from __future__ import annotations

import abc
import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

_DEFAULT_COMPILE_BACKEND = "inductor"


class DeepSpeedAccelerator(abc.ABC):
    """Abstract device runtime used by every DeepSpeed component instead of ``torch.cuda``."""

    supports_nvtx_domain = False

    def __init__(self) -> None:
        # Upstream code and integrations read these two private attributes directly.
        self._name: str | None = None
        self._communication_backend_name: str | None = None
        self._compile_backend: str = _DEFAULT_COMPILE_BACKEND

    # ------------------------------------------------------------------ execution model
    @abc.abstractmethod
    def is_synchronized_device(self) -> bool:
        """True when kernels run synchronously with the host (no streams to order)."""

    @abc.abstractmethod
    def use_host_timers(self) -> bool:
        """True when wall-clock host timers measure device work accurately."""

    @abc.abstractmethod
    def resolves_data_dependency(self) -> bool:
        """True when the runtime orders dependent work itself (no explicit stream waits needed)."""

    @abc.abstractmethod
    def handles_memory_backpressure(self) -> bool:
        """True when the runtime throttles allocation itself (no explicit synchronize needed)."""

    # ------------------------------------------------------------------ devices
    @abc.abstractmethod
    def device_name(self, device_index: int | None = None) -> str:
        """Device string, e.g. ``'cuda'`` or ``'cuda:1'`` when an index is given."""

    @abc.abstractmethod
    def device(self, device_index: int | None = None) -> Any:
        """A device object/context for ``device_index``."""

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` the current device of this process."""

    @abc.abstractmethod
    def current_device(self) -> int:
        """Index of the current device."""

    @abc.abstractmethod
    def current_device_name(self) -> str:
        """Device string of the current device, e.g. ``'cuda:0'``."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of devices visible to this process."""

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None:
        """Block the host until all queued work on the device has finished."""

    # ------------------------------------------------------------------ RNG
    @abc.abstractmethod
    def random(self) -> Any:
        """The module that owns this device's random-number state."""

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore the generator state captured by :meth:`get_rng_state`."""

    @abc.abstractmethod
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """Snapshot of the generator state as a byte tensor."""

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> Any:
        """Seed the current device's generator."""

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> Any:
        """Seed the generators of all devices."""

    @abc.abstractmethod
    def initial_seed(self) -> int:
        """Seed the current generator started from."""

    @abc.abstractmethod
    def default_generator(self, device_index: int) -> torch.Generator:
        """The default :class:`torch.Generator` of ``device_index``."""

    # ------------------------------------------------------------------ streams and events
    @property
    @abc.abstractmethod
    def Stream(self) -> type:
        """Stream class of this device (constructible with no arguments)."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> Any:
        """Context manager that makes ``stream`` current."""

    @abc.abstractmethod
    def current_stream(self, device_index: int | None = None) -> Any:
        """The stream work is currently queued on."""

    @abc.abstractmethod
    def default_stream(self, device_index: int | None = None) -> Any:
        """The device's default stream."""

    @property
    @abc.abstractmethod
    def Event(self) -> type:
        """Event class of this device (``Event(enable_timing=False)``)."""

    # ------------------------------------------------------------------ memory
    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused blocks to the device."""

    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes currently held by live tensors."""

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_allocated` since the last reset."""

    @abc.abstractmethod
    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Restart peak tracking for :meth:`max_memory_allocated`."""

    @abc.abstractmethod
    def memory_cached(self, device_index: int | None = None) -> int:
        """Legacy name for :meth:`memory_reserved`."""

    @abc.abstractmethod
    def max_memory_cached(self, device_index: int | None = None) -> int:
        """Legacy name for :meth:`max_memory_reserved`."""

    @abc.abstractmethod
    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Legacy name for resetting the reserved-memory peak."""

    @abc.abstractmethod
    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """Allocator statistics as a flat dict."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Restart every peak counter."""

    @abc.abstractmethod
    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes reserved by the caching allocator."""

    @abc.abstractmethod
    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_reserved` since the last reset."""

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int:
        """Capacity of the device in bytes."""

    @abc.abstractmethod
    def available_memory(self, device_index: int | None = None) -> int:
        """Bytes that could still be allocated."""

    # Allocator history (config ``memory_timeline``). Not abstract: devices without such a history keep these.
    def memory_history_supported(self) -> bool:
        """True when :meth:`record_memory_history` can record every allocation and free with its stack."""
        return False

    def record_memory_history(self, enabled: bool, max_entries: int = 1_000_000) -> None:
        """Start (``enabled``) or stop recording the allocator's alloc/free history with Python stacks.

        ``max_entries`` bounds the history (a ring buffer: older entries are dropped). Read the history with
        :meth:`memory_snapshot` before stopping.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no allocator history to record; memory_timeline needs a CUDA device"
        )

    def memory_snapshot(self) -> dict[str, Any] | None:
        """The allocator's segments and recorded history in ``torch.cuda.memory._snapshot()`` format."""
        raise NotImplementedError(
            f"{type(self).__name__} has no allocator snapshot; memory_timeline needs a CUDA device"
        )

    # Not abstract: a device whose peak is unknown answers None, and the FLOPs profiler then omits its MFU line.
    def peak_flops(self, dtype: torch.dtype, device_index: int | None = None) -> float | None:
        """Dense peak matrix-multiply FLOPS of one device in ``dtype`` (vendor datasheet), or ``None`` if unknown."""
        return None

    # ------------------------------------------------------------------ dtypes
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool:
        """True when bfloat16 arithmetic is supported."""

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool:
        """True when float16 arithmetic is supported."""

    @abc.abstractmethod
    def supported_dtypes(self) -> list[torch.dtype]:
        """Floating dtypes that training may use on this device."""

    # ------------------------------------------------------------------ misc
    @abc.abstractmethod
    def is_available(self) -> bool:
        """True when at least one device of this kind can be used."""

    @abc.abstractmethod
    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        """Open a named profiler range."""

    @abc.abstractmethod
    def range_pop(self, domain: Any = None) -> None:
        """Close the innermost profiler range."""

    @abc.abstractmethod
    def lazy_call(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` once the device runtime is initialised."""

    @abc.abstractmethod
    def communication_backend_name(self) -> str:
        """torch.distributed backend to use with this device (``'nccl'``, ``'gloo'``)."""

    @abc.abstractmethod
    def is_triton_supported(self) -> bool:
        """True when Triton kernels can run on this device."""

    def prefer_triton_grouped_mm(self) -> bool:
        """Whether fused MoE paths should prefer a Triton grouped GEMM (off unless a backend opts in)."""
        return False

    # ------------------------------------------------------------------ graphs
    @abc.abstractmethod
    def create_graph(self) -> Any:
        """A new capture graph object (or ``None`` where graphs do not exist)."""

    @abc.abstractmethod
    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        """Context manager that records work into ``graph``."""

    @abc.abstractmethod
    def replay_graph(self, graph: Any) -> None:
        """Re-run the work recorded in ``graph``."""

    # ------------------------------------------------------------------ tensor factories
    def _tensor_factory(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        # ``torch.cuda.FloatTensor``-style legacy types are deprecated; a partial over torch.tensor gives
        # the same call shape (``LongTensor([1, 2])``) on every device.
        return functools.partial(torch.tensor, dtype=dtype, device=self.current_device_name())

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:
        """Factory building a bfloat16 tensor on the current device."""
        return self._tensor_factory(torch.bfloat16)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:
        """Factory building a uint8 tensor on the current device."""
        return self._tensor_factory(torch.uint8)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:
        """Factory building a float64 tensor on the current device."""
        return self._tensor_factory(torch.double)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:
        """Factory building a float32 tensor on the current device."""
        return self._tensor_factory(torch.float)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:
        """Factory building a float16 tensor on the current device."""
        return self._tensor_factory(torch.half)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:
        """Factory building an int32 tensor on the current device."""
        return self._tensor_factory(torch.int)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:
        """Factory building an int64 tensor on the current device."""
        return self._tensor_factory(torch.long)

    # ------------------------------------------------------------------ host memory
    @abc.abstractmethod
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """Return a page-locked copy of ``tensor`` (or ``tensor`` where pinning is meaningless)."""

    @abc.abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lives in page-locked host memory."""

    def register_host_memory(self, tensor: torch.Tensor) -> bool:
        """Page-lock ``tensor``'s own host memory in place, at its exact size; ``False`` where this accelerator
        cannot (the caller pins a copy instead). Undo it with :meth:`unregister_host_memory` before the memory is
        freed. Not part of upstream's interface: the default declines."""
        return False

    def unregister_host_memory(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`register_host_memory` for ``tensor`` (the default registers nothing, so has nothing to undo)."""
        return None

    @abc.abstractmethod
    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lives on this accelerator's device type."""

    # ------------------------------------------------------------------ op builders
    @abc.abstractmethod
    def op_builder_dir(self) -> str:
        """Dotted module path that holds this accelerator's op builder classes."""

    def _op_builder_modules(self) -> list[str]:
        # The device-specific builder package first, then the shared one, so a device can override a builder.
        shared = "deepspeed.ops.op_builder"
        own = self.op_builder_dir()
        return [own] if own == shared else [own, shared]

    def get_op_builder(self, class_name: str) -> type | None:
        """Builder *class* named ``class_name``, or ``None`` when no such builder exists here."""
        for module_name in self._op_builder_modules():
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            builder = getattr(module, class_name, None)
            if builder is not None:
                return builder
        return None

    def create_op_builder(self, class_name: str) -> Any:
        """Instance of the builder named ``class_name``, or ``None`` when it does not exist."""
        builder_class = self.get_op_builder(class_name)
        return builder_class() if builder_class is not None else None

    def build_extension(self) -> type:
        """The setuptools ``build_ext`` command class for C++/device extensions."""
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    # ------------------------------------------------------------------ launcher environment
    @abc.abstractmethod
    def export_envs(self) -> list[str]:
        """Environment-variable prefixes the multi-node launcher forwards to remote ranks."""

    @abc.abstractmethod
    def visible_devices_envs(self) -> list[str]:
        """Environment variables that restrict which devices a process sees."""

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        """Write ``local_accelerator_ids`` into every variable of :meth:`visible_devices_envs`."""
        value = ",".join(str(i) for i in local_accelerator_ids)
        for name in self.visible_devices_envs():
            current_env[name] = value

    # ------------------------------------------------------------------ torch.compile
    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend name used by ``engine.compile()``."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Select the ``torch.compile`` backend; raises ``ValueError`` naming the valid choices."""
        from torch import _dynamo  # local: importing dynamo is slow and rarely needed

        valid = _dynamo.list_backends(exclude_tags=())
        if backend not in valid:
            raise ValueError(f"{backend!r} is not a torch.compile backend; valid backends: {sorted(valid)}")
        self._compile_backend = backend
