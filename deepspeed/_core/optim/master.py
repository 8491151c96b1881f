"""This rank's fp32 master partition of one flat group, and the post-step all-gather of bit16 weights.

The inner optimizer sees exactly one parameter per group: the fp32 master partition. Its ``.grad`` is
the partition gradient the reducer produced (fp32), handed over without a copy, so the step never
materialises a second copy of the gradient partition (memory_targets.md, report 1).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from deepspeed import comm as dist
from deepspeed._core.comm.streams import record_current
from deepspeed._core.layout.flat_buffer import FlatBuffer
from deepspeed._core.layout.shards import Range, partition_windows


class MasterPlacement(enum.Enum):
    """Where a master partition lives.

    ``PINNED_HOST`` (``offload_optimizer.pin_memory``) keeps the master itself pageable too: the CPU optimizer
    does not need page-locked memory, the transfers go through their own bounded pinned buffers, and pinning a
    partition-sized tensor costs up to twice its size for good ([Note: pinned ring] in ``host_transfer.py``).
    """

    DEVICE = "device"
    HOST = "host"  # offload_optimizer.device == cpu, pin_memory false
    PINNED_HOST = "pinned_host"  # offload_optimizer.device == cpu, pin_memory true (pinned staging)


TRANSFER_CHUNK_NUMEL = 1 << 24
"""Elements per piece when master and working weights sit on different devices (64 MiB of fp32)."""


class TransferPath(enum.Enum):
    """How master values move to and from the working flat buffer.

    ``DIRECT``: one ``copy_`` per buffer piece; on one device the dtype conversion needs no temporary.
    ``CHUNKED``: a blocking cross-device ``copy_`` that also converts dtype converts on the host through a
    temporary as large as the whole piece (a partition-sized bit16 host buffer at every offloaded write-back
    and at creation), so the values go :data:`TRANSFER_CHUNK_NUMEL` at a time and the host transient stays
    one chunk; only working-precision bytes cross the link either way.
    """

    DIRECT = "direct"
    CHUNKED = "chunked"


class MasterPartition:
    """fp32 copy of ``rank``'s partition of a bit16 :class:`FlatBuffer`.

    Args:
        flat: the group's working-precision flat buffer.
        rank: this rank's index in the data-parallel group.
        master_dtype: dtype of the master copy (fp32).
        placement: where the master lives (the flat buffer's device, or pageable host memory when the
            optimizer is offloaded).
        transfer: how values move between the two; ``None`` picks ``CHUNKED`` exactly when the devices differ.
    """

    def __init__(
        self,
        flat: FlatBuffer,
        rank: int,
        master_dtype: torch.dtype,
        placement: MasterPlacement,
        transfer: TransferPath | None = None,
    ) -> None:
        self.flat = flat
        self.rank = rank
        part = flat.layout.partition(rank)
        device = flat.device if placement is MasterPlacement.DEVICE else torch.device("cpu")
        master = torch.empty(part.size, dtype=master_dtype, device=device)
        self.transfer = transfer or (TransferPath.DIRECT if device == flat.device else TransferPath.CHUNKED)
        if self.transfer is TransferPath.DIRECT:
            flat.copy_out(part, master)  # converts dtype per piece: no bit16 temporary of the partition
        else:
            for start, end in _chunks(part.size):
                piece = torch.empty(end - start, dtype=flat.dtype, device=flat.device)
                flat.copy_out(Range(part.start + start, part.start + end), piece)
                master[start:end].copy_(piece)
        self.param = torch.nn.Parameter(master, requires_grad=False)

    @property
    def partition(self) -> Range:
        """This rank's range of the flat group."""
        return self.flat.layout.partition(self.rank)

    def write_back(self) -> None:
        """Copy the updated master values into this rank's slice of the working flat buffer."""
        part, master = self.partition, self.param.data
        with torch.no_grad():
            if self.transfer is TransferPath.DIRECT:
                self.flat.copy_in(part, master)
                return
            send_through_host(
                master,
                self.flat.dtype,
                self.flat.device,
                TRANSFER_CHUNK_NUMEL,
                lambda start, piece: self.flat.copy_in(
                    Range(part.start + start, part.start + start + piece.numel()), piece, non_blocking=True
                ),
            )


def send_through_host(
    src: torch.Tensor,
    dtype: torch.dtype,
    target: torch.device,
    chunk_numel: int,
    write: Callable[[int, torch.Tensor], None],
) -> None:
    """Convert the 1-D host tensor ``src`` to ``dtype`` ``chunk_numel`` elements at a time and hand each piece to
    ``write(offset, piece)``, which copies it to its destination on ``target``; returns once every copy is done.

    Towards an accelerator, two page-locked buffers alternate and ``write`` may issue its copy with
    ``non_blocking=True``: the host converts the next piece while the previous one is in flight, and an event
    recorded after each ``write`` guards its buffer's reuse. Towards the host one pageable buffer serves every
    piece. Either way the buffers are allocated once per call, not per piece (a fresh host tensor per piece
    would also pay page faults on first touch, ``cpu/README.md``), and only working-precision bytes cross.
    """
    numel = src.numel()
    if numel == 0:
        return
    accelerator = target.type != "cpu"
    width = min(chunk_numel, numel)
    stages = [
        torch.empty(width, dtype=dtype, pin_memory=accelerator)
        for _ in range(2 if accelerator and numel > chunk_numel else 1)
    ]
    in_flight: list[Any] = [None] * len(stages)
    for index, start in enumerate(range(0, numel, chunk_numel)):
        slot = index % len(stages)
        if in_flight[slot] is not None:
            in_flight[slot].synchronize()  # that buffer's previous copy has left it
        piece = stages[slot][: min(chunk_numel, numel - start)]
        piece.copy_(src[start : start + piece.numel()])
        write(start, piece)
        if accelerator:
            in_flight[slot] = record_current()
    for event in in_flight:
        if event is not None:
            event.synchronize()


def _chunks(size: int) -> list[tuple[int, int]]:
    return [(a, min(a + TRANSFER_CHUNK_NUMEL, size)) for a in range(0, size, TRANSFER_CHUNK_NUMEL)]


def all_gather_partitions(flat: FlatBuffer, window_numel: int, group: Any) -> None:
    """Rebuild every rank's partition of ``flat`` from its owner, ``window_numel`` elements per rank at a time.

    Each window is one ``all_gather_into_tensor`` over a staging buffer of ``world_size * window``
    elements (the ``allgather_bucket_size`` transient), copied out into the (possibly segmented) buffer.
    """
    layout = flat.layout
    world = layout.world_size
    if world == 1:
        return
    rank = dist.get_rank(group=group)
    windows = list(partition_windows(layout, max(1, window_numel)))
    widest = max((w.size for w in windows), default=0)
    # One staging pair for every window: allocating per window kept the previous window's buffer alive
    # while the next was allocated, doubling this transient at the step peak.
    mine_buf = torch.empty(widest, dtype=flat.dtype, device=flat.device)
    gathered_buf = torch.empty(widest * world, dtype=flat.dtype, device=flat.device)
    for window in windows:
        mine = mine_buf[: window.size]
        flat.copy_out(window.shift(layout.partition(rank).start), mine)
        gathered = gathered_buf[: window.size * world]
        dist.all_gather_into_tensor(gathered, mine, group=group)
        for r in range(world):
            if r == rank:
                continue
            flat.copy_in(window.shift(layout.partition(r).start), gathered[r * window.size : (r + 1) * window.size])
