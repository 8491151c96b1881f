"""Asynchronous device-to-host gradient transfers for optimizer offload, through a bounded pinned ring.

A reduced gradient slice is copied into a page-locked staging slot without blocking the device stream;
an event recorded after the copy travels with the slot. The host-side fold into the partition gradient
waits on that event only when the slot is needed again or at :meth:`HostTransfers.drain`, so copies
overlap the rest of the backward while the pinned memory stays bounded: ``slots × slot_bytes``, whatever
the model size.

[Note: pinned ring] Why a fixed ring rather than one pinned tensor per slice: PyTorch's caching host
allocator keeps every pinned block it ever handed out and rounds each request up to a power of two, so
staging one pinned tensor per reduced slice grows host memory with the gradient's size (up to twice
it) and never returns it. Slots here are allocated once, at a power-of-two size, and reused.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.comm.streams import record_current
from deepspeed.accelerator import get_accelerator

DEFAULT_SLOT_BYTES = 1 << 26  # 64 MiB: large enough to run copies at full PCIe speed
DEFAULT_SLOTS = 4


class Staging(enum.Enum):
    """``DEVICE_ONLY``: host-resident pieces fold at once (nothing to overlap); ``ALWAYS``: every piece goes
    through the ring (tests exercise the ring's ordering and bounds on a CPU-only machine this way)."""

    DEVICE_ONLY = "device_only"
    ALWAYS = "always"


class Fold(enum.Enum):
    """How a transferred slice lands in its host target."""

    ADD = "add"
    COPY = "copy"


@dataclass
class _InFlight:
    target: torch.Tensor
    staged: torch.Tensor | None  # view of a pinned slot holding the copied values; None: copied into target
    slot: int | None
    ready: Any  # accelerator event recorded after the copy was issued
    fold: Fold


def slot_bytes_for(bucket_bytes: int, cap: int = DEFAULT_SLOT_BYTES) -> int:
    """Power-of-two slot size that fits one ``bucket_bytes`` transfer, at most ``cap`` (larger ones split)."""
    size = 1 << max(12, (max(1, bucket_bytes) - 1).bit_length())
    return min(size, cap)


def _fold(target: torch.Tensor, values: torch.Tensor, fold: Fold) -> None:
    if fold is Fold.ADD:
        target.add_(values.to(target.dtype))
    else:
        target.copy_(values)


class HostTransfers:
    """Device→host copies folded into host tensors, staged through ``slots`` pinned slots of ``slot_bytes``.

    Args:
        slot_bytes: bytes per pinned slot (rounded up to a power of two; slices larger than a slot are split).
        slots: number of slots; at most this many copies are in flight at once.
        staging: which pieces go through the ring (see :class:`Staging`).
    """

    def __init__(
        self, slot_bytes: int = DEFAULT_SLOT_BYTES, slots: int = DEFAULT_SLOTS, staging: Staging = Staging.DEVICE_ONLY
    ) -> None:
        self.slot_bytes = slot_bytes_for(slot_bytes, cap=max(slot_bytes, 4096))
        self.num_slots = max(1, slots)
        self.staging = staging
        self._pin = get_accelerator().device_name() != "cpu"
        self.pending: deque[_InFlight] = deque()
        self._ring: list[torch.Tensor] = []  # allocated on first use: runs without offload never pin anything
        self._free: deque[int] = deque()

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes this object holds (0 until the first device-side submit)."""
        return sum(t.numel() for t in self._ring)

    def submit(self, target: torch.Tensor, piece: torch.Tensor, fold: Fold) -> None:
        """Start copying ``piece`` towards host ``target`` (same numel); folded by :meth:`drain` at the latest."""
        if piece.device.type == "cpu" and self.staging is Staging.DEVICE_ONLY:  # nothing to overlap
            _fold(target, piece, fold)
            return
        flat_target, flat_piece = target.view(-1), piece.reshape(-1)
        step = max(1, self.slot_bytes // piece.element_size())
        for start in range(0, flat_piece.numel(), step):
            end = min(start + step, flat_piece.numel())
            self._submit_part(flat_target[start:end], flat_piece[start:end], fold)

    def submit_direct(self, target: torch.Tensor, piece: torch.Tensor) -> None:
        """Copy ``piece`` straight into the page-locked host ``target`` (same dtype and numel), no slot needed.

        For a first write into pinned storage there is nothing to fold, so the ring's staging copy and the
        host-side pass are both skipped; the copy is still ordered with the others and waited for by
        :meth:`drain`.
        """
        if piece.device.type == "cpu" and self.staging is Staging.DEVICE_ONLY:
            target.view(-1).copy_(piece.reshape(-1))
            return
        target.view(-1).copy_(piece.reshape(-1), non_blocking=True)
        event = record_current()
        self.pending.append(_InFlight(target, None, None, event, Fold.COPY))

    def _submit_part(self, target: torch.Tensor, piece: torch.Tensor, fold: Fold) -> None:
        slot = self._take_slot()
        staged = self._ring[slot][: piece.numel() * piece.element_size()].view(piece.dtype)
        staged.copy_(piece, non_blocking=True)
        event = record_current()
        self.pending.append(_InFlight(target, staged, slot, event, fold))

    def _take_slot(self) -> int:
        if not self._ring:
            for _ in range(self.num_slots):
                self._ring.append(torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self._pin))
            self._free.extend(range(self.num_slots))
        while not self._free:  # in submission order; direct copies ahead of the oldest slot free nothing
            self._complete_oldest()
        return self._free.popleft()

    def _complete_oldest(self) -> None:
        item = self.pending.popleft()
        item.ready.synchronize()
        if item.slot is not None:
            assert item.staged is not None  # a copy through a slot is staged in that slot
            _fold(item.target, item.staged, item.fold)
            self._free.append(item.slot)

    def drain(self) -> None:
        """Wait for every copy (in submission order) and fold it into its target."""
        while self.pending:
            self._complete_oldest()

    def discard(self) -> None:
        """Forget every in-flight copy without folding it (overflow), once its slot is safe to reuse."""
        while self.pending:
            item = self.pending.popleft()
            item.ready.synchronize()
            if item.slot is not None:
                self._free.append(item.slot)

    def release(self) -> None:
        """Discard what is in flight, then give the pinned slots back (e.g. when the optimizer is destroyed)."""
        self.discard()
        self._ring.clear()
        self._free.clear()
