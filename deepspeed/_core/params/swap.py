"""ZeRO-3 parameter partitions on NVMe (``offload_param.device: "nvme"``).

[Note: nvme params] Each rank's 16-bit partitions live in swap files, one per parameter, under
``<nvme_path>/zero_stage_3/<dtype>params/rank<global rank>/<ds_id>_param.tensor.swp`` (upstream's layout; the
folder is emptied when the first engine of the process uses it). While a partition is on disk its
``ZeroParam.shard`` is a one-element NaN expanded to the partition's size: numel, dtype and device stay right,
anything that reads it by mistake sees NaN and any in-place write fails. A partition enters host memory only
into one of ``buffer_count`` page-locked buffers of ``buffer_size`` elements:

* a gather reads the partitions it needs into free buffers (waiting for reads already in flight), issues its
  collective, and gives the buffers back once the copy-out has read them;
* after each prefetch decision the manager asks for the partitions of the units the trace says come next
  (:meth:`ParamSwapper.read_ahead`): their reads start into the free buffers and run while the current module
  computes; a later gather finds them done. Read-ahead never takes a buffer that is in use;
* a gather that finds no free buffer takes one read ahead for a later unit (waiting for its read), or else
  completes the earliest in-flight gather holding one (its copy-out frees it). A unit with more swapped
  partitions than buffers is gathered in several collectives (the same split on every rank: it depends only on
  the partition sizes);
* anyone writing a partition (the optimizer's write-back, a ``GatheredParameters`` modifier, a checkpoint load)
  opens it through ``ZeroParam.open_shard``: read into a buffer, changed, written back synchronously.

Some partitions are never swapped and stay ordinary host shards (page-locked with ``offload_param.pin_memory``):

* a partition of fewer than ``max(1 MiB, aio.block_size)`` bytes (upstream's rule): reading many small files
  (norms, biases) with asynchronous I/O costs more than the host memory they take;
* a non-floating partition;
* the first of the remaining partitions, up to ``max_in_cpu`` elements in all. Only partitions that would
  otherwise be swapped count toward ``max_in_cpu`` (upstream does not count the small ones either), so a model
  of many norms and biases does not use up the budget meant for its large weights.

Host memory for parameters is therefore at most ``buffer_count`` buffers, plus ``max_in_cpu`` elements, plus the
small and non-floating partitions; ``resident_bytes`` counts every partition kept. Before every read the file is
checked to exist with its size, so a file removed or truncated between steps stops training with its name;
nothing is ever read as zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepspeed._core.comm.page_locked import locked_empty
from deepspeed._core.config.plan import AioPolicy, ParamOffloadPolicy
from deepspeed._core.layout import swap_file
from deepspeed._core.layout.flat_buffer import free_storage
from deepspeed._core.params.param import FullStorage, ShardAccess, ShardedState, ZeroParam
from deepspeed._foundation.logging import logger
from deepspeed.accelerator import get_accelerator

KEY = "zero_optimization.offload_param"
MIN_AIO_BYTES = 1024**2
"""Partitions smaller than this many bytes (or than ``aio.block_size``, if larger) are never swapped."""
_EMPTIED: set[Path] = set()
"""Folders this process has emptied: an earlier run's files go, but a second engine of this process (a reference
model with the same config) keeps the first one's files (``ds_id`` s are unique per process, so names never clash)."""


def swap_folder(nvme_path: str, dtype: torch.dtype, global_rank: int) -> Path:
    """This rank's folder for partitions of ``dtype`` under ``nvme_path`` (upstream's layout)."""
    name = str(dtype).removeprefix("torch.")
    return Path(nvme_path) / "zero_stage_3" / f"{name}params" / f"rank{global_rank}"


