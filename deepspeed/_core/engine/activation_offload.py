"""Activation offload: keep checkpointed inputs in a bounded pool of pinned host buffers between forward and backward.

[Note: activation offload] With activation checkpointing, what stays on the device between forward and backward
is each checkpointed segment's input (one ``[batch, seqlen, hidden]`` tensor per layer). The offloader moves these
to the host and brings them back just ahead of the recomputation that needs them:

* forward: :meth:`ActivationOffloader.stash` takes a tensor. The newest ``keep_last`` tensors stay on the device
  (the last segment's input is the first one backward needs, so moving it out and back would only cost time);
  older ones are copied on a side stream into a pooled host buffer, the side stream waiting on an event recorded
  on the compute stream so the copy reads finished data. The offloader drops its device reference once the compute
  stream has been made to wait on the copy's completion event, at a later stash (so the copy overlaps the next
  segment's compute); the allocator can then reuse the block on the compute stream safely. No tensor is marked as
  used by another stream, and nothing blocks the host.
* backward: :meth:`ActivationOffloader.fetch` returns the device tensor. It allocates on the compute stream, has
  the side stream wait for that, copies host to device on the side stream, and makes the compute stream wait on the
  copy's event; fetching segment ``i`` starts the copy of segment ``i - 1`` (the next one backward reaches), so the
  transfer overlaps segment ``i``'s recomputation. The host buffer goes back to the pool with that copy's event,
  and is handed out again only once the event has completed.

The pool holds at most ``max_buffers`` buffers, reused best-fit by size; when all are in use a tensor simply stays
on the device (counted in ``skipped_marked_tensors``). Once a backward has fetched everything, the pool keeps no
more buffers than that step had taken at once, the largest ones (a longer step's buffers replace a shorter
one's instead of joining them). On a synchronized device (the CPU accelerator) copies are
plain blocking copies and the "device" storage is host memory; the bookkeeping, and the release of the original
storage, are the same.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import weakref
from collections import deque
from typing import Any

import torch

from deepspeed._core.comm.page_locked import lock_pages, unlock_pages
from deepspeed._core.comm.streams import AcceleratorStreams, StreamBackend
from deepspeed.accelerator import get_accelerator

FACADE_MODULE = "deepspeed.runtime.activation_checkpointing.offload_activations"
_ALIGN = 4096  # host buffers are sized in pages so that tensors of nearby sizes share them


class HostMemory(enum.Enum):
    """Whether pool buffers are page-locked (needed for truly asynchronous device copies)."""

    PINNED = "pinned"
    PAGEABLE = "pageable"


class CopyStreams(enum.Enum):
    """Whether copies run on a side stream (``SIDE``) or on the compute stream (``COMPUTE``)."""

    SIDE = "side"
    COMPUTE = "compute"


@dataclasses.dataclass
class CheckpointActivationOffloadStats:
    """Counters of one offloader (upstream's names)."""

    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0


# Set after the class exists: the dataclass machinery resolves field types through the defining module.
CheckpointActivationOffloadStats.__module__ = FACADE_MODULE


class _HostBuffer:
    """One pool buffer: a flat byte tensor and the event after which it may be written again."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.free_after: Any = None  # event of the last copy that read it


def _unlock_all(buffers: list[_HostBuffer]) -> None:
    """Unregister and forget ``buffers``, each once the last copy that read it is done."""
    for buffer in buffers:
        if buffer.free_after is not None:
            buffer.free_after.synchronize()
        unlock_pages(buffer.data)
    buffers.clear()


class PinnedHostPool:
    """At most ``max_buffers`` host buffers, handed out best-fit by size and reused after their copies finish."""

    def __init__(self, max_buffers: int, memory: HostMemory = HostMemory.PINNED) -> None:
        """An empty pool (buffers are created on demand, up to ``max_buffers``)."""
        self.max_buffers, self.memory = max_buffers, memory
        self.buffers: list[_HostBuffer] = []
        self.free: list[_HostBuffer] = []
        self.peak = 0  # most buffers taken at once since the last trim
        weakref.finalize(self, _unlock_all, self.buffers)  # registered pages are unregistered before they are freed

    def take(self, nbytes: int) -> _HostBuffer | None:
        """A buffer of at least ``nbytes`` bytes, or ``None`` when every buffer is busy and the pool is full."""
        fits = [b for b in self.free if b.data.numel() >= nbytes]
        if fits:
            buffer = min(fits, key=lambda b: b.data.numel())
            self.free.remove(buffer)
            if buffer.free_after is not None:
                buffer.free_after.synchronize()  # its host-to-device copy was queued long ago: normally done
                buffer.free_after = None
            return self._taken(buffer)
        if len(self.buffers) >= self.max_buffers:
            if not self.free:
                return None
            # Full, and nothing free is large enough: retire the largest free buffer for a larger one.
            victim = max(self.free, key=lambda b: b.data.numel())
            self.free.remove(victim)
            self.buffers.remove(victim)
            _unlock_all([victim])
        size = math.ceil(nbytes / _ALIGN) * _ALIGN
        # Exactly the size asked for ([Note: exact page-locking]): these buffers are the largest host allocations
        # of a long-sequence run, and the caching host allocator would round each up to a power of two.
        data = lock_pages(size) if self.memory is HostMemory.PINNED else torch.empty(size, dtype=torch.uint8)
        buffer = _HostBuffer(data)
        self.buffers.append(buffer)
        return self._taken(buffer)

    def _taken(self, buffer: _HostBuffer) -> _HostBuffer:
        self.peak = max(self.peak, len(self.buffers) - len(self.free))
        return buffer

    def trim(self) -> None:
        """Retire the smallest free buffers beyond the most taken at once since the last trim (called when a
        backward has fetched everything). Buffers from shorter steps would otherwise stay beside the larger ones a
        longer step added, up to ``max_buffers`` of them; in a steady state nothing is retired."""
        while len(self.buffers) > self.peak and self.free:
            victim = min(self.free, key=lambda b: b.data.numel())
            self.free.remove(victim)
            self.buffers.remove(victim)
            _unlock_all([victim])
        self.peak = len(self.buffers) - len(self.free)

    def give(self, buffer: _HostBuffer, free_after: Any) -> None:
        """Return ``buffer``; it is reused once ``free_after`` (an event, or ``None``) has completed."""
        buffer.free_after = free_after
        self.free.append(buffer)

    def nbytes(self) -> int:
        """Host bytes the pool holds."""
        return sum(b.data.numel() for b in self.buffers)

    def release(self) -> None:
        """Drop every buffer (after waiting for copies that still read them)."""
        _unlock_all(self.buffers)  # emptied in place: the finalizer holds this list
        self.free.clear()


class OffloadHandle:
    """One stashed tensor: on the device (``tensor``), on the host (``buffer``), or on its way back."""

    def __init__(self, tensor: torch.Tensor, index: int) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.index = index
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.stride, self.nbytes = tensor.stride(), tensor.numel() * tensor.element_size()
        self.version = tensor._version  # the copy may be taken later: an in-place edit before it must not pass
        self.buffer: _HostBuffer | None = None
        self.copied: Any = None  # device-to-host copy done
        self.restoring: torch.Tensor | None = None  # device copy being filled
        self.restored: Any = None  # host-to-device copy done
        self.done = False

    def host_view(self) -> torch.Tensor:
        """The host buffer seen as a contiguous tensor of the original dtype and shape."""
        assert self.buffer is not None
        return self.buffer.data[: self.nbytes].view(self.dtype).view(self.shape)


class ActivationOffloader:
    """Moves stashed tensors to pooled host buffers and back ([Note: activation offload])."""

    def __init__(
        self,
        pool: PinnedHostPool,
        keep_last: int = 1,
        copies: CopyStreams = CopyStreams.SIDE,
        max_in_flight: int | None = None,
        backend: StreamBackend | None = None,
    ) -> None:
        """Offload through ``pool``, keeping the newest ``keep_last`` stashed tensors on the device and at most
        ``max_in_flight`` device-to-host copies unretired (``None``: no bound)."""
        self.pool, self.keep_last, self.max_in_flight = pool, keep_last, max_in_flight
        self.backend: StreamBackend = backend if backend is not None else AcceleratorStreams()
        self.synchronized = get_accelerator().is_synchronized_device()
        self.side = self.backend.new_stream() if copies is CopyStreams.SIDE and not self.synchronized else None
        self.stats = CheckpointActivationOffloadStats()
        self.handles: list[OffloadHandle] = []
        self._waiting: deque[OffloadHandle] = deque()  # stashed, still on the device, not yet copied
        self._in_flight: deque[OffloadHandle] = deque()  # copy queued, device tensor still referenced

    # ---------------------------------------------------------------- forward
    def stash(self, tensor: torch.Tensor) -> OffloadHandle:
        """Take ``tensor`` for backward; it may move to the host until :meth:`fetch`."""
        handle = OffloadHandle(tensor, len(self.handles))
        self.handles.append(handle)
        self._retire()
        self._waiting.append(handle)
        while len(self._waiting) > self.keep_last:
            self._offload(self._waiting.popleft())
        return handle

    def _offload(self, handle: OffloadHandle) -> None:
        buffer = self.pool.take(handle.nbytes)
        if buffer is None:
            self.stats.skipped_marked_tensors += 1
            return
        handle.buffer = buffer
        source = handle.tensor
        assert source is not None
        if source._version != handle.version:
            raise RuntimeError(
                "activation offload: a checkpointed input was modified in place after the checkpointed call; "
                "backward would recompute from the modified values (clone it before modifying)"
            )
        ready = self._record()
        with self._on_side(ready):
            handle.host_view().copy_(source, non_blocking=not self.synchronized)
            handle.copied = self._record()
        self._in_flight.append(handle)
        if self.synchronized:
            self._retire_one()  # the copy is complete: nothing to overlap, so the storage can go now
        if self.max_in_flight is not None and len(self._in_flight) > self.max_in_flight:
            self._retire_one()
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += handle.nbytes

    def _retire(self) -> None:
        """Let the device storage of queued copies go: the compute stream is ordered after each copy first."""
        while self._in_flight:
            self._retire_one()

    def _retire_one(self) -> None:
        handle = self._in_flight.popleft()
        if handle.copied is not None and not self.synchronized:
            self.backend.current_stream().wait_event(handle.copied)
        handle.tensor = None

    # ---------------------------------------------------------------- backward
    def fetch(self, handle: OffloadHandle) -> torch.Tensor:
        """The stashed tensor on its device again (the caller's stream is ordered after its copy)."""
        if handle.done:
            raise RuntimeError("activation offload: this tensor was already fetched (backward ran twice?)")
        if handle in self._waiting:
            self._waiting.remove(handle)
            self.stats.kept_last_tensors += 1
        tensor: torch.Tensor | None
        if handle.tensor is not None:  # never left the device, or its copy is still pending
            if handle in self._in_flight:
                self._in_flight.remove(handle)
                self._give_back(handle, handle.copied)
            tensor = handle.tensor
        else:
            if handle.restoring is None:
                self._prefetch(handle)
            if handle.restored is not None and not self.synchronized:
                self.backend.current_stream().wait_event(handle.restored)
            tensor, handle.restoring = handle.restoring, None
            self._give_back(handle, handle.restored)
            self.stats.restored_tensors += 1
            self.stats.restored_bytes += handle.nbytes
        handle.tensor, handle.done = None, True
        self._prefetch_before(handle.index)
        if all(h.done for h in self.handles):
            self.handles = []
            self.pool.trim()
        assert tensor is not None
        return tensor

    def _prefetch(self, handle: OffloadHandle) -> None:
        target = torch.empty_strided(handle.shape, handle.stride, dtype=handle.dtype, device=handle.device)
        ready = self._record()
        with self._on_side(ready):
            target.copy_(handle.host_view(), non_blocking=not self.synchronized)
            handle.restored = self._record()
        handle.restoring = target

    def _prefetch_before(self, index: int) -> None:
        for earlier in reversed(self.handles[:index]):
            if earlier.done:
                continue
            if earlier.tensor is None and earlier.restoring is None and earlier.buffer is not None:
                self._prefetch(earlier)
            return

    def _give_back(self, handle: OffloadHandle, event: Any) -> None:
        if handle.buffer is not None:
            self.pool.give(handle.buffer, None if self.synchronized else event)
            handle.buffer = None

    # ---------------------------------------------------------------- plumbing
    def _record(self) -> Any:
        if self.synchronized:
            return None
        event = self.backend.new_event()
        event.record(self.backend.current_stream())
        return event

    def _on_side(self, ready: Any) -> Any:
        if self.side is None:
            return _NullContext()
        if ready is not None:
            self.side.wait_event(ready)
        return self.backend.use_stream(self.side)

    def resident_bytes(self) -> int:
        """Device bytes the offloader still references (kept, in flight or restored, not yet fetched)."""
        alive = [h.tensor for h in self.handles if h.tensor is not None]
        alive += [h.restoring for h in self.handles if h.restoring is not None]
        return sum(t.numel() * t.element_size() for t in alive)

    def drain(self) -> None:
        """Forget every stashed tensor (a forward without backward) and return all buffers to the pool."""
        self._retire()
        for handle in self.handles:
            self._give_back(handle, handle.restored if handle.restored is not None else handle.copied)
            handle.tensor, handle.restoring, handle.done = None, None, True
        self.handles, self._waiting = [], deque()


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ---------------------------------------------------------------------- marked tensors (saved-tensor hooks)
@dataclasses.dataclass(frozen=True)
class MarkedOffloadPolicy:
    """Settings of :class:`MarkedTensorOffload` (upstream's context-manager arguments, resolved)."""

    memory: HostMemory = HostMemory.PINNED
    copies: CopyStreams = CopyStreams.SIDE
    min_offload_bytes: int = 1024
    max_fwd_stash_count: int = 2
    max_cpu_buffer_pool_count: int = 64
    keep_last_count: int = 1

    def validate(self) -> None:
        """``ValueError`` naming the first negative count."""
        for name in ("min_offload_bytes", "max_fwd_stash_count", "max_cpu_buffer_pool_count", "keep_last_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def _tensor_key(tensor: torch.Tensor) -> tuple:
    # Autograd may hand the pack hook another Python object for the same tensor: identify it by what it views.
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )


class MarkedTensorOffload:
    """Saved-tensor pack/unpack hooks that offload the tensors :meth:`mark` names ([Note: activation offload]).

    A checkpointed layer's input is saved once by the checkpoint (to recompute from); marking it before the layer
    runs sends that saved copy to the host. Other saved tensors pass through untouched, as do marked tensors that
    are too small, off the accelerator, parameters, or broadcast views (stride 0), whose device memory an offload
    could not free.
    """

    def __init__(self, policy: MarkedOffloadPolicy) -> None:
        """An idle engine; its pool fills on first use."""
        policy.validate()
        self.policy = policy
        pool = PinnedHostPool(policy.max_cpu_buffer_pool_count, policy.memory)
        self.offloader = ActivationOffloader(
            pool, policy.keep_last_count, policy.copies, max_in_flight=max(1, policy.max_fwd_stash_count)
        )
        self._marked: set[tuple] = set()

    @property
    def stats(self) -> CheckpointActivationOffloadStats:
        """Counters since construction."""
        return self.offloader.stats

    def mark(self, tensor: torch.Tensor) -> None:
        """Offload ``tensor`` when autograd next saves it (if it qualifies)."""
        self._marked.add(_tensor_key(tensor))
        self.offloader.stats.marked_tensors += 1

    def _qualifies(self, tensor: torch.Tensor) -> bool:
        return (
            not isinstance(tensor, torch.nn.Parameter)
            and get_accelerator().on_accelerator(tensor)
            and tensor.numel() * tensor.element_size() >= self.policy.min_offload_bytes
            and 0 not in tensor.stride()
        )

    def pack(self, tensor: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a handle for a marked tensor, the tensor itself otherwise."""
        self.offloader.stats.saved_tensors_seen += 1
        key = _tensor_key(tensor) if self._marked else None
        if key is None or key not in self._marked:
            return tensor
        self._marked.discard(key)  # saved twice: the second save keeps the device tensor
        if not self._qualifies(tensor):
            self.offloader.stats.skipped_marked_tensors += 1
            return tensor
        return self.offloader.stash(tensor.detach())

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the device tensor back."""
        if isinstance(packed, OffloadHandle):
            return self.offloader.fetch(packed)
        return packed

    def reset(self) -> None:
        """Forget marks and stashed tensors (the pool keeps its buffers for the next step)."""
        self._marked.clear()
        self.offloader.drain()
