"""``deepspeed.ops.aio``: asynchronous file I/O between host tensors and files (the NVMe offload's I/O op).

``AsyncIOBuilder().load()`` returns the compiled module; its ``aio_handle(block_size=1048576, queue_depth=128,
single_submit=False, overlap_events=False, intra_op_parallelism=1)`` reads and writes whole tensors:
``sync_pread``/``sync_pwrite`` block, ``async_pread``/``async_pwrite`` return at once and ``wait()`` completes them
(returning how many), and ``new_cpu_locked_tensor``/``free_cpu_locked_tensor``/``is_pinned`` manage page-aligned,
page-locked host buffers. Files hold the tensor's raw bytes. A keyword-only ``backend`` (``"auto"``, ``"libaio"``,
``"threads"``) picks the implementation; ``get_backend()`` says which one a handle uses.
"""

from __future__ import annotations

from types import ModuleType

from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

__all__ = ["AsyncIOBuilder", "aio_handle", "load"]


def load() -> ModuleType:
    """The built ``async_io`` module (JIT-compiled with ninja on first use, then cached)."""
    return AsyncIOBuilder().load()


def aio_handle(*args: object, **kwargs: object) -> object:
    """A new handle of the built op (same arguments as the module's ``aio_handle``)."""
    return load().aio_handle(*args, **kwargs)
