"""This rank's fp32 master of one optimizer group, and how its values reach the working weights.

The inner optimizer sees exactly one parameter per group: the flat fp32 master (:class:`MasterShard`). Its
``.grad`` is the gradient shard the reducer produced, handed over without a copy where dtype and device match,
so the step never materialises a second copy of it. After the step the values go back to the working weights
through one of two strategies: an all-gather of the flat buffer's partitions (ZeRO-1/2) or a scatter into the
parameters' own shards (ZeRO-3), skipping the shards that are views of the master ([Note: zero3-master]).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import gather_rows
from deepspeed._core.comm.streams import record_current
from deepspeed._core.layout.flat_buffer import FlatBuffer
from deepspeed._core.layout.shards import Range, partition_windows
from deepspeed._core.params.param import ShardAccess


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


class ShardOwner(Protocol):
    """What :class:`ScatterWriteBack` needs of a ZeRO-3 parameter state: its shard and its padded shard size."""

    shard: torch.Tensor
    layout: Any


class MasterShard:
    """This rank's fp32 master of one optimizer group: the single parameter the inner optimizer steps.

    One type serves every ZeRO stage; what differs is where the working weights live, so the write-back is a
    strategy: :class:`GatherWriteBack` (ZeRO-1/2: this rank's partition of a flat buffer, then an all-gather of
    every partition) or :class:`ScatterWriteBack` (ZeRO-3: the slices of each parameter's own shard). Build one
    with :meth:`of_flat` or :meth:`of_shards`.

    Args:
        values: the flat master tensor (already holding the working weights' values).
        writer: how values move between the master and the working weights.
    """

    def __init__(self, values: torch.Tensor, writer: GatherWriteBack | ScatterWriteBack) -> None:
        self.param = torch.nn.Parameter(values, requires_grad=False)
        self.writer = writer

    @classmethod
    def of_flat(
        cls,
        flat: FlatBuffer,
        rank: int,
        master_dtype: torch.dtype,
        placement: MasterPlacement,
        transfer: TransferPath | None = None,
        group: Any = None,
        window_numel: int = 1 << 30,
    ) -> MasterShard:
        """The master of ``rank``'s partition of ``flat`` (ZeRO-1/2), on the flat buffer's device or the host.

        ``transfer`` ``None`` picks ``CHUNKED`` exactly when the two devices differ; ``group`` and
        ``window_numel`` are the post-step all-gather's process group and per-rank window.
        """
        device = flat.device if placement is MasterPlacement.DEVICE else torch.device("cpu")
        transfer = transfer or (TransferPath.DIRECT if device == flat.device else TransferPath.CHUNKED)
        writer = GatherWriteBack(flat, rank, transfer, group, window_numel)
        values = torch.empty(writer.partition.size, dtype=master_dtype, device=device)
        writer.read(values)
        return cls(values, writer)

    @classmethod
    def of_shards(
        cls,
        states: Sequence[ShardOwner],
        master_dtype: torch.dtype,
        device: torch.device | str,
        chunk_numel: int,
    ) -> MasterShard:
        """The master of a ZeRO-3 group: the concatenation of its parameters' shards (``states``, in order)."""
        writer = ScatterWriteBack(states, chunk_numel)
        values = torch.empty(writer.numel, dtype=master_dtype, device=device)
        writer.read(values)
        return cls(values, writer)

    @property
    def data(self) -> torch.Tensor:
        """The master values (``param.data``)."""
        return self.param.data

    @property
    def device(self) -> torch.device:
        """Where the master lives."""
        return self.param.device

    @property
    def dtype(self) -> torch.dtype:
        """The master's dtype."""
        return self.param.dtype

    def numel(self) -> int:
        """Elements of the master."""
        return self.param.numel()

    def write_back(self) -> None:
        """Publish the updated master values to the working weights."""
        with torch.no_grad():
            self.writer.write(self.param.data)

    def refresh(self) -> None:
        """Rebuild the master from the working weights' current values (after a module-only load)."""
        with torch.no_grad():
            self.writer.read(self.param.data)


class GatherWriteBack:
    """ZeRO-1/2 write-back: the master is ``rank``'s partition of a working flat buffer; after writing it the
    partitions of every rank are all-gathered (``window_numel`` elements per rank at a time)."""

    def __init__(self, flat: FlatBuffer, rank: int, transfer: TransferPath, group: Any, window_numel: int) -> None:
        self.flat, self.rank, self.transfer = flat, rank, transfer
        self.group, self.window_numel = group, window_numel

    @property
    def partition(self) -> Range:
        """This rank's range of the flat group."""
        return self.flat.layout.partition(self.rank)

    def read(self, master: torch.Tensor) -> None:
        """This rank's partition of the flat buffer into ``master`` (converted piece by piece: no bit16
        temporary of the partition)."""
        part, flat = self.partition, self.flat
        if self.transfer is TransferPath.DIRECT:
            flat.copy_out(part, master)
            return
        for start, end in _chunks(part.size):
            piece = torch.empty(end - start, dtype=flat.dtype, device=flat.device)
            flat.copy_out(Range(part.start + start, part.start + end), piece)
            master[start:end].copy_(piece)

    def write_partition(self, master: torch.Tensor) -> None:
        """Copy ``master`` into this rank's slice of the working flat buffer (no collective)."""
        part = self.partition
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

    def write(self, master: torch.Tensor) -> None:
        """Write this rank's partition, then all-gather every rank's (collective over ``group``)."""
        self.write_partition(master)
        self.after_publish()

    def publish(self, start: int, piece: torch.Tensor) -> None:
        """Copy ``piece`` (master coordinates ``[start, start + len)``, working dtype) into this rank's slice of the
        flat buffer, without blocking from page-locked memory ([Note: overlapped host step])."""
        part = self.partition
        self.flat.copy_in(Range(part.start + start, part.start + start + piece.numel()), piece, non_blocking=True)

    def after_publish(self) -> None:
        """Every piece is published: all-gather every rank's partition (collective over ``group``)."""
        all_gather_partitions(self.flat, self.window_numel, self.group)


class ScatterWriteBack:
    """ZeRO-3 write-back: the master is the concatenation of several parameters' shards, and each shard gets its
    slice back.

    A host master is converted to the working dtype ``chunk_numel`` elements at a time, a whole group in one
    pipeline (:func:`send_through_host`: the next piece converts while the last one copies), so it never sends
    fp32 bytes nor allocates a model-sized (or per-chunk) temporary.
    """

    def __init__(self, states: Sequence[ShardOwner], chunk_numel: int) -> None:
        self.states = list(states)  # the shard tensors are read at each use: an owner may replace its shard
        self.chunk_numel = chunk_numel
        self.offsets: list[int] = []
        total = 0
        for state in self.states:
            self.offsets.append(total)
            total += state.layout.partition_numel
        self.numel = total

    @property
    def shards(self) -> list[torch.Tensor]:
        """The owners' current shard tensors, in master order."""
        return [state.shard for state in self.states]

    def copied(self, master: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """``(shard, offset)`` of every shard that is a copy of its slice of ``master``, not a view of it.

        A shard that is its master slice ([Note: zero3-master]) is updated by the step itself: reading or writing
        it would copy a tensor onto itself.
        """
        return [
            (shard, off) for shard, off in zip(self.shards, self.offsets, strict=True) if not _views(shard, master, off)
        ]

    @property
    def swapped(self) -> bool:
        """True when some shard lives in a swap file (read and written through ``open_shard``)."""
        return any(getattr(state, "swapped", False) for state in self.states)

    def read(self, master: torch.Tensor) -> None:
        """Every copied shard's values into its slice of ``master``."""
        if self.swapped:
            for state, off in zip(self.states, self.offsets, strict=True):
                with open_shard_of(state, ShardAccess.READ) as shard:
                    if not _views(shard, master, off):
                        master[off : off + shard.numel()].copy_(shard.reshape(-1))
            return
        for shard, off in self.copied(master):
            master[off : off + shard.numel()].copy_(shard.reshape(-1))

    def write(self, master: torch.Tensor) -> None:
        """Every slice of ``master`` into its copied shard, converted to the shard's dtype."""
        if self.swapped:
            # One swapped partition at a time: each is taken into a swap buffer, overwritten, written back.
            for state, off in zip(self.states, self.offsets, strict=True):
                with open_shard_of(state, ShardAccess.OVERWRITE) as shard:
                    if not _views(shard, master, off):
                        shard.reshape(-1).copy_(master[off : off + shard.numel()])
            return
        pairs = self.copied(master)
        if not pairs:
            return
        shards = [shard for shard, _ in pairs]
        kinds = {(s.dtype, s.device) for s in shards}
        if len(kinds) > 1 or master.device == shards[0].device or len(pairs) < len(self.states):
            for shard, off in pairs:  # same device: converts in place
                dst = shard.reshape(-1)
                src = master[off : off + dst.numel()]
                if src.device == dst.device:
                    dst.copy_(src)
                else:
                    send_through_host(src, dst.dtype, dst.device, self.chunk_numel, writer_into(dst))
            return
        ((dtype, target),) = kinds
        send_through_host(master, dtype, target, self.chunk_numel, self.scatter)

    def publish(self, start: int, piece: torch.Tensor) -> None:
        """Copy ``piece`` (master coordinates, working dtype) into the shards it overlaps ([Note: overlapped host
        step]); an offloaded master has no shard that is a view of it."""
        self.scatter(start, piece)

    def after_publish(self) -> None:
        """Every piece is published; nothing is left to do for shards."""

    def scatter(self, start: int, piece: torch.Tensor) -> None:
        """Copy ``piece`` (master coordinates ``[start, start + len)``) into the shards it overlaps."""
        end = start + piece.numel()
        first = max(0, bisect.bisect_right(self.offsets, start) - 1)
        for state, off in zip(self.states[first:], self.offsets[first:], strict=True):
            if off >= end:
                break
            lo, hi = max(start, off), min(end, off + state.layout.partition_numel)
            if lo < hi:
                whole = lo == off and hi == off + state.layout.partition_numel
                with open_shard_of(state, ShardAccess.OVERWRITE if whole else ShardAccess.UPDATE) as shard:
                    dst = shard.reshape(-1)
                    dst[lo - off : hi - off].copy_(
                        piece[lo - start : hi - start], non_blocking=not state_swapped(state)
                    )


def state_swapped(state: Any) -> bool:
    """True for a parameter state whose shard lives in a swap file."""
    return bool(getattr(state, "swapped", False))


def open_shard_of(state: Any, access: ShardAccess) -> AbstractContextManager[torch.Tensor]:
    """``state``'s shard in memory for a block (a swapped one is read in and, unless ``READ``, written back)."""
    if state_swapped(state):
        return state.open_shard(access)
    return nullcontext(state.shard)


def _views(shard: torch.Tensor, master: torch.Tensor, offset: int) -> bool:
    """True when ``shard`` is ``master``'s slice at ``offset`` itself (same storage, same first element)."""
    if shard.device != master.device or shard.dtype != master.dtype:
        return False
    if shard.untyped_storage().data_ptr() != master.untyped_storage().data_ptr():
        return False
    return shard.numel() == 0 or shard.data_ptr() == master[offset:].data_ptr()


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


def writer_into(dst: torch.Tensor) -> Callable[[int, torch.Tensor], None]:
    """A :func:`send_through_host` ``write`` that copies each piece into ``dst`` at its offset."""

    def write(start: int, piece: torch.Tensor) -> None:
        dst[start : start + piece.numel()].copy_(piece, non_blocking=True)

    return write


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
        gather_rows(gathered, mine, group)
        for r in range(world):
            if r == rank:
                continue
            flat.copy_in(window.shift(layout.partition(r).start), gathered[r * window.size : (r + 1) * window.size])
