"""The overlapped host step of an offloaded optimizer: chunks stepped on the host while their copies go up.

[Note: overlapped host step] With ``offload_optimizer`` the update runs on the host, chunk by chunk
([Note: chunked step]), and the updated weights must then go up to the accelerator in the working dtype. Done one
after the other, the accelerator idles through the whole host update and then the host idles through the
transfers. Here the chunks are stepped in order, by one host worker thread while the backward still runs (below)
or else by the caller's thread ([Note: update after the decision]), and each stepped chunk is written, in the
working dtype, into one of two page-locked staging buffers ([Note: pinned pool]; with the host Adam in the step's own
pass, [Note: scaled step]); the caller's thread only issues each chunk's copy up, without blocking. A staging
buffer is refilled once an event says its last copy has left. The accelerator's copies of chunk ``k`` therefore
run while the host steps chunk ``k + 1``, and the two threads never do host-side element work at the same time
(both would draw on the same cores and memory bandwidth). An update started during the backward
([Note: early host step]) leaves the conversion to the caller's thread, which publishes only after the backward.
The worker's own device work, copying device-resident gradients down, goes on a side stream ordered by the
event recorded when each range is handed over ([Note: worker stream]), not between the backward's kernels.

Exactness: every chunk goes through :meth:`~deepspeed._core.optim.chunked_step.ChunkStepper.step_range`, the
same operations on the same values as the synchronous loop, and each chunk's conversion is elementwise, so the
result is bit-identical whatever the timing. Where clipping, the fp16 loss scale or the bf16 overflow check
needs every gradient before any chunk may change, the step starts once the global norm is known (the reduction
itself is one scalar) and the caller's thread steps the first chunk right after; where nothing does, a ZeRO-1/2 chunk
may be submitted during the backward, as soon as its own gradient is final ([Note: early host step]; at ZeRO-3,
[Note: final gradient count]).
Switch: ``zero_optimization.lean_overlap_offload_step``; ``false`` steps every chunk first and writes the weights
back afterwards (the synchronous order).

[Note: update after the decision] An update that starts only once the whole backward is over (after the global
norm, or at ZeRO-1/2 whenever nothing started during the backward) is stepped by the caller's thread itself
(:meth:`OverlappedHostStep.run`): it has nothing else to do until the update ends. Each chunk's kernel writes the
rounded copy into one of the two staging buffers, the copy up is issued without blocking, and the next chunk steps
while it runs: the same overlap as with the worker, without handing every chunk across threads (and the interpreter
with it), and with the kernel on the caller's pool of intra-op threads. The worker earns its keep only where the
caller's thread has other work: the backward, for an update that starts during it.

[Note: short switch interval] Each chunk's kernel runs without the GIL, and the worker needs it back after every
chunk (and at every tensor operation of the Python between them). While the training thread runs Python, as it
does through the backward's hooks and the publishing, the interpreter hands the GIL over only when the holder
releases it or every ``sys.getswitchinterval()`` seconds (5 ms by default). With a few hundred chunks per update,
the worker can wait up to that long per chunk, tenths of a second per step, and the training thread waits the same
way behind the worker's Python between chunks. So while an update has chunks on the worker the switch interval is
:data:`HANDOFF_SWITCH_INTERVAL_S`, and the previous value comes back once no update is in flight (a count across
engines in one process). Switch: ``zero_optimization.lean_short_switch_interval``; ``false`` leaves the
interval alone.
"""

from __future__ import annotations

import enum
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.comm.pinned_pool import PinnedPool, Pinning
from deepspeed._core.comm.streams import WorkerStream, record_current
from deepspeed._core.config.plan import RunPlan
from deepspeed._core.grads.convert import Coef
from deepspeed._core.optim.chunked_step import ChunkStepper
from deepspeed.accelerator import get_accelerator

Publish = Callable[[int, torch.Tensor], None]
"""``publish(start, piece)``: copy ``piece`` (working dtype, page-locked host memory; master coordinates
``[start, start + len)``) to where the working weights live, possibly without blocking."""


@dataclass
class GroupStep:
    """One group's share of an overlapped step: its open stepper, its gradient and where its weights go."""

    stepper: ChunkStepper
    grad: Any
    publish: Publish
    working_dtype: torch.dtype
    consume: bool = False  # as step_in_chunks' ``consume``


