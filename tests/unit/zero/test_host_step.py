"""The overlapped host step's worker rounds each stepped range into a staging buffer; the caller only publishes."""

from __future__ import annotations

import threading

import pytest
import torch

from deepspeed._core.comm.pinned_pool import Pinning
from deepspeed._core.optim.chunked_step import ChunkStepper
from deepspeed._core.optim.host_step import GroupStep, Handoff, OverlappedHostStep, StepRun, pool_for_step


def _update(rounded_by_worker: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, torch.Tensor, set]:
    gen = torch.Generator().manual_seed(3)
    masters = [torch.nn.Parameter(torch.randn(n, generator=gen), requires_grad=False) for n in (700, 260)]
    opt = torch.optim.AdamW([{"params": [m]} for m in masters], lr=1e-2)
    grads = [torch.randn(m.numel(), generator=gen).bfloat16() for m in masters]
    published: dict = {}
    rounding_threads: set = set()
    real_copy = torch.Tensor.copy_

    def watch_copy(dst: torch.Tensor, src: torch.Tensor, *a: object) -> torch.Tensor:
        if dst.dtype == torch.bfloat16 and src.dtype == torch.float32:
            rounding_threads.add(threading.current_thread().name)
        return real_copy(dst, src, *a)

    monkeypatch.setattr(torch.Tensor, "copy_", watch_copy)
    host = OverlappedHostStep(pool_for_step(256, Pinning.PAGEABLE))
    groups = []
    for index, grad in enumerate(grads):

        def publish(start: int, piece: torch.Tensor, index: int = index) -> None:
            published[(index, start)] = piece.clone()

        groups.append(GroupStep(ChunkStepper(opt, index, 256), grad, publish, torch.bfloat16))
    update = host.begin(groups, 0.5, rounded_by_worker=rounded_by_worker)
    update.submit_rest()
    update.publish()
    host.shutdown()
    monkeypatch.undo()
    return published, torch.cat([m.detach() for m in masters]), rounding_threads


def test_the_worker_rounds_and_the_caller_only_publishes(monkeypatch: pytest.MonkeyPatch) -> None:
    worker, worker_masters, worker_threads = _update(True, monkeypatch)
    caller, caller_masters, caller_threads = _update(False, monkeypatch)
    assert torch.equal(worker_masters, caller_masters)
    assert worker.keys() == caller.keys() and len(worker) == 3 + 2
    for key, piece in worker.items():
        assert torch.equal(piece, caller[key])
    assert all(name.startswith("ds-host-step") for name in worker_threads) and worker_threads
    assert caller_threads == {threading.current_thread().name}


def _failing_update(monkeypatch: pytest.MonkeyPatch, at: int) -> tuple[OverlappedHostStep, ChunkStepper, dict]:
    """A host step over one 1000-element master in 128-element ranges, whose range starting at ``at`` raises
    ``RuntimeError("range at AT failed")``; returns the host step, the stepper and the optimizer's state."""
    master = torch.nn.Parameter(torch.randn(1000), requires_grad=False)
    opt = torch.optim.AdamW([master], lr=1e-2)
    real = ChunkStepper.step_range

    def fail(self: ChunkStepper, start: int, *a: object, **k: object) -> None:
        if start == at:
            raise RuntimeError(f"range at {at} failed")
        real(self, start, *a, **k)

    monkeypatch.setattr(ChunkStepper, "step_range", fail)
    return OverlappedHostStep(pool_for_step(128, Pinning.PAGEABLE)), ChunkStepper(opt, 0, 128), opt.state


def test_a_failing_range_releases_a_worker_waiting_for_a_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller stops publishing when a range raises; a worker blocked on a staging buffer must still finish."""
    host, stepper, _ = _failing_update(monkeypatch, 0)
    update: StepRun = host.begin(
        [GroupStep(stepper, torch.zeros(1000), lambda s, p: None, torch.bfloat16)], 1.0, rounded_by_worker=True
    )
    update.submit_rest()
    with pytest.raises(RuntimeError, match="range at 0 failed"):
        update.publish()
    assert all(job.done() for *_, job in update.jobs)
    host.shutdown()


def test_an_update_of_no_groups_publishes_nothing() -> None:
    host = OverlappedHostStep(pool_for_step(64, Pinning.PAGEABLE))
    host.run([], 1.0)
    assert host.chunks_published == 0
    host.shutdown()


class _RecordingStreams:
    """A stream backend that logs, per thread, which stream is current and every wait and record."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.compute = self._Stream("compute", self.log)
        self._current = threading.local()

    class _Stream:
        def __init__(self, name: str, log: list) -> None:
            self.name, self.log = name, log

        def wait_event(self, event: object) -> None:
            self.log.append(("wait", self.name, event.name))  # type: ignore[attr-defined]

    class _Event:
        count = 0

        def __init__(self, log: list) -> None:
            self.log, self.name = log, None

        def record(self, stream: object) -> None:
            _RecordingStreams._Event.count += 1
            self.name = f"{stream.name}#{_RecordingStreams._Event.count}"  # type: ignore[attr-defined]
            self.log.append(("record", self.name))

        def synchronize(self) -> None:
            pass

    def new_stream(self) -> object:
        return self._Stream("side", self.log)

    def new_event(self) -> object:
        return self._Event(self.log)

    def current_stream(self) -> object:
        return getattr(self._current, "stream", self.compute)

    def use_stream(self, stream: object):
        import contextlib

        @contextlib.contextmanager
        def switch():
            previous = self.current_stream()
            self._current.stream = stream
            try:
                yield
            finally:
                self._current.stream = previous

        return switch()


