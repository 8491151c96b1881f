"""Step timers: the named phase timers of ``wall_clock_breakdown`` and the samples-per-second throughput timer.

Upstream's ``deepspeed.utils.timer`` names (the timer name constants, ``SynchronizedWallClockTimer``, ``NoopTimer``,
``CudaEventTimer``, ``ThroughputTimer``, ``trim_mean``) are re-exported there. On a device whose host clock does not
see queued kernels (CUDA), a phase timer records a pair of device events (reused from a small pool) and reads them
only when asked, so timing a phase never waits for the device in the middle of a step. :meth:`log` does not ask
either: it takes the intervals off the timers and prints their line once the device has passed their end events
(``Event.query()``), in the order the lines were logged; :meth:`SynchronizedWallClockTimer.flush` waits for and prints
whatever is left (the engine calls it when it is destroyed and at process exit).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from deepspeed._foundation.logging import logger, print_dist
from deepspeed.accelerator import get_accelerator

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
TIME_EPSILON = 1e-6

MICRO_TIMERS = (
    FORWARD_MICRO_TIMER,
    BACKWARD_MICRO_TIMER,
    BACKWARD_INNER_MICRO_TIMER,
    BACKWARD_REDUCE_MICRO_TIMER,
    STEP_MICRO_TIMER,
)
"""Timers printed after every ``step()``."""
GLOBAL_TIMERS = (
    FORWARD_GLOBAL_TIMER,
    BACKWARD_GLOBAL_TIMER,
    BACKWARD_INNER_GLOBAL_TIMER,
    BACKWARD_REDUCE_GLOBAL_TIMER,
    STEP_GLOBAL_TIMER,
)
"""Timers accumulated over an accumulation window, printed at its boundary."""

_GIB = float(1 << 30)


def trim_mean(data: list[float], trim_percent: float) -> float:
    """Mean of ``data`` without the ``trim_percent`` smallest and largest values (0 for no data)."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent must lie in [0, 1], got {trim_percent}")
    if not data:
        return 0.0
    ordered = sorted(data)
    cut = int(round(len(ordered) * trim_percent))
    kept = ordered[cut : len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


class CudaEventTimer:
    """One timed interval between two recorded device events; read lazily."""

    def __init__(self, start_event: Any, end_event: Any) -> None:
        self.start_event = start_event
        self.end_event = end_event

    def get_elapsed_msec(self) -> float:
        """Milliseconds between the two events (waits for the end event)."""
        self.end_event.synchronize()
        return self.read_msec()

    def ready(self) -> bool:
        """Whether the device has passed the end event (reading then does not wait)."""
        return bool(self.end_event.query())

    def read_msec(self) -> float:
        """Milliseconds between the two events; only once :meth:`ready` (or after a wait)."""
        return float(self.start_event.elapsed_time(self.end_event))


class _HostInterval:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def get_elapsed_msec(self) -> float:
        return self.seconds * 1000.0

    def ready(self) -> bool:
        return True

    def read_msec(self) -> float:
        return self.seconds * 1000.0


class _EventPool:
    """Timing events whose intervals have been read, handed out again (no event created per phase per step)."""

    def __init__(self) -> None:
        self.free: list[Any] = []

    def get(self) -> Any:
        return self.free.pop() if self.free else get_accelerator().Event(enable_timing=True)

    def put(self, interval: Any) -> None:
        if isinstance(interval, CudaEventTimer) and len(self.free) < 256:
            self.free += [interval.start_event, interval.end_event]


class TimerReading:
    """The intervals of some named timers, taken off them at one moment; their milliseconds are read once the device
    has passed every end event, so taking a reading never waits.

    Args:
        intervals: the intervals of each timer name, in print order.
        pool: where the events go once read (``None``: the intervals are still the timers' own).
    """

    def __init__(self, intervals: dict[str, list[Any]], pool: _EventPool | None = None) -> None:
        self.intervals = intervals
        self.pool = pool
        self._values: dict[str, float] | None = None

    def ready(self) -> bool:
        """Whether :meth:`values` can be read without waiting for the device."""
        return self._values is not None or all(t.ready() for ts in self.intervals.values() for t in ts)

    def values(self) -> dict[str, float]:
        """Milliseconds per timer name (waits for the device only if not :meth:`ready`: at a flush)."""
        if self._values is None:
            if not self.ready():
                for ts in self.intervals.values():
                    for t in ts:
                        t.get_elapsed_msec()  # waits for the end event
            self._values = {name: sum(t.read_msec() for t in ts) for name, ts in self.intervals.items()}
            if self.pool is not None:
                for ts in self.intervals.values():
                    for t in ts:
                        self.pool.put(t)
            self.intervals = {}
        return self._values


class _PendingLine:
    def __init__(self, reading: TimerReading, normalizer: float, memory: str, ranks: list[int]) -> None:
        self.reading, self.normalizer, self.memory, self.ranks = reading, normalizer, memory, ranks

    def text(self) -> str:
        parts = [f" | {name}: {ms / self.normalizer:.2f}" for name, ms in self.reading.values().items()]
        return "time (ms)" + "".join(parts) + self.memory


class SynchronizedWallClockTimer:
    """A group of named timers; ``timers(name).start()`` / ``.stop()``, and :meth:`log` prints and resets them."""

    class Timer:
        """One named timer; its intervals add up until :meth:`reset`."""

        def __init__(self, name: str) -> None:
            self.name_ = name
            self.started_ = False
            self.event_timers: list[Any] = []
            self.use_host_timer = get_accelerator().use_host_timers()
            self.start_event: Any = None
            self.start_time = 0.0
            self.elapsed_records: list[float] | None = None
            self.pool: _EventPool | None = None  # set by the group: events are reused once read

        def start(self) -> None:
            """Start an interval."""
            if self.started_:
                raise RuntimeError(f"timer {self.name_!r} has already been started")
            if self.use_host_timer:
                self.start_time = time.perf_counter()
            else:
                self.start_event = self._event()
                self.start_event.record()
            self.started_ = True

        def stop(self, reset: bool = False, record: bool = False) -> None:
            """End the current interval (``reset``/``record``: accepted for upstream callers)."""
            if not self.started_:
                raise RuntimeError(f"timer {self.name_!r} is not started")
            if self.use_host_timer:
                self.event_timers.append(_HostInterval(time.perf_counter() - self.start_time))
            else:
                end = self._event()
                end.record()
                self.event_timers.append(CudaEventTimer(self.start_event, end))
                self.start_event = None
            self.started_ = False

        def _event(self) -> Any:
            return self.pool.get() if self.pool is not None else get_accelerator().Event(enable_timing=True)

        def take(self, reset: bool) -> list[Any]:
            """The intervals so far, without reading them (a running interval is cut here and goes on);
            ``reset`` hands them over and leaves the timer empty."""
            running = self.started_
            if running:
                self.stop()
            taken = self.event_timers if reset else list(self.event_timers)
            if reset:
                self.event_timers = []
                self.elapsed_records = None
            if running:
                self.start()
            return taken

        def reset(self) -> None:
            """Forget every interval."""
            self.started_ = False
            self.start_event = None
            self.elapsed_records = None
            self.event_timers.clear()

        def elapsed(self, reset: bool = True) -> float:
            """Milliseconds over all intervals so far (a running interval is included and keeps running)."""
            running = self.started_
            if running:
                self.stop()
            self.elapsed_records = [t.get_elapsed_msec() for t in self.event_timers]
            total = sum(self.elapsed_records)
            if reset:
                self.reset()
            if running:
                self.start()
            return total

        def mean(self) -> float:
            """Trimmed mean (10 %) of the intervals, in milliseconds."""
            self.elapsed(reset=False)
            return trim_mean(list(self.elapsed_records or []), 0.1)

    MAX_PENDING_LINES = 64
    """Lines waiting for the device beyond which :meth:`log` waits for the oldest (bounds the events held)."""

    def __init__(self) -> None:
        self.timers: dict[str, SynchronizedWallClockTimer.Timer] = {}
        self._pool = _EventPool()
        self._pending: deque[_PendingLine] = deque()

    def get_timers(self) -> dict[str, SynchronizedWallClockTimer.Timer]:
        """The timers created so far, by name."""
        return self.timers

    def __call__(self, name: str) -> SynchronizedWallClockTimer.Timer:
        timer = self.timers.get(name)
        if timer is None:
            timer = self.timers[name] = self.Timer(name)
            timer.pool = self._pool
        return timer

    def take(self, names: Iterable[str], reset: bool = True) -> TimerReading:
        """The intervals of the named timers that exist, for reading later (nothing waits here); ``reset`` empties
        the timers, as printing does."""
        intervals = {name: self.timers[name].take(reset) for name in names if name in self.timers}
        return TimerReading(intervals, self._pool if reset else None)

    @staticmethod
    def memory_usage() -> str:
        """`` | mem_allocated: … GB | max_mem_allocated: … | cache_allocated: … | max_cache_allocated: …``."""
        acc = get_accelerator()
        return (
            f" | mem_allocated: {acc.memory_allocated() / _GIB:.4f} GB"
            f" | max_mem_allocated: {acc.max_memory_allocated() / _GIB:.4f} GB"
            f" | cache_allocated: {acc.memory_cached() / _GIB:.4f} GB"
            f" | max_cache_allocated: {acc.max_memory_cached() / _GIB:.4f} GB"
        )

    def log(
        self,
        names: Iterable[str],
        normalizer: float = 1.0,
        reset: bool = True,
        memory_breakdown: bool = False,
        ranks: list[int] | None = None,
    ) -> str | None:
        """Print ``[Rank r] time (ms) | name: x.xx | …`` for the named timers that exist (on ``ranks``, default 0).

        The intervals are taken now and the line is printed once the device has passed them, after every line
        logged before it; nothing here waits for the device. Returns the line when it was printed at once (host
        timers, or a device already done), else ``None``.
        """
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        memory = self.memory_usage() if memory_breakdown else ""
        return self.print_when_ready(self.take(names, reset), normalizer, memory, ranks)

    def print_when_ready(
        self, reading: TimerReading, normalizer: float = 1.0, memory: str = "", ranks: list[int] | None = None
    ) -> str | None:
        """Queue the line of ``reading`` (``memory`` appended) and print the queued lines that are ready, in order;
        returns this line if it was printed now."""
        line = _PendingLine(reading, normalizer, memory, ranks or [0])
        self._pending.append(line)
        printed = self._print_ready(wait=len(self._pending) > self.MAX_PENDING_LINES)
        return printed.get(id(line))

    def _print_ready(self, wait: bool = False, everything: bool = False) -> dict[int, str]:
        printed: dict[int, str] = {}
        while self._pending and (everything or wait or self._pending[0].reading.ready()):
            head = self._pending.popleft()
            text = head.text()
            print_dist(text, ranks=head.ranks)
            printed[id(head)] = text
            wait = False
        return printed

    def flush(self) -> None:
        """Wait for the device and print every queued line."""
        self._print_ready(everything=True)

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """Trimmed mean per named timer (milliseconds / ``normalizer``)."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        return {name: self.timers[name].mean() / normalizer for name in names if name in self.timers}


class NoopTimer:
    """The timer group used when ``wall_clock_breakdown`` is off: every call does nothing."""

    class Timer:
        """A timer that measures nothing."""

        def start(self) -> None:
            """Do nothing."""

        def reset(self) -> None:
            """Do nothing."""

        def stop(self, **kwargs: Any) -> None:
            """Do nothing."""

        def elapsed(self, **kwargs: Any) -> float:
            """Always 0."""
            return 0

        def mean(self) -> float:
            """Always 0."""
            return 0

    def __init__(self) -> None:
        self.timer = self.Timer()

    def __call__(self, name: str) -> NoopTimer.Timer:
        return self.timer

    def get_timers(self) -> dict:
        """No timers."""
        return {}

    def log(
        self,
        names: Iterable[str],
        normalizer: float = 1.0,
        reset: bool = True,
        memory_breakdown: bool = False,
        ranks: list[int] | None = None,
    ) -> None:
        """Print nothing."""

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> None:
        """No means."""

    def flush(self) -> None:
        """Nothing is queued."""


class ThroughputTimer:
    """Samples per second over optimizer steps, logged every ``steps_per_output`` of them.

    Args:
        config: the ``timers.throughput`` settings (``enabled``, ``synchronized``).
        batch_size: samples per optimizer step (``None``: 1).
        start_step: optimizer steps left out of the timing (warm-up).
        steps_per_output: log period in optimizer steps (``None``: never).
        monitor_memory: also log host virtual-memory and swap use (needs psutil).
        logging_fn: where the lines go (default: the package logger's ``info``).
    """

    def __init__(
        self,
        config: Any,
        batch_size: int | None,
        start_step: int = 2,
        steps_per_output: int | None = None,
        monitor_memory: bool = False,
        logging_fn: Callable[[str], Any] | None = None,
    ) -> None:
        if steps_per_output is not None and steps_per_output <= 0:
            raise ValueError(f"steps_per_output must be a positive integer or None, got {steps_per_output}")
        if monitor_memory:
            import psutil  # noqa: F401 - a missing psutil is reported here, not at the first report

        self.config = config
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = bool(monitor_memory)
        self.logging = logging_fn if logging_fn is not None else logger.info
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.initialized = False
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0

    def update_epoch_count(self) -> None:
        """Start a new epoch (micro-step count back to 0)."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Start timing a micro-step (timing begins once ``start_step`` optimizer steps are done)."""
        if not self.config.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            if self.config.synchronized:
                get_accelerator().synchronize()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End a micro-step; ``global_step`` marks an optimizer step, which may log the throughput line."""
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return
        if self.config.synchronized:
            get_accelerator().synchronize()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if global_step:
            if report_speed and self._is_report_boundary():
                self._report()
            self.step_elapsed_time = 0.0

    def _is_report_boundary(self) -> bool:
        if self.steps_per_output is None:
            return False
        if self.steps_per_output <= 0:
            raise ValueError(f"steps_per_output must be a positive integer, got {self.steps_per_output}")
        return self.global_step_count % self.steps_per_output == 0

    def _report(self) -> None:
        acc = get_accelerator()
        where = f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step={self.global_step_count}"
        self.logging(
            f"{where}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
            f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + TIME_EPSILON)}, "
            f"MemAllocated={round(acc.memory_allocated() / _GIB, 2)}GB, "
            f"MaxMemAllocated={round(acc.max_memory_allocated() / _GIB, 2)}GB"
        )
        if self.monitor_memory:
            import psutil

            self.logging(f"{where}, vm %: {psutil.virtual_memory().percent}, swap %: {psutil.swap_memory().percent}")

    def avg_samples_per_sec(self) -> float:
        """Mean samples per second over the timed optimizer steps (``-inf`` before the first one)."""
        timed_steps = self.global_step_count - self.start_step
        if self.global_step_count > 0 and timed_steps > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed_steps)
        return float("-inf")
