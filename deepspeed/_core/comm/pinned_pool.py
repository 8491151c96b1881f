"""A bounded pool of reusable page-locked host buffers for offloaded optimizers.

[Note: pinned pool] An offloaded step moves working-precision weights up to the accelerator in chunks, and the
parked gradients of ZeRO-3 come down the same way. Each of those transfers needs a page-locked staging buffer to
run asynchronously; allocating one per transfer (or per step) leans on PyTorch's caching host allocator, which
rounds every request up to a power of two and keeps every block it ever handed out. The pool instead owns a
fixed set of buffers: a request takes a free one of at least the requested size, or allocates a new one only
while the pool's byte bound allows, and the buffer comes back to the pool when the caller releases it. Two
buffers of the step-chunk size serve a whole step, whatever the model size; :attr:`PinnedPool.allocations`
counts how often memory was actually page-locked, so a test can see that steps after the first allocate
nothing. On a machine without an accelerator the buffers are ordinary host memory (nothing to pin).
"""

from __future__ import annotations

import enum

import torch

from deepspeed.accelerator import get_accelerator


class Pinning(enum.Enum):
    """``PAGE_LOCKED``: pin the buffers when there is an accelerator to copy to; ``PAGEABLE``: never
    (``offload_optimizer.pin_memory`` false)."""

    PAGE_LOCKED = "page_locked"
    PAGEABLE = "pageable"


class PinnedPool:
    """Page-locked host buffers, reused; at most ``max_bytes`` in total.

    Args:
        max_bytes: bound on the bytes the pool may hold at once; a request that would exceed it raises.
        pinning: whether the buffers are page-locked.
    """

    def __init__(self, max_bytes: int, pinning: Pinning = Pinning.PAGE_LOCKED) -> None:
        self.max_bytes = int(max_bytes)
        self.allocations = 0
        self._pin = pinning is Pinning.PAGE_LOCKED and get_accelerator().device_name() != "cpu"
        self._free: list[torch.Tensor] = []
        self._taken: dict[int, torch.Tensor] = {}

    @property
    def held_bytes(self) -> int:
        """Bytes the pool holds (free or taken)."""
        return sum(t.numel() for t in self._free) + sum(t.numel() for t in self._taken.values())

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D ``dtype`` view of ``numel`` elements over a pool buffer; give it back with :meth:`release`."""
        nbytes = max(1, numel) * torch.empty((), dtype=dtype).element_size()
        fits = [i for i, t in enumerate(self._free) if t.numel() >= nbytes]
        if fits:
            block = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        else:
            size = 1 << (nbytes - 1).bit_length()  # power of two: what the host allocator would round to anyway
            if self.held_bytes + size > self.max_bytes and self._free:
                self._free.clear()  # drop smaller idle buffers before growing
            if self.held_bytes + size > self.max_bytes:
                raise RuntimeError(
                    f"pinned host pool: {size} more bytes would exceed its bound of {self.max_bytes} bytes "
                    f"({self.held_bytes} held)"
                )
            block = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
            self.allocations += 1
        view = block[:nbytes].view(dtype)[:numel]
        self._taken[view.data_ptr()] = block
        return view

    def release(self, view: torch.Tensor) -> None:
        """Return a buffer from :meth:`acquire` to the pool."""
        block = self._taken.pop(view.data_ptr(), None)
        if block is not None:
            self._free.append(block)

    def clear(self) -> None:
        """Drop every idle buffer (buffers still taken stay valid until released, then are kept)."""
        self._free.clear()