def _placeholder(numel: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((1,), float("nan"), dtype=dtype).expand(numel)
    out.ds_numel = numel  # type: ignore[attr-defined]  # upstream readers: ds_tensor.ds_numel
    return out


@dataclass
class SwapStats:
    """What the swapper did (tests and logs)."""

    reads: int = 0  # partitions read from disk
    read_ahead: int = 0  # of those, started by read-ahead
    read_ahead_used: int = 0  # read-ahead partitions a gather found already in a buffer
    writes: int = 0
    overlapped_writes: int = 0  # writes started while another was still in flight
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass(eq=False)
class _Slot:
    """One page-locked buffer and the I/O handle that fills it."""

    handle: Any
    buffer: torch.Tensor | None = None  # uint8, allocated at first use
    owner: _Entry | None = None
    inflight: bool = False  # a read or write of the buffer is queued on the handle
    wrote: _Entry | None = None  # the partition whose write may still be in flight from this buffer
    guard: Any = None  # event after the last copy that read the buffer; synchronized before it is refilled


@dataclass(eq=False)
class _Entry:
    """One swapped partition."""

    state: ZeroParam
    path: Path
    numel: int
    dtype: torch.dtype
    placeholder: torch.Tensor
    slot: _Slot | None = None
    loaded: bool = False  # the slot holds (or is reading) the file's values
    ahead: bool = False  # loaded by read-ahead and not used yet
    busy: int = 0  # uses holding the slot: a gather until its copy-out, an open block
    write_slot: _Slot | None = None  # the buffer its last write may still be in flight from

    @property
    def nbytes(self) -> int:
        return self.numel * self.placeholder.element_size()


def _settle(slot: _Slot) -> None:
    """Wait for the buffer's I/O in flight and for the last device copy that read it."""
    if slot.inflight:
        slot.handle.wait()
        slot.inflight = False
    if slot.wrote is not None:
        slot.wrote.write_slot = None
        slot.wrote = None
    if slot.guard is not None:
        slot.guard.synchronize()
        slot.guard = None


class ParamSwapper:
    """This rank's swapped partitions and the buffer pool they are read into ([Note: nvme params]).

    Args:
        policy: the ``offload_param`` block (``nvme_path``, ``buffer_count``, ``buffer_size``, ``max_in_cpu``).
        aio: the ``aio`` block (the I/O handles' settings).
        rank: global rank (the folder name).
        finish: completes the in-flight gather of a state (which gives its buffers back).
    """

    def __init__(
        self, policy: ParamOffloadPolicy, aio: AioPolicy, rank: int, finish: Callable[[ZeroParam], None]
    ) -> None:
        if policy.nvme_path is None:
            raise ValueError(f"{KEY}.nvme_path is required with device 'nvme'")
        self.policy, self.aio, self.rank, self.finish = policy, aio, rank, finish
        self.capacity = max(1, policy.buffer_count)
        self._op = swap_file.aio_module()
        self._io = swap_file.open_handle(self._op, aio)  # synchronous writes
        self.slots = [_Slot(swap_file.open_handle(self._op, aio)) for _ in range(self.capacity)]
        self.entries: dict[int, _Entry] = {}
        self.decided: set[int] = set()
        self.min_swap_bytes = max(MIN_AIO_BYTES, aio.block_size)
        self.resident_numel = 0  # every partition kept in host memory
        self.resident_bytes = 0
        self.max_in_cpu_used = 0  # elements kept only because they fit max_in_cpu
        self.widest = 0  # bytes of the largest swapped partition: the buffers' size
        self.folders: dict[torch.dtype, Path] = {}
        self.stats = SwapStats()

    # ---------------------------------------------------------------- which partitions are swapped
    def _exempt(self, numel: int, dtype: torch.dtype) -> bool:
        """Kept in host memory whatever ``max_in_cpu`` says: non-floating, or too small to read well with async I/O."""
        return not dtype.is_floating_point or numel * dtype.itemsize < self.min_swap_bytes

    def _fits_max_in_cpu(self, used: int, numel: int) -> bool:
        """Whether a partition that is not exempt stays on the host, ``used`` elements of ``max_in_cpu`` being
        taken already."""
        return used + numel <= self.policy.max_in_cpu

    def check_partitions(self, partitions: Iterable[tuple[int, torch.dtype]]) -> None:
        """Raise before anything is partitioned if a partition to swap is larger than ``buffer_size``."""
        used, too_large = self.max_in_cpu_used, []
        for numel, dtype in partitions:
            if self._exempt(numel, dtype):
                continue
            if self._fits_max_in_cpu(used, numel):
                used += numel
            elif numel > self.policy.buffer_size:
                too_large.append(numel)
        if too_large:
            raise ValueError(
                f"{KEY}.buffer_size={self.policy.buffer_size} elements is smaller than {len(too_large)} parameter "
                f"partition(s) to swap to NVMe (the largest has {max(too_large)} elements); valid: a buffer_size of at "
                f"least {max(too_large)}, or a max_in_cpu large enough to keep those partitions in host memory"
            )

    def adopt(self, state: ZeroParam) -> None:
        """Swap ``state``'s (just written) shard out to its file, or keep it in host memory: a small or
        non-floating partition, or one within ``max_in_cpu`` ([Note: nvme params])."""
        if state.ds_id in self.decided:
            return
        self.decided.add(state.ds_id)
        shard = state.shard
        numel, dtype = shard.numel(), shard.dtype
        movable = state.state is ShardedState.SHARDED and not state.shard_is_master and not state.holds_gradient
        if not movable or self._exempt(numel, dtype):
            self._keep(state)
            return
        if self._fits_max_in_cpu(self.max_in_cpu_used, numel):
            self.max_in_cpu_used += numel
            self._keep(state)
            return
        self.check_partitions([(numel, dtype)])
        entry = _Entry(
            state, self._folder(dtype) / f"{state.ds_id}_param.tensor.swp", numel, dtype, _placeholder(numel, dtype)
        )
        swap_file.allocate_file(entry.path, entry.nbytes, f"{KEY}.nvme_path")
        self._io.sync_pwrite(shard.detach().contiguous(), str(entry.path))
        self.stats.writes += 1
        self.stats.bytes_written += entry.nbytes
        if state.aliases_shard:  # the gathered tensor was the shard: it needs storage of its own now
            state.storage = FullStorage.SEPARATE
            state.full = torch.empty(state.layout.padded_numel, dtype=dtype, device=shard.device)
            free_storage(state.full)
        state.shard = entry.placeholder
        state.swap = self
        self.entries[state.ds_id] = entry
        self.widest = max(self.widest, entry.nbytes)

    def _keep(self, state: ZeroParam) -> None:
        shard = state.shard
        self.resident_numel += shard.numel()
        self.resident_bytes += shard.numel() * shard.element_size()
        if self.policy.pin_memory and state.full.device.type != "cpu" and shard.device.type == "cpu":
            pinned = locked_empty(shard.numel(), shard.dtype).copy_(shard)  # [Note: exact page-locking]
            pinned.ds_numel = shard.numel()  # type: ignore[attr-defined]
            state.shard = pinned

    def _folder(self, dtype: torch.dtype) -> Path:
        folder = self.folders.get(dtype)
        if folder is None:
            folder = swap_folder(str(self.policy.nvme_path), dtype, self.rank)
            if folder.resolve() not in _EMPTIED:
                swap_file.fresh_folder(folder)
                _EMPTIED.add(folder.resolve())
            folder.mkdir(parents=True, exist_ok=True)
            self.folders[dtype] = folder
        return folder

    # ---------------------------------------------------------------- buffers
    def pool_bytes(self) -> int:
        """Bytes of the page-locked buffers allocated now."""
        return sum(s.buffer.numel() for s in self.slots if s.buffer is not None)

    def host_bytes(self) -> int:
        """Host memory holding parameter partitions: the buffers plus every partition kept resident (small,
        non-floating and within ``max_in_cpu``)."""
        return self.pool_bytes() + self.resident_bytes

    def _view(self, entry: _Entry) -> torch.Tensor:
        slot = entry.slot
        assert slot is not None and slot.buffer is not None
        view = slot.buffer[: entry.nbytes].view(entry.dtype)
        view.ds_numel = entry.numel  # type: ignore[attr-defined]  # upstream readers: ds_tensor.ds_numel
        return view

    def _claim(self, slot: _Slot, entry: _Entry) -> None:
        _settle(slot)
        if slot.buffer is None or slot.buffer.numel() < entry.nbytes:
            if slot.buffer is not None:
                slot.handle.free_cpu_locked_tensor(slot.buffer)
            slot.buffer = slot.handle.new_cpu_locked_tensor(self.widest, torch.empty(0, dtype=torch.uint8))
        slot.owner, entry.slot, entry.loaded, entry.ahead = entry, slot, False, False

    def _free(self, idle_only: bool = False) -> _Slot | None:
        """A buffer nobody holds; with ``idle_only`` only one no copy on the device still reads (read-ahead must
        not make the host wait for the device)."""
        free = [s for s in self.slots if s.owner is None]
        if idle_only:
            free = [s for s in free if s.guard is None or s.guard.query()]
        # A buffer with no I/O in flight first: taking one still writing makes the host wait for the disk.
        return min(free, key=lambda s: s.inflight, default=None)

    def _acquire(self, entry: _Entry, protect: set[int]) -> None:
        if entry.slot is not None:
            return
        slot = self._free() or self._evict(protect)
        self._claim(slot, entry)

    def _evict(self, protect: set[int]) -> _Slot:
        for slot in self.slots:  # a partition read ahead for a later unit
            owner = slot.owner
            if owner is not None and owner.busy == 0 and owner.state.ds_id not in protect:
                self._drop(owner)
                return slot
        for slot in self.slots:  # the earliest in-flight gather: its copy-out frees its buffers
            owner = slot.owner
            if owner is not None and owner.state.state is ShardedState.GATHERING:
                self.finish(owner.state)
                if slot.owner is None:
                    return slot
        raise RuntimeError(
            f"all {self.capacity} {KEY}.buffer_count buffers are in use by partitions that cannot be released now; "
            "raise buffer_count"
        )

    def _drop(self, entry: _Entry) -> None:
        slot = entry.slot
        assert slot is not None and entry.busy == 0
        # I/O still in flight (a read ahead, a write back) is waited for by the buffer's next user (_claim).
        slot.owner, entry.slot, entry.loaded, entry.ahead = None, None, False, False
        entry.state.shard = entry.placeholder

    def _start_read(self, entry: _Entry) -> None:
        if entry.write_slot is not None:
            _settle(entry.write_slot)  # its last write lands before the file is read
        swap_file.check_file(entry.path, entry.nbytes, f"parameter partition (ds_id {entry.state.ds_id})")
        slot = entry.slot
        assert slot is not None and slot.buffer is not None
        slot.handle.async_pread(slot.buffer[: entry.nbytes], str(entry.path), 0)
        slot.inflight, entry.loaded = True, True
        self.stats.reads += 1
        self.stats.bytes_read += entry.nbytes

    # ---------------------------------------------------------------- gathers
    def swap_in(self, states: list[ZeroParam]) -> None:
        """Put every (swapped) state's partition in a buffer and point its shard there, until :meth:`release`."""
        protect = {s.ds_id for s in states}
        entries = [self.entries[s.ds_id] for s in states]
        for entry in entries:
            self._acquire(entry, protect)
            if not entry.loaded:
                self._start_read(entry)
            elif entry.ahead:
                self.stats.read_ahead_used += 1
            entry.ahead = False
            entry.busy += 1
        for entry in entries:
            slot = entry.slot
            assert slot is not None
            _settle(slot)
            entry.state.shard = self._view(entry)

    def release(self, states: list[ZeroParam], guard: Any = None) -> None:
        """The gather that needed ``states`` has read them (``guard``: the event after that copy)."""
        for state in states:
            entry = self.entries[state.ds_id]
            entry.busy -= 1
            if entry.busy == 0:
                slot = entry.slot
                assert slot is not None
                slot.guard = guard
                slot.owner, entry.slot, entry.loaded = None, None, False
                state.shard = entry.placeholder

    def in_buffer(self, state: ZeroParam) -> bool:
        """True when ``state``'s partition is in a buffer (or its read into one is in flight)."""
        entry = self.entries.get(state.ds_id)
        return entry is not None and entry.slot is not None and entry.loaded

    def read_ahead(self, states: Iterator[ZeroParam]) -> int:
        """Start reading the partitions of ``states`` (in the order they will be gathered) into free buffers; stop
        at the first that finds none. Returns how many reads started."""
        started = 0
        for state in states:
            entry = self.entries.get(state.ds_id)
            if entry is None or entry.slot is not None:
                continue
            slot = self._free(idle_only=True)
            if slot is None:
                break
            self._claim(slot, entry)
            self._start_read(entry)
            entry.ahead = True
            self.stats.read_ahead += 1
            started += 1
        return started

    # ---------------------------------------------------------------- other users
    @contextmanager
    def open(self, state: ZeroParam, access: ShardAccess) -> Iterator[torch.Tensor]:
        """``state``'s partition in a buffer for the block; written back to its file after unless ``READ``."""
        if state.state is ShardedState.GATHERING:
            self.finish(state)  # its gather holds a buffer with these values; let it complete first
        entry = self.entries[state.ds_id]
        self._acquire(entry, {state.ds_id})
        if access is not ShardAccess.OVERWRITE and not entry.loaded:
            self._start_read(entry)
        entry.ahead = False
        entry.busy += 1
        slot = entry.slot
        assert slot is not None
        _settle(slot)
        view = self._view(entry)
        state.shard = view
        ok = False
        try:
            yield view
            ok = True
        finally:
            if ok and access is not ShardAccess.READ:
                self._write_back(entry, slot)
            elif not ok and access is not ShardAccess.READ:
                entry.loaded = False  # half-written: the buffer no longer holds the file's values
            entry.busy -= 1
            if entry.busy == 0:
                self._drop(entry)

    def _write_back(self, entry: _Entry, slot: _Slot) -> None:
        """Start writing ``slot``'s values to ``entry``'s file; the buffer's next user waits for it, and so does
        the next read of the file."""
        if entry.state.full.device.type != "cpu":
            get_accelerator().synchronize()  # copies into the buffer may be non-blocking
        if entry.write_slot is not None and entry.write_slot is not slot:
            _settle(entry.write_slot)  # an earlier write of this partition lands first
        if any(s.inflight and s.wrote is not None for s in self.slots):
            self.stats.overlapped_writes += 1
        swap_file.allocate_file(entry.path, entry.nbytes, f"{KEY}.nvme_path")
        assert slot.buffer is not None
        slot.handle.async_pwrite(slot.buffer[: entry.nbytes], str(entry.path), 0)
        slot.inflight, slot.wrote, entry.write_slot = True, entry, slot
        self.stats.writes += 1
        self.stats.bytes_written += entry.nbytes

    def close(self) -> None:
        """Wait for reads in flight, free the buffers and remove this rank's swap files."""
        for slot in self.slots:
            _settle(slot)
            if slot.buffer is not None:
                slot.handle.free_cpu_locked_tensor(slot.buffer)
                slot.buffer = None
            slot.owner = None
        for entry in self.entries.values():
            entry.path.unlink(missing_ok=True)
            entry.slot = None
        logger.debug(f"NVMe parameter swap closed: {self.stats}")
