"""CPU accelerator: lets the whole engine (and the test suite) run on plain CPUs with the gloo backend.

Streams and events are no-op objects with the CUDA method set, so code written against streams runs unchanged:
CPU kernels execute synchronously, so every ordering request is already satisfied.

Memory numbers are *process* numbers, not allocator numbers: ``memory_allocated``/``memory_reserved`` report the
resident set size (RSS) of this process (``/proc/self/statm``, else psutil). The "max" variants are
the highest RSS seen by any memory query since the last reset -- a sampled peak, not an exact one.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator


class CPUStream:
    """Stand-in for a device stream; CPU work is already ordered, so every method is a no-op."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = device
        self.priority = priority

    def wait_event(self, event: Any) -> None:
        """No-op: CPU work recorded before ``event`` has already finished."""

    def wait_stream(self, stream: Any) -> None:
        """No-op: there is only one CPU timeline."""

    def record_event(self, event: CPUEvent | None = None) -> CPUEvent:
        """Record (and return) an event at the current point."""
        event = event if event is not None else CPUEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """No-op: nothing is queued."""

    def query(self) -> bool:
        """Always ``True``: all work has completed."""
        return True

    def __eq__(self, other: object) -> bool:
        # Every CPU stream is the same timeline; comparing "current_stream() == my_stream" must hold.
        return isinstance(other, CPUStream)

    def __hash__(self) -> int:
        return hash(CPUStream)


