"""Swap files: the on-disk side shared by every NVMe swapper (optimizer state, parameters).

A swap file holds the raw bytes of one tensor (no header). It is allocated to its full size when created, so a
disk without room fails there, naming the file, the bytes it needs and the free space; before it is read it is
checked to exist with its expected size, so a file removed or truncated between uses is reported by name instead
of being read as zeros (the I/O op also refuses a short read). Reads and writes go through the ``async_io`` op's
``aio_handle`` built from the ``aio`` block (:func:`open_handle`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from deepspeed._core.config.plan import AioPolicy


def _free_bytes(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free} bytes are free there"
    except OSError:
        return "its free space is unknown"


def allocate_file(path: Path, nbytes: int, key: str) -> None:
    """Create ``path`` with ``nbytes`` reserved on disk, or raise naming the path, the bytes needed and ``key``
    (the config key of the swap folder)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
    except OSError as err:
        raise OSError(
            err.errno,
            f"NVMe swap file {path} needs {nbytes} bytes and could not get them ({err.strerror}); "
            f"{_free_bytes(path.parent)} ({key})",
        ) from None


def check_file(path: Path, nbytes: int, holds: str) -> None:
    """Raise naming ``path`` unless it exists with exactly ``nbytes`` bytes; ``holds`` says what it held."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise RuntimeError(
            f"NVMe swap file {path} is missing: the {holds} it held ({nbytes} bytes) is lost; "
            "resume from the last checkpoint"
        ) from None
    if size != nbytes:
        raise RuntimeError(
            f"NVMe swap file {path} holds {size} bytes but {nbytes} are expected (truncated or replaced): "
            f"the {holds} in it is not valid; resume from the last checkpoint"
        )


def fresh_folder(folder: Path) -> Path:
    """``folder`` created empty: whatever an earlier run left there is removed (never read)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def aio_module() -> Any:
    """The built ``async_io`` op (compiled on first use)."""
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

    return AsyncIOBuilder().load()


def open_handle(op: Any, aio: AioPolicy) -> Any:
    """One ``aio_handle`` with the ``aio`` block's settings."""
    return op.aio_handle(
        aio.block_size, aio.queue_depth, aio.single_submit, aio.overlap_events, aio.intra_op_parallelism
    )
