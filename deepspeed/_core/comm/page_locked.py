"""Page-locked host memory of exactly the size asked for, for large long-lived staging buffers.

[Note: exact page-locking] ``tensor.pin_memory()`` and ``torch.empty(..., pin_memory=True)`` go through PyTorch's
caching host allocator, which rounds a request up to the next power of two: a 1.34 GB activation buffer takes
2.15 GB of page-locked memory, so a pool of them holds up to 2x the bytes it stores (and it keeps every block it
ever handed out). For buffers that large and that long-lived, :func:`lock_pages` instead allocates ordinary host
memory, page-aligned and a whole number of pages long so that no other allocation shares its pages, and registers
it with the accelerator's driver (``cudaHostRegister`` on CUDA): the same page-locked memory for copies, at the
size asked for. :func:`unlock_pages` unregisters it before it is freed. Where registration is unavailable
(another accelerator, or the driver refuses) the buffer is pinned the usual way; on a machine without an
accelerator it is plain memory.

Users: the activation offload's buffers, the parameters' host shards under ``offload_param`` with pinning, the
partitions NVMe keeps in host memory, and ``offload_states``' copies. Small or short-lived staging buffers keep
the caching allocator: its rounding costs little there and it reuses blocks.
"""

from __future__ import annotations

import weakref

import torch

from deepspeed._foundation.logging import logger
from deepspeed.accelerator import get_accelerator

PAGE = 4096

_REGISTERED: dict[int, torch.Tensor] = {}  # registered address -> the registered view (it keeps the pages alive)
_WARNED: set[str] = set()  # once per accelerator per process


def lock_pages(nbytes: int) -> torch.Tensor:
    """A 1-D ``uint8`` host tensor of ``nbytes`` bytes (rounded up to whole pages), page-locked where copies to an
    accelerator need it. Release it with :func:`unlock_pages` once no copy reads or writes it."""
    size = max(PAGE, -(-int(nbytes) // PAGE) * PAGE)
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return torch.empty(size, dtype=torch.uint8)
    base = torch.empty(size + PAGE, dtype=torch.uint8)
    start = -base.data_ptr() % PAGE
    view = base[start : start + size]
    if accelerator.register_host_memory(view):
        _REGISTERED[view.data_ptr()] = view
        return view
    name = accelerator.device_name()
    if name not in _WARNED:
        _WARNED.add(name)
        logger.info(f"{name}: host buffers are page-locked by the caching host allocator (rounded up to powers of two)")
    return accelerator.pin_memory(torch.empty(size, dtype=torch.uint8))


def locked_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D host tensor over :func:`lock_pages` memory that unregisters itself when this tensor
    object is collected: for long-lived tensors another object owns (a parameter's host shard). A view that
    outlives it stays valid, only no longer page-locked."""
    tensor = _typed(numel, dtype)
    if tensor.data_ptr() in _REGISTERED:
        weakref.finalize(tensor, _unlock_address, tensor.data_ptr())
    return tensor


def _typed(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at the start of a :func:`lock_pages` buffer (same address)."""
    return lock_pages(numel * torch.empty((), dtype=dtype).element_size()).view(dtype)[:numel]


def _unlock_address(address: int) -> None:
    registered = _REGISTERED.pop(address, None)
    if registered is not None:
        get_accelerator().unregister_host_memory(registered)


def page_locked_like(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous host tensor of ``tensor``'s shape and dtype over :func:`lock_pages` memory
    (release it with :func:`unlock_pages`)."""
    return _typed(tensor.numel(), tensor.dtype).view(tensor.shape)


def unlock_pages(tensor: torch.Tensor) -> None:
    """Unregister a buffer from :func:`lock_pages` (or a tensor starting where one does; nothing to do for one
    pinned the usual way). The memory stays valid while views of it live, only no longer page-locked."""
    _unlock_address(tensor.data_ptr())


def is_page_locked(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory is page-locked: registered by :func:`lock_pages` or pinned the usual way.
    (``tensor.is_pinned()`` alone may not see a registration: recent PyTorch asks its caching host allocator.)"""
    address = tensor.data_ptr()
    for start, view in _REGISTERED.items():
        if start <= address < start + view.numel():
            return True
    return tensor.device.type == "cpu" and tensor.is_pinned()


def registered_bytes() -> int:
    """Bytes currently page-locked through registration (for tests and memory reports)."""
    return sum(view.numel() for view in _REGISTERED.values())
