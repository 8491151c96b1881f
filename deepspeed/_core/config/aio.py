"""The ``aio`` block: how NVMe swap files are read and written (upstream keys and defaults).

Read by the NVMe optimizer swapper, which builds its ``aio_handle`` from these values (through
:class:`~deepspeed._core.config.plan.AioPolicy`).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from deepspeed._core.config.base import DeepSpeedLenientConfigModel


class AioConfig(DeepSpeedLenientConfigModel):
    """``aio`` block: asynchronous NVMe I/O settings."""

    config_block: ClassVar[str] = "aio"

    block_size: int = Field(1048576, gt=0)
    """Bytes per I/O request (a positive multiple of 4096)."""
    queue_depth: int = Field(8, gt=0)
    """Requests in flight per I/O worker: kernel AIO requests (libaio backend), or blocking calls on threads of
    their own, at most 16 per worker (thread-pool backend)."""
    intra_op_parallelism: int = Field(1, gt=0, le=64, alias="thread_count")
    """I/O workers per read or write, each with a contiguous part of it (older spelling: ``thread_count``)."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches (libaio backend)."""
    overlap_events: bool = True
    """Submit new requests as soon as one completes instead of after the whole batch (libaio backend)."""
    use_gds: bool = False
    """Use GPUDirect Storage (not implemented: ``true`` is refused)."""

    @field_validator("block_size")
    @classmethod
    def _page_multiple(cls, value: int) -> int:
        if value % 4096:
            raise ValueError(f"must be a multiple of 4096 bytes (direct I/O alignment); got {value}")
        return value
