"""Activation offload of checkpointed inputs: same gradients, the inputs' storage released, a bounded reused pool,
and the event protocol of the side-stream copies ([Note: activation offload])."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import pytest
import torch

from deepspeed._core.engine import activation_checkpoint as core
from deepspeed._core.engine.activation_offload import (
    ActivationOffloader,
    CopyStreams,
    HostMemory,
    PinnedHostPool,
)
from deepspeed.runtime.activation_checkpointing import checkpointing as ck

LAYERS, WIDTH = 5, 16


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> core.ActivationCheckpointState:
    state = core.ActivationCheckpointState()
    monkeypatch.setattr(core, "_STATE", state)
    return state


def _layers() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(LAYERS)
    )


def _step(layers: torch.nn.ModuleList, mode: str, refs: list | None = None) -> list[torch.Tensor]:
    """Forward (checkpointed per layer unless ``mode == "plain"``) and backward; returns every gradient."""
    torch.manual_seed(1)
    x = torch.randn(4, WIDTH, requires_grad=True)
    h = x
    for layer in layers:
        if refs is not None:
            refs.append(weakref.ref(h))
        if mode == "plain":
            h = layer(h)
        elif mode == "reentrant":
            h = ck.checkpoint(layer, h)
        else:
            h = ck.non_reentrant_checkpoint(layer, h)
    if refs is not None:
        # The layer inputs after x that are still referenced now, and the device bytes the offloader holds.
        refs.append(sum(r() is not None for r in refs[1:]))
        offloader = core.current_state()._offloader
        refs.append(0 if offloader is None else offloader.resident_bytes())
    h.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_offloaded_checkpoints_give_identical_gradients_and_release_inputs(
    fresh_state: core.ActivationCheckpointState, mode: str
) -> None:
    layers = _layers()
    expected = _step(layers, "plain")
    ck.configure(None)
    kept_refs: list[Any] = []
    baseline = _step(layers, mode, kept_refs)
    ck.configure(None, checkpoint_in_cpu=True)
    refs: list[Any] = []
    offloaded = _step(layers, mode, refs)
    for a, b, c in zip(expected, baseline, offloaded, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    # Without offload every layer input after x stays referenced until backward. With it none is: the storage of
    # all but the last input is gone, and the offloader holds that last one (backward needs it first).
    assert kept_refs[-2] == LAYERS - 1
    assert refs[-2] == 0
    assert refs[-1] == 4 * WIDTH * 4
    stats = fresh_state.offloader().stats
    assert stats.offloaded_tensors == stats.restored_tensors == LAYERS - 1  # x (layer 0's input) included
    assert stats.kept_last_tensors == 1
    assert stats.offloaded_bytes == (LAYERS - 1) * 4 * WIDTH * 4


def test_pool_is_bounded_and_reused_across_steps(fresh_state: core.ActivationCheckpointState) -> None:
    layers = _layers()
    expected = _step(layers, "plain")
    ck.configure(None, checkpoint_in_cpu=True)
    pool = fresh_state.offloader().pool
    _step(layers, "reentrant")
    buffers = [id(b) for b in pool.buffers]
    # One step keeps at most LAYERS - 1 inputs on the host at once; backward returns each after its copy back.
    assert 0 < len(buffers) <= LAYERS - 1
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(expected, _step(layers, "reentrant"), strict=True))
    assert [id(b) for b in pool.buffers] == buffers  # the same buffers, not new pinned allocations
    pool.max_buffers = 2
    pool.release()
    assert all(torch.equal(a, b) for a, b in zip(expected, _step(layers, "reentrant"), strict=True))
    assert len(pool.buffers) <= 2
    assert fresh_state.offloader().stats.skipped_marked_tensors > 0  # inputs that found no buffer stayed


def test_reset_drains_a_forward_without_backward(fresh_state: core.ActivationCheckpointState) -> None:
    layers = _layers()
    ck.configure(None, checkpoint_in_cpu=True)
    x = torch.randn(4, WIDTH, requires_grad=True)
    h = x
    for layer in layers:
        h = ck.checkpoint(layer, h)
    offloader = fresh_state.offloader()
    assert offloader.handles and len(offloader.pool.free) < len(offloader.pool.buffers)
    ck.reset()
    assert offloader.handles == [] and len(offloader.pool.free) == len(offloader.pool.buffers)


def test_in_place_edit_after_the_checkpoint_is_refused() -> None:
    layers = _layers()
    ck.configure(None, checkpoint_in_cpu=True)
    x = torch.randn(4, WIDTH, requires_grad=True)
    y = x * 1
    h = ck.checkpoint(layers[0], y)
    y.add_(1.0)  # y's copy is taken when the next checkpoint starts: the edit must not slip into it
    with pytest.raises(RuntimeError, match="modified in place"):
        ck.checkpoint(layers[1], h)


def test_pool_best_fit_and_bound() -> None:
    pool = PinnedHostPool(2, HostMemory.PAGEABLE)
    a, b = pool.take(5000), pool.take(100)
    assert a is not None and b is not None and pool.take(10) is None  # full and nothing free
    pool.give(a, None)
    pool.give(b, None)
    assert pool.take(50) is b  # the smallest that fits
    big = pool.take(100_000)  # nothing free fits and the pool is full: the largest free buffer is replaced
    assert big is not None and big.data.numel() >= 100_000 and len(pool.buffers) == 2


def test_a_longer_step_replaces_the_shorter_steps_buffers_instead_of_joining_them() -> None:
    offloader = ActivationOffloader(PinnedHostPool(8, HostMemory.PAGEABLE), 1, CopyStreams.COMPUTE)
    pool = offloader.pool

    def step(numel: int, count: int) -> None:
        handles = [offloader.stash(torch.full((numel,), float(i))) for i in range(count)]
        back = [offloader.fetch(h) for h in reversed(handles)]
        assert [float(t[0]) for t in back] == [float(i) for i in reversed(range(count))]

    step(1000, 4)  # three go to the host (the newest stays)
    short = {id(b) for b in pool.buffers}
    assert len(short) == 3
    step(1000, 4)
    assert {id(b) for b in pool.buffers} == short  # a steady state keeps (and reuses) its buffers
    step(50_000, 4)  # none of the short step's buffers fits: three larger ones are added, then the short ones go
    assert len(pool.buffers) == 3 and all(b.data.numel() >= 50_000 * 4 for b in pool.buffers)
    assert not short & {id(b) for b in pool.buffers}
    step(1000, 4)  # a shorter step again: the larger buffers serve it, nothing is added or retired
    assert len(pool.buffers) == 3 and all(b.data.numel() >= 50_000 * 4 for b in pool.buffers)


# ---------------------------------------------------------------------- event protocol with fake streams
class _Event:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream: Any) -> None:
        self.log.append(f"record {self.name} on {stream}")

    def synchronize(self) -> None:
        self.log.append(f"host waits {self.name}")

    def query(self) -> bool:
        return True


class _Stream:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: _Event) -> None:
        self.log.append(f"{self.name} waits {event.name}")

    def __str__(self) -> str:
        return self.name


class _Backend:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.compute, self.current = _Stream(self.log, "compute"), None
        self.events = 0

    def new_stream(self) -> _Stream:
        return _Stream(self.log, "side")

    def new_event(self) -> _Event:
        self.events += 1
        return _Event(self.log, f"e{self.events}")

    def current_stream(self) -> _Stream:
        return self.current or self.compute

    @contextlib.contextmanager
    def use_stream(self, stream: _Stream) -> Any:
        self.current, previous = stream, self.current
        self.log.append(f"enter {stream}")
        try:
            yield
        finally:
            self.current = previous


def test_copies_are_ordered_by_events_on_a_side_stream() -> None:
    backend = _Backend()
    offloader = ActivationOffloader(PinnedHostPool(4, HostMemory.PAGEABLE), 1, CopyStreams.SIDE, backend=backend)
    offloader.synchronized = False  # drive the asynchronous path with the fake streams
    offloader.side = backend.new_stream()
    tensors = [torch.full((8,), float(i)) for i in range(3)]
    released = [weakref.ref(t) for t in tensors]
    handles = [offloader.stash(t) for t in tensors]
    del tensors
    log = backend.log
    # The first tensor's copy: the side stream waits for the compute stream's event, copies, records its event.
    assert log[:4] == ["record e1 on compute", "side waits e1", "enter side", "record e2 on side"]
    # Its device storage is released at the next stash, after the compute stream was made to wait on the copy.
    assert "compute waits e2" in log and released[0]() is None
    assert released[2]() is not None  # the newest stays on the device
    back = [offloader.fetch(h) for h in reversed(handles)]
    assert [float(t[0]) for t in back] == [2.0, 1.0, 0.0]
    # Fetching the middle tensor prefetched the first: its host-to-device copy was queued before it was asked for.
    first_copy_back = max(i for i, line in enumerate(log) if line.startswith("enter side"))
    assert log.index("compute waits e2") < first_copy_back
    assert all(h.done for h in handles) and offloader.handles == []
