"""Named streams in one context object, and event-carrying handoffs between them.

Every cross-stream lifetime in ZeRO-3 is expressed with an event that travels with the data ([Note: streams] in
``docs/design/streams.md``): the producer records an event after writing a tensor, the consumer stream waits on
that event, and memory is released only on a stream that is already ordered after the last use. Tensors are never
marked as in use by another stream (the caching allocator's cross-stream recording), which would delay reuse.

The device runtime is reached through a :class:`StreamBackend`, so tests can inject fake streams and events (for
example events that stay "not complete" for a while, emulating a GPU that lags far behind the CPU). Code without
a :class:`StreamSet` (the offload paths' host-side waits) takes its events from :func:`record_current`, so no event
is created anywhere else in ``deepspeed/_core``.

[Note: worker stream] A thread's current stream is its own; a new thread starts on the device's default stream,
which is the training loop's compute stream. A host worker that copies gradients down while the backward still
runs ([Note: early host step]) would queue those copies between the backward's kernels, and the backward would
wait for them. Its device work goes on a :class:`WorkerStream` instead: ``mark`` records an event on the
submitting thread's stream when a job is handed over, the job runs inside ``after`` (the side stream waits for
that event on the device, so the copies see everything queued before the hand-over), and ``join`` makes the
submitting thread's stream, and the host, wait for all of it before the memory the copies read or wrote can be
freed or reused.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deepspeed.accelerator import get_accelerator


class StreamRole(enum.Enum):
    """What a stream is for; :class:`StreamSet` holds one stream per role.

    ``COMPUTE`` is the training loop's stream; ``ALL_GATHER`` carries the ZeRO-3 parameter gathers. Gradient
    reductions are queued on the compute stream (their collectives' work handles order them there), so they
    have no role of their own.
    """

    COMPUTE = "compute"
    ALL_GATHER = "all_gather"


class StreamBackend(Protocol):
    """The four stream/event primitives the ZeRO-3 schedule needs."""

    def new_stream(self) -> Any:
        """A fresh side stream."""

    def new_event(self) -> Any:
        """A fresh, unrecorded event."""

    def current_stream(self) -> Any:
        """The stream work is queued on right now."""

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context manager making ``stream`` current."""


class AcceleratorStreams:
    """:class:`StreamBackend` over ``get_accelerator()`` (no-op streams and events on CPU)."""

    def new_stream(self) -> Any:
        """A new accelerator stream."""
        return get_accelerator().Stream()

    def new_event(self) -> Any:
        """A new accelerator event (no timing)."""
        return get_accelerator().Event()

    def current_stream(self) -> Any:
        """The accelerator's current stream."""
        return get_accelerator().current_stream()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """The accelerator's stream context."""
        return get_accelerator().stream(stream)


class SideStreams(enum.Enum):
    """Whether communication gets its own streams (``SEPARATE``) or shares the compute stream (``SHARED``)."""

    SEPARATE = "separate"
    SHARED = "shared"


class StreamSet:
    """One stream per :class:`StreamRole`, created once, plus event helpers.

    ``COMPUTE`` is the stream current when the set is built (the training loop's stream).
    """

    def __init__(self, backend: StreamBackend | None = None, side: SideStreams = SideStreams.SEPARATE) -> None:
        """Create the side streams on ``backend`` (default: the accelerator)."""
        self.backend: StreamBackend = backend if backend is not None else AcceleratorStreams()
        compute = self.backend.current_stream()
        gather = self.backend.new_stream() if side is SideStreams.SEPARATE else compute
        self._streams = {StreamRole.COMPUTE: compute, StreamRole.ALL_GATHER: gather}
        self._on = threading.local()  # per thread (the autograd engine runs backward hooks on its own)

    def get(self, role: StreamRole) -> Any:
        """The stream playing ``role``."""
        return self._streams[role]

    def current_role(self) -> StreamRole:
        """The role whose stream this thread is on: ``COMPUTE`` outside any :meth:`use` block."""
        return getattr(self._on, "role", StreamRole.COMPUTE)

    def use(self, role: StreamRole) -> contextlib.AbstractContextManager:
        """Make ``role``'s stream current inside the ``with`` block.

        Asking for the stream the thread is already on costs nothing: the set tracks which of its streams each
        thread is on (the compute stream outside any block, as everywhere in this package). The accelerator's
        stream switch is a few Python calls and device-index lookups each way, and the one-rank gather path asks
        for the compute stream twice per unit ([Note: streams]).
        """
        if self._streams[role] is self._streams[self.current_role()]:
            return contextlib.nullcontext()
        return self._switch(role)

    @contextlib.contextmanager
    def _switch(self, role: StreamRole) -> Iterator[None]:
        previous = self.current_role()
        with self.backend.use_stream(self._streams[role]):
            self._on.role = role
            try:
                yield
            finally:
                self._on.role = previous

    def record(self, role: StreamRole) -> Any:
        """Record and return an event on ``role``'s stream (marks "everything queued so far")."""
        event = self.backend.new_event()
        event.record(self._streams[role])
        return event

    def wait(self, role: StreamRole, event: Any) -> None:
        """Make ``role``'s stream wait (on the device, not the host) for ``event``."""
        if event is not None:
            self._streams[role].wait_event(event)


_ACCELERATOR_STREAMS = AcceleratorStreams()


def record_current(backend: StreamBackend | None = None) -> Any:
    """Record and return an event on the current stream (default backend: the accelerator).

    It marks "everything queued so far" for code that holds no :class:`StreamSet`: the offload paths record one
    after each non-blocking copy and the host waits on it (``event.synchronize()``) before reusing the copy's
    staging buffer or reading its destination (see ``docs/design/streams.md``, "Where the host waits").
    """
    backend = backend if backend is not None else _ACCELERATOR_STREAMS
    event = backend.new_event()
    event.record(backend.current_stream())
    return event


class WorkerStream:
    """The side stream a host worker thread queues its device work on (the offloaded step's copies of
    device-resident gradients down), ordered after the submitting thread's stream by events ([Note: worker
    stream])."""

    def __init__(self, backend: StreamBackend | None = None) -> None:
        """A worker stream on ``backend`` (default: the accelerator), created on first use."""
        self.backend: StreamBackend = backend if backend is not None else _ACCELERATOR_STREAMS
        self._stream: Any = None

    def mark(self) -> Any:
        """On the submitting thread: an event covering everything queued on its stream so far."""
        return record_current(self.backend)

    @contextlib.contextmanager
    def after(self, event: Any) -> Iterator[None]:
        """On the worker: make this stream current, waiting (on the device) for ``event`` first."""
        if self._stream is None:
            self._stream = self.backend.new_stream()
        self._stream.wait_event(event)
        with self.backend.use_stream(self._stream):
            yield

    def join(self) -> None:
        """On the submitting thread, once the worker's jobs are done: order its stream after all work queued on
        this stream, and wait for that work on the host too (a copy left in flight, such as a read-ahead nobody
        consumed, may be writing into a page-locked buffer that goes back to its pool now)."""
        if self._stream is None:
            return
        event = self.backend.new_event()
        event.record(self._stream)
        self.backend.current_stream().wait_event(event)
        event.synchronize()


@dataclass
class Handoff:
    """A tensor passed between streams: usable once ``ready`` fires, released on ``release_role``'s stream.

    The releasing stream must wait on ``ready`` before the tensor is dropped, so the allocator hands the block
    to later work on that stream only after every earlier use has been ordered before it.
    """

    tensor: torch.Tensor | None
    ready: Any
    release_role: StreamRole

    def release(self, streams: StreamSet) -> None:
        """Order the release stream after ``ready`` and drop the tensor reference."""
        streams.wait(self.release_role, self.ready)
        self.tensor = None


@dataclass
class _PendingFree:
    key: int
    event: Any
    free: Callable[[], None]


class DeferredFreeQueue:
    """Frees that wait for the device to reach an event: the A/B emulation of upstream's cross-stream recording.

    When a tensor is recorded as used by a side stream, the allocator keeps its block until the recorded stream
    has run past the free point, i.e. until the GPU catches up with the CPU. Here the same effect is explicit:
    ``push`` stores the free with an event recorded at release time, and ``drain`` (called at every fetch) runs
    the frees whose event has completed, in order. Nothing blocks the host. See [Note: streams-baseline].
    """

    def __init__(self) -> None:
        """An empty queue."""
        self._queue: deque[_PendingFree] = deque()

    def push(self, key: int, event: Any, free: Callable[[], None]) -> None:
        """Defer ``free`` until ``event`` has completed; ``key`` identifies what it frees (e.g. a ``ds_id``)."""
        self._queue.append(_PendingFree(key, event, free))

    def drain(self) -> int:
        """Run every free whose event completed, oldest first (stream order); return how many ran."""
        ran = 0
        while self._queue and self._queue[0].event.query():
            self._queue.popleft().free()
            ran += 1
        return ran

    def cancel(self, key: int) -> bool:
        """Drop the pending free for ``key`` (its memory is being reused); ``True`` if one was pending."""
        for entry in self._queue:
            if entry.key == key:
                self._queue.remove(entry)
                return True
        return False

    def flush(self) -> None:
        """Wait for every pending event and run all frees (teardown only)."""
        while self._queue:
            entry = self._queue.popleft()
            entry.event.synchronize()
            entry.free()

    def pending_keys(self) -> list[int]:
        """Keys whose memory is released logically but not yet returned."""
        return [entry.key for entry in self._queue]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[int]:
        return iter(self.pending_keys())
