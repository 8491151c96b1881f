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
