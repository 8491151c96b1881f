"""Asynchronous device-to-host gradient transfers for optimizer offload, ordered by events.

A reduced gradient slice is copied into pinned host memory without blocking the device stream; an
event recorded after the copy travels with it, and the host-side fold into the fp32 partition gradient
waits on that event only when the fold happens (at the end of the backward), so the copies overlap the
rest of the backward instead of serialising it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed.accelerator import get_accelerator


class Fold(enum.Enum):
    """How a transferred slice lands in its host target."""

    ADD = "add"
    COPY = "copy"


@dataclass
class _InFlight:
    target: torch.Tensor
    host: torch.Tensor
    ready: Any  # accelerator event recorded after the copy was issued
    fold: Fold


class HostTransfers:
    """Queue of device→host copies whose results are folded into host tensors on :meth:`drain`."""

    def __init__(self) -> None:
        self.pending: list[_InFlight] = []
        self._pin = get_accelerator().device_name() != "cpu"

    def submit(self, target: torch.Tensor, piece: torch.Tensor, fold: Fold) -> None:
        """Start copying ``piece`` (device) towards ``target`` (host); folded at the next :meth:`drain`."""
        host = torch.empty(piece.shape, dtype=piece.dtype, device="cpu", pin_memory=self._pin)
        host.copy_(piece, non_blocking=self._pin)
        event = get_accelerator().Event()
        event.record()
        self.pending.append(_InFlight(target, host, event, fold))

    def drain(self) -> None:
        """Wait for each copy's event and fold it into its target (in submission order)."""
        for item in self.pending:
            item.ready.synchronize()
            if item.fold is Fold.ADD:
                item.target.add_(item.host.to(item.target.dtype))
            else:
                item.target.copy_(item.host)
        self.pending.clear()
