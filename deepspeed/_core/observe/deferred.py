"""Monitor values read without waiting for the device: the scalars of one optimizer step are queued with the device
work that produces them, and written to the monitors once that work is known to be done.

A step's device scalars (the loss) are stacked into one tensor and copied with ``non_blocking=True`` into a small
host buffer (page-locked when the values live on an accelerator), reused from step to step, and an event is recorded
after the copy. Phase timers hand over a :class:`~deepspeed._core.observe.timers.TimerReading` whose end events play
the same part. A queued record is *ready* once its events report done (``Event.query()``); the queue writes ready
records in the order they were queued, so the monitors see the same scalars, tags and x-axis values, in the same
order, as if each had been read at once, only later. Nothing here blocks the training thread, except
:meth:`PendingQueue.drain` with ``wait`` (at shutdown, or when more than :attr:`PendingQueue.max_pending` records wait,
which bounds the memory held) and reading a record that is not ready.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from deepspeed._core.observe.monitors import Event as ScalarEvent
from deepspeed._core.observe.timers import TimerReading
from deepspeed.accelerator import get_accelerator


class _Slot:
    """Stands for the ``index``-th device scalar of a record until it is read."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class HostSlots:
    """Host buffers (with their events) that the step scalars are copied into, handed out again once read."""

    def __init__(self) -> None:
        self.free: list[tuple[torch.Tensor, Any]] = []

    def get(self, n: int, source: torch.device) -> tuple[torch.Tensor, Any]:
        """A float32 host buffer of at least ``n`` values fit for a copy from ``source``, and an event."""
        pinned = source.type != "cpu"
        for i, (buf, _) in enumerate(self.free):
            if buf.numel() >= n and buf.is_pinned() == pinned:
                return self.free.pop(i)
        return torch.empty(max(n, 8), dtype=torch.float32, pin_memory=pinned), get_accelerator().Event()

    def put(self, buf: torch.Tensor, event: Any) -> None:
        """Hand a buffer back (its values have been read)."""
        if len(self.free) < 8:
            self.free.append((buf, event))


class PendingScalars:
    """Device scalars on their way to host memory.

    Args:
        values: 0-dim tensors on one device (each already the value to write, e.g. a mean).
        slots: the buffer pool.
    """

    def __init__(self, values: list[torch.Tensor], slots: HostSlots) -> None:
        self.n = len(values)
        self.slots = slots
        stacked = torch.stack([v.detach().float().reshape(()) for v in values])
        self.event: Any = None
        if get_accelerator().is_synchronized_device():
            self.host = stacked  # already computed: host memory, or a device that runs in step with the host
            return
        self.host, self.event = slots.get(self.n, stacked.device)
        self.host[: self.n].copy_(stacked, non_blocking=True)
        self.event.record()

    def ready(self) -> bool:
        """Whether the copy has landed (reading then does not wait)."""
        return self.event is None or bool(self.event.query())

    def values(self) -> list[float]:
        """The scalars as Python floats (waits for the copy only if not :meth:`ready`)."""
        if not self.ready():
            self.event.synchronize()
        out = self.host[: self.n].tolist()
        if self.event is not None:
            self.slots.put(self.host, self.event)
            self.event = None
        return out


class PendingRecord:
    """One batch of monitor events whose values may still be on the device.

    Args:
        events: ``(tag, value, step)``; a value may be a 0-dim tensor (copied now, read later).
        slots: the host buffer pool.
        timers: a timer reading whose milliseconds become events ``(timer_tags[name], ms, timer_step)``.
    """

    def __init__(
        self,
        events: list[ScalarEvent],
        slots: HostSlots,
        timers: TimerReading | None = None,
        timer_tags: dict[str, str] | None = None,
        timer_step: int = 0,
    ) -> None:
        tensors: list[torch.Tensor] = []
        self.events: list[tuple[str, Any, int]] = []
        for tag, value, step in events:
            if isinstance(value, torch.Tensor):
                self.events.append((tag, _Slot(len(tensors)), step))
                tensors.append(value)
            else:
                self.events.append((tag, value, step))
        self.scalars = PendingScalars(tensors, slots) if tensors else None
        self.timers, self.timer_tags, self.timer_step = timers, timer_tags or {}, timer_step

    def ready(self) -> bool:
        """Whether every value can be read without waiting."""
        return (self.scalars is None or self.scalars.ready()) and (self.timers is None or self.timers.ready())

    def materialize(self) -> list[ScalarEvent]:
        """The events with Python numbers in place of device values."""
        read = self.scalars.values() if self.scalars is not None else []
        out = [(tag, read[v.index] if isinstance(v, _Slot) else v, step) for tag, v, step in self.events]
        if self.timers is not None:
            for name, ms in self.timers.values().items():
                out.append((self.timer_tags[name], ms, self.timer_step))
        return out


class PendingQueue:
    """Records waiting for the device, written in order by ``write`` once ready.

    Args:
        write: called with each record's events, oldest first.
        max_pending: records beyond which :meth:`push` waits for the oldest.
    """

    def __init__(self, write: Callable[[list[ScalarEvent]], None], max_pending: int = 16) -> None:
        self.write = write
        self.max_pending = max_pending
        self.records: deque[PendingRecord] = deque()

    def push(self, record: PendingRecord) -> None:
        """Queue ``record`` and write whatever is ready."""
        self.records.append(record)
        self.drain(wait=len(self.records) > self.max_pending)

    def drain(self, wait: bool = False, everything: bool = False) -> None:
        """Write the ready records, oldest first; ``wait``: the oldest one even if not ready; ``everything``: all."""
        while self.records and (everything or wait or self.records[0].ready()):
            events = self.records.popleft().materialize()
            wait = False
            if events:
                self.write(events)

    def __len__(self) -> int:
        return len(self.records)