STAGING_BUFFERS = 4
"""Chunk-sized buffers an offloaded optimizer's pool may hold: the two staging buffers of the write-back and the
two gradient windows of ZeRO-3's parked gradients."""


HANDOFF_SWITCH_INTERVAL_S = 0.0005
"""The interpreter's switch interval while a host update is in flight ([Note: short switch interval])."""


class Handoff(enum.Enum):
    """How the worker gets the interpreter back between chunks: ``SHORT_SWITCH`` shortens the switch interval while
    an update is in flight ([Note: short switch interval]); ``DEFAULT`` leaves it alone."""

    SHORT_SWITCH = "short_switch"
    DEFAULT = "default"


class _SwitchInterval:
    """The process's switch interval, shortened while at least one holder is in (a count, so that two engines'
    updates in one process restore the value only once both are over)."""

    _lock = threading.Lock()
    _holders = 0
    _saved: float | None = None

    @classmethod
    def enter(cls) -> None:
        with cls._lock:
            if cls._holders == 0:
                cls._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(cls._saved, HANDOFF_SWITCH_INTERVAL_S))
            cls._holders += 1

    @classmethod
    def leave(cls) -> None:
        with cls._lock:
            cls._holders -= 1
            if cls._holders == 0 and cls._saved is not None:
                sys.setswitchinterval(cls._saved)
                cls._saved = None


def pool_for_step(chunk_numel: int, pinning: Pinning) -> PinnedPool:
    """The pinned pool of an optimizer stepping ``chunk_numel``-element chunks: :data:`STAGING_BUFFERS` buffers of
    one fp32 chunk at most, whatever the model size."""
    return PinnedPool(STAGING_BUFFERS * (1 << (max(1, chunk_numel * 4) - 1).bit_length()), pinning)


def pinning_of(plan: RunPlan) -> Pinning:
    """Page-locked staging unless ``offload_optimizer.pin_memory`` is false."""
    offload = plan.zero.offload_optimizer
    return Pinning.PAGEABLE if offload.enabled and not offload.pin_memory else Pinning.PAGE_LOCKED


class OverlappedHostStep:
    """Runs offloaded updates on one host worker thread and publishes each stepped chunk from the caller's thread.

    Args:
        pool: where the two staging buffers come from (bounded, reused across steps).
        handoff: whether the interpreter's switch interval is short while an update has chunks on the worker
            ([Note: short switch interval]).
    """

    def __init__(self, pool: PinnedPool, handoff: Handoff = Handoff.SHORT_SWITCH) -> None:
        self.pool = pool
        self.handoff = handoff
        self._worker: ThreadPoolExecutor | None = None
        self._open: set[StepRun] = set()  # updates begun and not yet over: shutdown() ends them
        self.device_work = WorkerStream()  # the worker's copies of device gradients ([Note: worker stream])
        self.chunks_published = 0  # for tests: chunks that took the overlapped route
        # For tests: called on the worker as ``log("host_step", group, start)`` right before a range steps.
        self.log: Callable[[str, int, int], None] | None = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._worker is None:
            device = get_accelerator().current_device()
            self._worker = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="ds-host-step",
                initializer=lambda: get_accelerator().set_device(device),  # its events on the rank's device
            )
        return self._worker

    def begin(self, groups: Sequence[GroupStep], coef: Coef, *, rounded_by_worker: bool = False) -> StepRun:
        """Open one update of ``groups``: ranges are then handed to the worker with :meth:`StepRun.submit` (as soon
        as their gradients are final, possibly while the backward still runs, [Note: early host step]) and
        published with :meth:`StepRun.publish`.

        ``rounded_by_worker``: the worker also writes each stepped range, in the working dtype, into the staging
        buffer its copy up leaves from ([Note: scaled step] does it in the step's own pass), so that the caller's
        thread only issues copies. For an update published right away: the worker waits for a staging buffer to
        be free, so it runs at most two ranges ahead of the publishing."""
        slots = []
        if rounded_by_worker:
            width = max((_widest_range(g) * _element_size(g.working_dtype) for g in groups), default=1)
            slots = [_Slot(self.pool.acquire(width, torch.uint8), threading.Event()) for _ in range(2)]
            for slot in slots:
                slot.free.set()
        run = StepRun(self, groups, coef, slots)
        self._open.add(run)
        return run

    def run(self, groups: Sequence[GroupStep], coef: Coef) -> None:
        """Step every group's chunks in order on the caller's thread; publish each as soon as it is stepped
        ([Note: update after the decision]).

        Returns once every copy up has completed. Each stepper is closed (its state back in the optimizer),
        also when a chunk raises.
        """
        self.begin(groups, coef, rounded_by_worker=True).step_here()

    def shutdown(self) -> None:
        """End any update still open and stop the worker thread (the engine is being destroyed)."""
        for run in list(self._open):
            run.abandon()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


