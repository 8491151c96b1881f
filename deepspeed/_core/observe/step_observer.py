"""What the training loop reports each micro-step: phase timers (``wall_clock_breakdown``), the throughput timer
(``timers``), the monitors' scalar events and the FLOPs profile (``flops_profiler``).

Scalar events go out on global rank 0 at each optimizer step, with the samples seen so far as the x-axis. Upstream's
tags (``Train/Samples/lr``, ``loss_scale``, the ``elapsed_time_ms_*`` timers) are joined by the loss of the
non-pipeline engine (``Train/Samples/train_loss``: rank 0's mean loss over the accumulation window, before the
division by the accumulation steps), the allocated device memory after each phase next to the model-state floor, and
the samples and tokens per second.

Nothing here waits for the device during a step. A step's scalars are queued (:mod:`~deepspeed._core.observe.deferred`):
the loss is copied to host memory without blocking and the phase timers hand over their events; the queue writes a
step's events once the device has passed them (usually at the next step), in order, through the monitors' background
writer. :meth:`StepObserver.flush` (and :meth:`StepObserver.close`, which the engine's ``destroy`` and process exit
call) waits for and writes whatever is left, so no scalar is lost.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from deepspeed._core.config.plan import RunPlan
from deepspeed._core.observe.deferred import HostSlots, PendingQueue, PendingRecord
from deepspeed._core.observe.monitors import Event, MonitorMaster, global_rank
from deepspeed._core.observe.timers import (
    BACKWARD_GLOBAL_TIMER,
    BACKWARD_INNER_GLOBAL_TIMER,
    BACKWARD_REDUCE_GLOBAL_TIMER,
    FORWARD_GLOBAL_TIMER,
    FORWARD_MICRO_TIMER,
    GLOBAL_TIMERS,
    MICRO_TIMERS,
    STEP_GLOBAL_TIMER,
    NoopTimer,
    SynchronizedWallClockTimer,
    ThroughputTimer,
)
from deepspeed.accelerator import get_accelerator

_GIB = float(1 << 30)
TIMER_TAGS = {
    FORWARD_GLOBAL_TIMER: "Train/Samples/elapsed_time_ms_forward",
    BACKWARD_GLOBAL_TIMER: "Train/Samples/elapsed_time_ms_backward",
    BACKWARD_INNER_GLOBAL_TIMER: "Train/Samples/elapsed_time_ms_backward_inner",
    BACKWARD_REDUCE_GLOBAL_TIMER: "Train/Samples/elapsed_time_ms_backward_allreduce",
    STEP_GLOBAL_TIMER: "Train/Samples/elapsed_time_ms_step",
}
"""Monitor tag of each global timer."""


def _period(steps_per_print: float | None) -> int | None:
    if steps_per_print is None or not math.isfinite(steps_per_print) or steps_per_print <= 0:
        return None
    return int(steps_per_print)


def count_tokens(inputs: tuple, kwargs: dict) -> int | None:
    """Tokens in a micro-batch: the size of ``input_ids``, else of the first integer tensor argument."""
    candidates = [kwargs.get("input_ids"), *inputs, *kwargs.values()]
    for value in candidates:
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool:
            return value.numel()
    return None


_LIVE_OBSERVERS: weakref.WeakSet[StepObserver] = weakref.WeakSet()


@atexit.register
def _close_live_observers() -> None:
    # Registered after the monitors' own exit hook, so it runs first: queued steps reach the monitors before they close.
    for observer in list(_LIVE_OBSERVERS):
        observer.close()


class StepObserver:
    """The timers, monitors and profiler of one engine.

    Args:
        plan: the run plan.
        floor_bytes: the model-state floor on the device (reported next to the measured memory).
    """

    def __init__(self, plan: RunPlan, floor_bytes: float) -> None:
        self.plan = plan
        self.floor_bytes = floor_bytes
        self.timers: SynchronizedWallClockTimer | NoopTimer = (
            SynchronizedWallClockTimer() if plan.wall_clock_breakdown else NoopTimer()
        )
        self.tput_timer = ThroughputTimer(
            plan.timers.throughput,
            batch_size=plan.batch.train_batch_size,
            steps_per_output=_period(plan.steps_per_print),
        )
        self.monitor = MonitorMaster(plan)
        self.writes = self.monitor.enabled and global_rank() == 0
        self.profiler: Any = None  # a FlopsProfiler, set by the engine on global rank 0 when flops_profiler is on
        self.last_events: list[Event] = []
        self._losses: list[torch.Tensor] = []
        self._tokens: int | None = None
        self._memory: dict[str, float] = {}
        self._window_start: float | None = None
        self._slots = HostSlots()
        self.pending = PendingQueue(self._write_now)
        _LIVE_OBSERVERS.add(self)

    # --- phases ----------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def timed(self, *names: str) -> Iterator[None]:
        """Time the enclosed code under each of ``names`` (nothing without ``wall_clock_breakdown``)."""
        for name in names:
            self.timers(name).start()
        try:
            yield
        finally:
            for name in reversed(names):
                self.timers(name).stop()

    def forward_begin(self, global_steps: int, inputs: tuple, kwargs: dict) -> None:
        """Before the module's forward: start the timers and, at ``profile_step``, the FLOPs profile."""
        if not self.tput_timer.started:
            self.tput_timer.start()
        if self._window_start is None:
            self._window_start = time.perf_counter()
        profile = self.plan.flops_profiler
        if self.profiler is not None and global_steps == profile.profile_step:
            self.profiler.start_profile(ignore_list=None)
        if self.writes:
            tokens = count_tokens(inputs, kwargs)
            if tokens is not None:
                self._tokens = (self._tokens or 0) + tokens
        self.timers(FORWARD_MICRO_TIMER).start()
        self.timers(FORWARD_GLOBAL_TIMER).start()

    def forward_end(self) -> None:
        """After the module's forward."""
        self.timers(FORWARD_GLOBAL_TIMER).stop()
        self.timers(FORWARD_MICRO_TIMER).stop()
        if self.profiler is not None and self.profiler.func_patched:
            self.profiler.stop_profile()

    def note_loss(self, loss: torch.Tensor) -> None:
        """Keep a micro-batch's loss for the ``train_loss`` event (only while a monitor writes)."""
        if self.writes:
            self._losses.append(loss.detach())

    def phase(self, name: str) -> None:
        """Note the allocated device memory at ``name`` (only while a monitor writes)."""
        if self.writes:
            self._memory[name] = get_accelerator().memory_allocated()

    # --- the end of a micro-step ------------------------------------------------------------------------------------
    def step_end(self, boundary: bool, loop: Any) -> None:
        """After ``step()``: throughput, monitor events, the profile and the timer lines, in upstream's order.

        Args:
            boundary: whether this ``step()`` ended an accumulation window.
            loop: the training loop (``global_steps``, ``global_samples``, ``get_lr()``, ``optimizer``).
        """
        # Built before the throughput timer may wait for the device, so its host reads overlap the device's work.
        record = self._step_record(loop) if boundary and self.writes else None
        self.tput_timer.stop(global_step=boundary, report_speed=global_rank() == 0)
        if record is not None:
            self.pending.push(record)
        if boundary and self.profiler is not None and self.profiler.started:
            profile = self.plan.flops_profiler
            self.profiler.print_model_profile(
                profile_step=loop.global_steps,
                module_depth=profile.module_depth,
                top_modules=profile.top_modules,
                detailed=profile.detailed,
                output_file=profile.output_file,
            )
            self.profiler.end_profile()
        if not self.plan.wall_clock_breakdown:
            return
        self.timers.log(MICRO_TIMERS, memory_breakdown=self.plan.memory_breakdown)
        if boundary:
            timers = self.timers
            assert isinstance(timers, SynchronizedWallClockTimer)  # wall_clock_breakdown is on
            if self.writes:
                for name in GLOBAL_TIMERS:  # a phase that did not run is written as 0 ms
                    timers(name)
            reading = timers.take(GLOBAL_TIMERS)
            if self.writes:
                self.pending.push(PendingRecord([], self._slots, reading, TIMER_TAGS, loop.global_samples))
            timers.print_when_ready(reading)

    def _step_record(self, loop: Any) -> PendingRecord:
        samples = loop.global_samples
        events: list[Event] = []
        lrs = loop.get_lr()
        if lrs:
            events.append(("Train/Samples/lr", lrs[0], samples))
        if self.plan.precision.param_dtype == torch.float16 and loop.optimizer is not None:
            events.append(("Train/Samples/loss_scale", float(loop.optimizer.cur_scale), samples))
        if self._losses:
            # A device tensor: the queue copies it to the host without waiting and reads it once it has landed.
            mean = self._losses[0].float() if len(self._losses) == 1 else torch.stack(self._losses).float().mean()
            events.append(("Train/Samples/train_loss", mean, samples))
        events += self._memory_events(samples) + self._speed_events(samples)
        self._losses, self._memory, self._tokens = [], {}, None
        return PendingRecord(events, self._slots)

    def _memory_events(self, samples: int) -> list[Event]:
        events: list[Event] = [
            (f"Train/Samples/mem_allocated_{name.replace(' ', '_')}_GiB", value / _GIB, samples)
            for name, value in self._memory.items()
        ]
        acc = get_accelerator()
        events.append(("Train/Samples/mem_peak_GiB", acc.max_memory_allocated() / _GIB, samples))
        events.append(("Train/Samples/mem_floor_GiB", self.floor_bytes / _GIB, samples))
        return events

    def _speed_events(self, samples: int) -> list[Event]:
        now = time.perf_counter()
        start, self._window_start = self._window_start, now
        if start is None or now <= start:
            return []
        seconds = now - start
        events: list[Event] = [("Train/Samples/samples_per_sec", self.plan.batch.train_batch_size / seconds, samples)]
        if self._tokens is not None:
            # Rank 0's tokens times the data-parallel size: every replica is assumed to see batches of one shape.
            tokens = self._tokens * self.plan.batch.dp_world_size
            events.append(("Train/Samples/tokens_per_sec", tokens / seconds, samples))
        return events

    def write_scalar(self, tag: str, value: Any, samples: int) -> None:
        """Write one scalar (a tensor's mean) while a monitor writes; the pipeline engine's losses come this way.
        A tensor is read once the device has computed it, without waiting here."""
        if self.writes and value is not None:
            mean = value.float().mean() if isinstance(value, torch.Tensor) else float(value)
            self.pending.push(PendingRecord([(tag, mean, samples)], self._slots))

    def write_events(self, events: list[Event]) -> None:
        """Send ``events`` to the monitors (rank 0 only), after the steps still waiting for the device."""
        if self.writes and events:
            self.pending.push(PendingRecord(list(events), self._slots))

    def _write_now(self, events: list[Event]) -> None:
        self.monitor.write_events(events)
        self.last_events = list(events)

    # --- shutdown ---------------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for the device, write every queued step to the monitors and print every queued timer line; returns
        once the monitors have written and flushed them (raises a monitor's write error, naming it)."""
        self.pending.drain(everything=True)
        self.timers.flush()
        self.monitor.flush()

    def close(self) -> None:
        """:meth:`flush`, then close the monitors' files and their writer thread."""
        _LIVE_OBSERVERS.discard(self)
        try:
            self.flush()
        finally:
            self.monitor.close()
