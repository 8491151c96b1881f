"""One background thread that writes the monitors' event batches, so file and network writes stay off the
training thread.

Batches go through a bounded queue (a training loop that outruns the writer waits for room instead of growing
memory without end), are written to every monitor in the order they were submitted, and the monitors are flushed at
most once per ``flush_interval`` seconds (and whenever the queue has been idle that long), on :meth:`flush` and on
:meth:`close`, rather than once per scalar or per step. A monitor that raises while writing does not stop the
others; the error is raised on the training thread at the next :meth:`BackgroundWriter.submit`, :meth:`flush` or
:meth:`close`, naming the monitor. :meth:`close` writes everything queued, closes the monitors and joins the thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any


class MonitorWriteError(RuntimeError):
    """A monitor failed to write events on the background writer thread."""


_FLUSH = object()
_STOP = object()


class BackgroundWriter:
    """Writes event batches to ``sinks`` on a daemon thread.

    Args:
        sinks: ``(name, monitor)`` pairs; a monitor has ``write_unflushed(events)`` and optionally ``flush()``
            and ``close()``. The name is the config block (``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``).
        max_batches: batches the queue holds before :meth:`submit` waits.
        flush_interval: seconds between two flushes of the monitors while batches keep coming.
    """

    def __init__(self, sinks: Sequence[tuple[str, Any]], max_batches: int = 256, flush_interval: float = 1.0) -> None:
        self.sinks = list(sinks)
        self.flush_interval = flush_interval
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_batches)
        self._errors: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="deepspeed-monitor-writer", daemon=True)
        self._thread.start()

    # --- training thread ------------------------------------------------------------------------------------------
    def submit(self, events: Sequence[Any]) -> None:
        """Queue one batch of ``(tag, value, step)`` events (raises an earlier write's error first)."""
        self.raise_error()
        self._queue.put(list(events))

    def flush(self) -> None:
        """Wait until every queued batch is written and the monitors are flushed; raise any write error."""
        if self._thread.is_alive():
            self._queue.put(_FLUSH)
            self._queue.join()
        self.raise_error()

    def close(self) -> None:
        """Write what is queued, close the monitors, stop the thread; raise any write error."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self.raise_error()

    def raise_error(self) -> None:
        """Raise (once) the first error a monitor hit since the last call, naming the monitor."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            name, err = errors[0]
            more = f" (and {len(errors) - 1} more write errors)" if len(errors) > 1 else ""
            raise MonitorWriteError(
                f"monitor '{name}' failed to write events: {type(err).__name__}: {err}{more}"
            ) from err

    # --- writer thread --------------------------------------------------------------------------------------------
    def _run(self) -> None:
        dirty, last_flush = False, time.monotonic()
        while True:
            try:
                items = [self._queue.get(timeout=self.flush_interval if dirty else None)]
            except queue.Empty:  # idle: put what was written on disk
                self._each("flush")
                dirty, last_flush = False, time.monotonic()
                continue
            while True:  # take every batch already queued
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                dirty = self._write(items) or dirty
                due = _FLUSH in items or _STOP in items or time.monotonic() - last_flush >= self.flush_interval
                if dirty and due:
                    self._each("flush")
                    dirty, last_flush = False, time.monotonic()
                if _STOP in items:
                    self._each("close")
            finally:
                for _ in items:
                    self._queue.task_done()
            if _STOP in items:
                return

    def _write(self, items: list[Any]) -> bool:
        wrote = False
        for item in items:
            if item is not _FLUSH and item is not _STOP:
                self._each("write_unflushed", item)
                wrote = True
        return wrote

    def _each(self, method: str, *args: Any) -> None:
        for name, sink in self.sinks:
            call = getattr(sink, method, None)
            if call is None:
                continue
            try:
                call(*args)
            except Exception as err:  # noqa: BLE001 - reported on the training thread, naming the monitor
                with self._lock:
                    self._errors.append((name, err))
