"""The stream backend's roles and its one event helper for code without a StreamSet (``record_current``)."""

from __future__ import annotations

import contextlib
from typing import Any

from deepspeed._core.comm.streams import SideStreams, StreamRole, StreamSet, record_current


class _Event:
    def __init__(self) -> None:
        self.recorded_on: Any = None

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream


class _Backend:
    def __init__(self) -> None:
        self.current, self.created = "compute", []

    def new_stream(self) -> str:
        self.created.append(f"side{len(self.created)}")
        return self.created[-1]

    def new_event(self) -> _Event:
        return _Event()

    def current_stream(self) -> str:
        return self.current

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def test_roles_are_the_streams_in_use() -> None:
    backend = _Backend()
    streams = StreamSet(backend)
    assert list(StreamRole) == [StreamRole.COMPUTE, StreamRole.ALL_GATHER]
    assert backend.created == ["side0"]  # one side stream: the gathers'
    assert (streams.get(StreamRole.COMPUTE), streams.get(StreamRole.ALL_GATHER)) == ("compute", "side0")
    shared = StreamSet(_Backend(), side=SideStreams.SHARED)
    assert shared.get(StreamRole.ALL_GATHER) == shared.get(StreamRole.COMPUTE) == "compute"


def test_record_current_marks_the_current_stream() -> None:
    backend = _Backend()
    backend.current = "copy"
    assert record_current(backend).recorded_on == "copy"


def test_record_current_defaults_to_the_accelerator() -> None:
    event = record_current()
    assert event.query()  # the CPU accelerator's events are complete at once
    event.synchronize()


class _SwitchingBackend(_Backend):
    """Records every stream switch and keeps ``current`` true to it."""

    def __init__(self) -> None:
        super().__init__()
        self.switches: list[str] = []

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Any:
        self.switches.append(stream)
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous


def test_use_switches_only_when_the_stream_changes() -> None:
    """Asking for the stream the thread is on costs no switch; nested blocks switch and switch back."""
    backend = _SwitchingBackend()
    streams = StreamSet(backend)
    with streams.use(StreamRole.COMPUTE):
        assert backend.switches == [] and streams.current_role() is StreamRole.COMPUTE
    with streams.use(StreamRole.ALL_GATHER):
        assert backend.current == "side0" and streams.current_role() is StreamRole.ALL_GATHER
        with streams.use(StreamRole.ALL_GATHER):
            pass  # already there
        with streams.use(StreamRole.COMPUTE):
            assert backend.current == "compute" and streams.current_role() is StreamRole.COMPUTE
        assert backend.current == "side0" and streams.current_role() is StreamRole.ALL_GATHER
    assert backend.current == "compute" and streams.current_role() is StreamRole.COMPUTE
    assert backend.switches == ["side0", "compute"]
    shared = _SwitchingBackend()
    one = StreamSet(shared, side=SideStreams.SHARED)
    with one.use(StreamRole.ALL_GATHER):
        pass
    assert shared.switches == []  # one stream for every role: nothing to switch


def test_use_tracks_each_thread_on_its_own() -> None:
    """The autograd engine runs backward hooks on its own thread, which starts on the compute stream."""
    import threading

    streams = StreamSet(_SwitchingBackend())
    seen: list[StreamRole] = []
    with streams.use(StreamRole.ALL_GATHER):
        worker = threading.Thread(target=lambda: seen.append(streams.current_role()))
        worker.start()
        worker.join()
        assert streams.current_role() is StreamRole.ALL_GATHER
    assert seen == [StreamRole.COMPUTE]