class CPUEvent:
    """Stand-in for a device event; ``record`` stores a host timestamp so ``elapsed_time`` works."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        """Remember the current host time."""
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """No-op: CPU work is synchronous."""

    def query(self) -> bool:
        """Always ``True``: recorded work is complete."""
        return True

    def synchronize(self) -> None:
        """No-op: recorded work is complete."""

    def elapsed_time(self, end_event: CPUEvent) -> float:
        """Milliseconds between this event's and ``end_event``'s ``record`` calls."""
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time needs both events to have been recorded")
        return (end_event._time - self._time) * 1000.0


_STATM: dict[int, int] = {}  # pid -> open descriptor of that process's /proc/self/statm (-1: none)


def _process_rss() -> int:
    # Read through a descriptor kept open (pread from offset 0 re-reads the live figures): a memory query per phase
    # per step then costs a couple of microseconds instead of a psutil object and a file open each time.
    pid = os.getpid()  # a forked child inherits the descriptor, which still names its parent
    fd = _STATM.get(pid)
    if fd is None:
        try:
            fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            fd = -1
        _STATM[pid] = fd
    if fd >= 0:
        return int(os.pread(fd, 128, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")
    import psutil  # hosts without /proc

    return int(psutil.Process(pid).memory_info().rss)


def _meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as fd:
        for line in fd:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class CPU_Accelerator(DeepSpeedAccelerator):
    """Accelerator implementation for CPU-only hosts (communication backend: gloo)."""

    def __init__(self) -> None:
        super().__init__()
        self._name = "cpu"
        self._communication_backend_name: str = "gloo"
        self._peak_rss = 0

    def is_synchronized_device(self) -> bool:
        """CPU kernels run synchronously."""
        return True

    def use_host_timers(self) -> bool:
        """Host timers measure CPU work exactly."""
        return True

    def resolves_data_dependency(self) -> bool:
        """Synchronous execution already orders dependent work."""
        return True

    def handles_memory_backpressure(self) -> bool:
        """No queue can outrun the allocator on a synchronous device."""
        return True

    def device_name(self, device_index: int | None = None) -> str:
        """Always ``'cpu'``: torch has a single CPU device."""
        return "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        """The CPU device."""
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        """No-op: there is one CPU device."""

    def current_device(self) -> int:
        """Always 0."""
        return 0

    def current_device_name(self) -> str:
        """Always ``'cpu'``."""
        return "cpu"

    def device_count(self) -> int:
        """Ranks per node when a launcher says so (``LOCAL_WORLD_SIZE``/``LOCAL_SIZE``), else 1."""
        for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            if os.environ.get(name, "").isdigit():
                return int(os.environ[name])
        return 1

    def synchronize(self, device_index: int | None = None) -> None:
        """No-op: nothing is queued."""

    def random(self) -> Any:
        """``torch.random``."""
        return torch.random

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore the CPU generator state."""
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """CPU generator state."""
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> torch.Generator:
        """Seed the CPU generator."""
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> torch.Generator:
        """Seed the CPU generator (the only one)."""
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        """Initial seed of the CPU generator."""
        return torch.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        """``torch.default_generator``."""
        return torch.default_generator

    @property
    def Stream(self) -> type:
        """:class:`CPUStream`."""
        return CPUStream

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """A null context: CPU has one timeline."""
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> CPUStream:
        """A :class:`CPUStream`."""
        return CPUStream()

    def default_stream(self, device_index: int | None = None) -> CPUStream:
        """A :class:`CPUStream`."""
        return CPUStream()

    @property
    def Event(self) -> type:
        """:class:`CPUEvent`."""
        return CPUEvent

    def empty_cache(self) -> None:
        """No-op: the CPU allocator returns memory itself."""

    def _sample_rss(self) -> int:
        rss = _process_rss()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Process RSS in bytes (see module docstring)."""
        return self._sample_rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Highest RSS sampled since the last reset."""
        self._sample_rss()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Restart the sampled peak from the current RSS."""
        self.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        """Same as :meth:`memory_reserved`."""
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        """Same as :meth:`max_memory_reserved`."""
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Same as :meth:`reset_peak_memory_stats`."""
        self.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """RSS-based stats under the CUDA allocator's key names that callers read most."""
        current = self._sample_rss()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": self._peak_rss,
            "reserved_bytes.all.current": current,
            "reserved_bytes.all.peak": self._peak_rss,
        }

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Restart the sampled peak from the current RSS."""
        self._peak_rss = _process_rss()

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Process RSS in bytes (CPU has no caching allocator to distinguish)."""
        return self._sample_rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Highest RSS sampled since the last reset."""
        return self.max_memory_allocated(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        """Physical memory of the host in bytes."""
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        """Memory the host could still hand out (``MemAvailable``), in bytes."""
        try:
            import psutil

            return int(psutil.virtual_memory().available)
        except ImportError:
            return _meminfo_bytes("MemAvailable")

    def memory_history_supported(self) -> bool:
        """False: the CPU allocator keeps no alloc/free history."""
        return False

    def record_memory_history(self, enabled: bool, max_entries: int = 1_000_000) -> None:
        """No-op: the CPU allocator keeps no alloc/free history to record."""

    def memory_snapshot(self) -> dict[str, Any] | None:
        """``None``: the CPU allocator has no segments or history to snapshot."""
        return None

    def is_bf16_supported(self) -> bool:
        """bfloat16 arithmetic works on every CPU torch supports."""
        return True

    def is_fp16_supported(self) -> bool:
        """float16 arithmetic works (emulated where the ISA lacks it)."""
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        """float32, bfloat16 and float16."""
        return [torch.float, torch.bfloat16, torch.half]

    def is_available(self) -> bool:
        """Always ``True``."""
        return True

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        """No-op: no device profiler ranges on CPU."""

    def range_pop(self, domain: Any = None) -> None:
        """No-op: no device profiler ranges on CPU."""

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` now: there is no lazily initialised runtime."""
        callback()

    def communication_backend_name(self) -> str:
        """``'gloo'``."""
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        """Triton targets GPUs only."""
        return False

    def create_graph(self) -> None:
        """``None``: graphs do not exist on CPU."""
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> contextlib.AbstractContextManager:
        """A null context: the work simply runs."""
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        """No-op: nothing was captured."""

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """``tensor`` itself: page-locking only matters for device DMA."""
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """What torch reports (``False`` on CPU-only builds)."""
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """True for CPU tensors."""
        return tensor.device.type == "cpu"

    def op_builder_dir(self) -> str:
        """CPU-specific builders first; :meth:`get_op_builder` falls back to the shared package."""
        return "deepspeed.ops.op_builder.cpu"

    def export_envs(self) -> list[str]:
        """No device-library variables to forward."""
        return []

    def visible_devices_envs(self) -> list[str]:
        """None: CPU processes see every core."""
        return []