@pytest.mark.parametrize("route", ["worker", "caller"])
def test_the_workers_device_work_runs_on_a_side_stream_ordered_by_the_hand_over(
    monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """[Note: worker stream]: a range's step runs with the side stream current, after that stream waited for the
    event recorded on the submitting thread's stream when the range was handed over; at the end the submitting
    thread's stream waits for the side stream before anything is freed there. The same holds for an update stepped
    on the caller's thread ([Note: update after the decision])."""
    from deepspeed._core.comm.streams import WorkerStream

    streams = _RecordingStreams()
    master = torch.nn.Parameter(torch.randn(300), requires_grad=False)
    opt = torch.optim.AdamW([master], lr=1e-2)
    host = OverlappedHostStep(pool_for_step(128, Pinning.PAGEABLE))
    host.device_work = WorkerStream(streams)
    real = ChunkStepper.step_range

    def logged(self: ChunkStepper, start: int, *a: object, **k: object) -> None:
        streams.log.append(("step", start, streams.current_stream().name))
        real(self, start, *a, **k)

    monkeypatch.setattr(ChunkStepper, "step_range", logged)
    group = GroupStep(ChunkStepper(opt, 0, 128), torch.zeros(300), lambda s, p: None, torch.bfloat16)
    if route == "worker":
        update = host.begin([group], 1.0)
        update.submit_rest()
        update.publish()
    else:
        host.run([group], 1.0)
    host.shutdown()
    log = streams.log
    steps = [e for e in log if e[0] == "step"]
    assert [s[1] for s in steps] == [0, 128, 256] and all(s[2] == "side" for s in steps), log
    hand_overs = [e[1] for e in log if e[0] == "record" and e[1].startswith("compute")]
    for start, event in zip([0, 128, 256], hand_overs[:3], strict=True):
        # the side stream waited for that range's hand-over event before the range stepped
        assert log.index(("wait", "side", event)) < log.index(("step", start, "side")), log
    last_side = [e[1] for e in log if e[0] == "record" and e[1].startswith("side")][-1]
    assert log[-1] == ("wait", "compute", last_side), log


def _update_seeing_interval(short: bool, fail: bool = False) -> list[float]:
    """Run one update whose worker records the switch interval it sees before each range."""
    import sys

    master = torch.nn.Parameter(torch.randn(600), requires_grad=False)
    opt = torch.optim.AdamW([master], lr=1e-2)
    handoff = Handoff.SHORT_SWITCH if short else Handoff.DEFAULT
    host = OverlappedHostStep(pool_for_step(128, Pinning.PAGEABLE), handoff)
    seen: list[float] = []

    def log(what: str, group: int, start: int) -> None:
        seen.append(sys.getswitchinterval())
        if fail and start == 256:
            raise RuntimeError("range failed")

    host.log = log
    update = host.begin([GroupStep(ChunkStepper(opt, 0, 128), torch.zeros(600), lambda s, p: None, torch.float32)], 1.0)
    update.submit_rest()
    try:
        update.publish()
    finally:
        host.shutdown()
    return seen


def test_the_switch_interval_is_short_while_the_worker_steps_and_restored_after() -> None:
    import sys

    from deepspeed._core.optim.host_step import HANDOFF_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    assert before > HANDOFF_SWITCH_INTERVAL_S  # the interpreter's default, 5 ms
    seen = _update_seeing_interval(short=True)
    assert len(seen) == 5 and all(v == pytest.approx(HANDOFF_SWITCH_INTERVAL_S) for v in seen)
    assert sys.getswitchinterval() == before
    assert _update_seeing_interval(short=False) == [before] * 5  # the switch off leaves it alone
    with pytest.raises(RuntimeError, match="range failed"):
        _update_seeing_interval(short=True, fail=True)
    assert sys.getswitchinterval() == before  # also restored when a range raises


def test_two_updates_in_flight_restore_the_interval_once_both_end() -> None:
    import sys

    from deepspeed._core.optim.host_step import HANDOFF_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    masters = [torch.nn.Parameter(torch.randn(300), requires_grad=False) for _ in range(2)]
    hosts = [OverlappedHostStep(pool_for_step(128, Pinning.PAGEABLE)) for _ in masters]
    runs = []
    for host, master in zip(hosts, masters, strict=True):
        opt = torch.optim.AdamW([master], lr=1e-2)
        step = GroupStep(ChunkStepper(opt, 0, 128), torch.zeros(300), lambda s, p: None, torch.float32)
        runs.append(host.begin([step], 1.0))
        runs[-1].submit_rest()
    runs[0].publish()
    assert sys.getswitchinterval() == pytest.approx(HANDOFF_SWITCH_INTERVAL_S)  # the second is still in flight
    runs[1].publish()
    assert sys.getswitchinterval() == before
    for host in hosts:
        host.shutdown()


def test_shutdown_ends_an_open_update_and_restores_the_interval() -> None:
    """An update begun and never published (an error between the backward and the step) ends with the engine."""
    import sys

    from deepspeed._core.optim.host_step import HANDOFF_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    master = torch.nn.Parameter(torch.randn(300), requires_grad=False)
    opt = torch.optim.AdamW([master], lr=1e-2)
    host = OverlappedHostStep(pool_for_step(128, Pinning.PAGEABLE))
    run = host.begin([GroupStep(ChunkStepper(opt, 0, 128), torch.zeros(300), lambda s, p: None, torch.float32)], 1.0)
    run.submit(0, 0, 128)
    assert sys.getswitchinterval() == pytest.approx(HANDOFF_SWITCH_INTERVAL_S)
    host.shutdown()
    assert sys.getswitchinterval() == before
    assert opt.state[master]  # the stepper was closed: the state is back in the optimizer


def _groups(published: dict, seed: int = 3) -> tuple[list[GroupStep], list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    masters = [torch.nn.Parameter(torch.randn(n, generator=gen), requires_grad=False) for n in (700, 260)]
    opt = torch.optim.AdamW([{"params": [m]} for m in masters], lr=1e-2)
    groups = []
    for index, master in enumerate(masters):
        grad = torch.randn(master.numel(), generator=gen).bfloat16()

        def publish(start: int, piece: torch.Tensor, index: int = index) -> None:
            published[(index, start)] = piece.clone()

        groups.append(GroupStep(ChunkStepper(opt, index, 256), grad, publish, torch.bfloat16))
    return groups, masters


def test_an_update_after_the_decision_steps_on_the_callers_thread() -> None:
    """run() (the whole update after the global decision) steps every chunk on the caller's thread, starts no
    worker, and gives the same masters and the same published pieces as the worker's route."""
    stepped_on: set = set()
    here: dict = {}
    host = OverlappedHostStep(pool_for_step(256, Pinning.PAGEABLE))
    host.log = lambda what, group, start: stepped_on.add(threading.current_thread().name)
    groups, masters = _groups(here)
    host.run(groups, 0.5)
    assert host._worker is None and stepped_on == {threading.current_thread().name}
    assert host.chunks_published == 3 + 2
    assert not host.pool._taken  # both staging buffers are back in the pool

    worker: dict = {}
    other = OverlappedHostStep(pool_for_step(256, Pinning.PAGEABLE))
    groups2, masters2 = _groups(worker)
    update = other.begin(groups2, 0.5, rounded_by_worker=True)
    update.submit_rest()
    update.publish()
    other.shutdown()
    assert torch.equal(torch.cat([m.detach() for m in masters]), torch.cat([m.detach() for m in masters2]))
    assert list(here) == list(worker)  # the same ranges, published in the same order
    for key, piece in here.items():
        assert torch.equal(piece, worker[key]), key


def test_a_range_failing_on_the_callers_thread_closes_the_update(monkeypatch: pytest.MonkeyPatch) -> None:
    host, stepper, state = _failing_update(monkeypatch, 256)
    with pytest.raises(RuntimeError, match="range at 256 failed"):
        host.run([GroupStep(stepper, torch.zeros(1000), lambda s, p: None, torch.bfloat16)], 1.0)
    assert not host._open and state  # the update ended and its stepper was closed (the state is back)
    assert not host.pool._taken