@dataclass
class _Slot:
    """One staging buffer of an update whose worker rounds ranges into it: ``free`` is set while the worker may
    write into it, ``copied`` is the event of the last copy up out of it."""

    buffer: torch.Tensor
    free: threading.Event
    copied: Any = None


class StepRun:
    """One overlapped update in progress: ranges go to the worker in any order, each once, and are published in
    the order they were submitted. Made by :meth:`OverlappedHostStep.begin`."""

    def __init__(self, owner: OverlappedHostStep, groups: Sequence[GroupStep], coef: Coef, slots: list[_Slot]) -> None:
        """``slots``: the two staging buffers the worker rounds stepped ranges into (none: the caller rounds)."""
        self.owner, self.groups, self.coef = owner, list(groups), coef
        self.jobs: list[tuple[int, int, int, Future]] = []
        self.submitted: set[tuple[int, int]] = set()
        self.done = False
        self.slots = slots
        self._short_switch = False  # this update holds the short switch interval ([Note: short switch interval])

    def submit(self, group_index: int, start: int, end: int) -> None:
        """Hand range ``[start, end)`` (one of the stepper's ranges) of group ``group_index`` to the worker."""
        if (group_index, start) in self.submitted:
            return
        self.submitted.add((group_index, start))
        if self.owner.handoff is Handoff.SHORT_SWITCH and not self._short_switch:
            _SwitchInterval.enter()
            self._short_switch = True
        ready = self.owner.device_work.mark()  # the range's gradients are written on this thread's stream
        job = self.owner._executor().submit(self._step, group_index, start, end, len(self.jobs), ready)
        self.jobs.append((group_index, start, end, job))

    def _step(self, group_index: int, start: int, end: int, index: int, ready: Any) -> torch.Tensor | None:
        with self.owner.device_work.after(ready):  # [Note: worker stream]
            return self._step_range(group_index, start, end, index)

    def _step_range(self, group_index: int, start: int, end: int, index: int) -> torch.Tensor | None:
        if self.owner.log is not None:
            self.owner.log("host_step", group_index, start)
        group = self.groups[group_index]
        piece = None
        if self.slots and not self.done:
            slot = self.slots[index % 2]
            slot.free.wait()  # set again once the caller has issued the copy up of its previous range
            slot.free.clear()
            if slot.copied is not None:
                slot.copied.synchronize()  # that copy has left the buffer
                slot.copied = None
            if not self.done:  # abandoned while waiting: nothing will be published any more
                piece = _staging_view(slot.buffer, end - start, group.working_dtype)
        group.stepper.step_range(start, end, group.grad, self.coef, group.consume, copy_out=piece)
        return piece

    def submit_rest(self) -> None:
        """Submit every range not submitted yet, group by group, in order."""
        for index, group in enumerate(self.groups):
            for start, end in group.stepper.ranges():
                self.submit(index, start, end)

    def step_here(self) -> None:
        """Step every range in order on this thread, each rounded into a staging buffer and its copy up issued at
        once ([Note: update after the decision]); returns as :meth:`publish` does. Nothing may have been
        submitted."""
        assert not self.jobs and self.slots, "step_here: an update begun with rounded_by_worker and not submitted"
        try:
            index = 0
            for gi, group in enumerate(self.groups):
                for start, end in group.stepper.ranges():
                    piece = self._step(gi, start, end, index, self.owner.device_work.mark())
                    assert piece is not None  # the update has its staging buffers and is not abandoned
                    self._published(index, group, start, piece)
                    index += 1
                group.stepper.close()
        finally:
            self._end([], [None, None])

    def _published(self, index: int, group: GroupStep, start: int, rounded: torch.Tensor) -> None:
        """Issue the copy up of the range rounded into staging buffer ``index % 2``; the buffer may be refilled once
        that copy has left it."""
        group.publish(start, rounded)
        slot = self.slots[index % 2]
        slot.copied = record_current()
        slot.free.set()
        self.owner.chunks_published += 1

    def publish(self) -> None:
        """Wait for each submitted range in turn and publish it; returns once every copy up has completed and every
        stepper is closed (also when a chunk raises). Every range must have been submitted."""
        slots: list[torch.Tensor] = []
        in_flight: list[Any] = [None, None]
        left = [len(g.stepper.ranges()) for g in self.groups]
        try:
            for index, (gi, start, end, job) in enumerate(self.jobs):
                rounded = job.result()
                group = self.groups[gi]
                if rounded is not None:  # the worker wrote it into one of the update's staging buffers
                    self._published(index, group, start, rounded)
                else:
                    self._publish_here(index, group, start, end, slots, in_flight)
                left[gi] -= 1
                if not left[gi]:
                    group.stepper.close()
        finally:
            self._end(slots, in_flight)

    def _end(self, slots: list[torch.Tensor], in_flight: list[Any]) -> None:
        """Close the update: wait for the worker and every copy up, give the staging buffers back."""
        self.abandon()
        for event in in_flight + [slot.copied for slot in self.slots]:
            if event is not None:
                event.synchronize()
        for slot_buffer in slots + [slot.buffer for slot in self.slots]:
            self.owner.pool.release(slot_buffer)
        self.slots = []

    def _publish_here(
        self, index: int, group: GroupStep, start: int, end: int, slots: list[torch.Tensor], in_flight: list[Any]
    ) -> None:
        """Round range ``[start, end)`` into one of two staging buffers on this thread and copy it up."""
        slot = index % 2
        if in_flight[slot] is not None:
            in_flight[slot].synchronize()  # that buffer's previous copy has left it
            in_flight[slot] = None
        while len(slots) <= slot:
            slots.append(self.owner.pool.acquire(self._widest_bytes(), torch.uint8))
        piece = _staging_view(slots[slot], end - start, group.working_dtype)
        piece.copy_(group.stepper.master.data[start:end])
        group.publish(start, piece)
        in_flight[slot] = record_current()
        self.owner.chunks_published += 1

    def wait(self) -> None:
        """Wait for every range submitted so far (their masters are final; nothing is published)."""
        for _, _, _, job in list(self.jobs):
            _wait_quietly(job)

    def abandon(self) -> None:
        """Wait for every submitted range and close every stepper, publishing nothing (the update is over)."""
        self.done = True  # from here on the worker steps without rounding into the staging buffers
        for slot in self.slots:
            slot.free.set()  # a worker waiting for a buffer that will never be published goes on
        for _, _, _, job in self.jobs:
            _wait_quietly(job)
        if self._short_switch:  # nothing is on the worker any more
            self._short_switch = False
            _SwitchInterval.leave()
        self.owner.device_work.join()  # nothing the worker queued is in flight once the update is over
        for group in self.groups:
            group.stepper.close()
        self.done = True
        self.owner._open.discard(self)

    def _widest_bytes(self) -> int:
        """Bytes of the widest chunk in its working dtype: the size of each staging buffer."""
        return max((end - start) * _element_size(self.groups[gi].working_dtype) for gi, start, end, _ in self.jobs)


def _widest_range(group: GroupStep) -> int:
    return max((end - start for start, end in group.stepper.ranges()), default=1)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _staging_view(buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at the start of a byte staging buffer."""
    return buffer[: numel * _element_size(dtype)].view(dtype)


def _wait_quietly(job: Future) -> None:
    """Wait for ``job``; its exception, if any, was or will be raised by the caller's ``result()``."""
    try:
        job.result()
    except BaseException:  # noqa: BLE001 (already reported through the first failing result())
        return
