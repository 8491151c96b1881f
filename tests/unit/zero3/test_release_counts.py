"""Gathered units alive at module boundaries under a deliberately slow (lagging) compute stream.

World size 1 needs no process group, and the stream backend is injected: every event stays "not complete" until
the fake device has seen ``lag`` more events recorded after it, i.e. the GPU is ``lag`` events behind the CPU.
Stream-ordered release must not care; the deferred (record_stream-like) baseline must hold more and more.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.comm.streams import StreamSet
from deepspeed._core.config.plan import LeanPolicy, Stage3Policy
from deepspeed._core.params.manager import ZeroParamManager
from deepspeed._core.params.param import ShardedState

LAYERS = 8
WIDTH = 16
UNIT = WIDTH * WIDTH + WIDTH


class _Device:
    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.recorded = 0


class _Event:
    def __init__(self, device: _Device) -> None:
        self.device = device
        self.seq: int | None = None

    def record(self, stream: Any = None) -> None:
        self.device.recorded += 1
        self.seq = self.device.recorded

    def query(self) -> bool:
        return self.seq is not None and self.seq + self.device.lag <= self.device.recorded

    def synchronize(self) -> None:
        pass


class _Stream:
    def wait_event(self, event: Any) -> None:
        pass


class LaggingBackend:
    """Fake StreamBackend whose events complete only ``lag`` recorded events later."""

    def __init__(self, lag: int) -> None:
        self.device = _Device(lag)
        self.compute = _Stream()

    def new_stream(self) -> _Stream:
        return _Stream()

    def new_event(self) -> _Event:
        return _Event(self.device)

    def current_stream(self) -> _Stream:
        return self.compute

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _run(lean: bool, prefetch: int, lag: int, steps: int = 3) -> tuple[ZeroParamManager, list[float]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    policy = Stage3Policy(prefetch_bucket_size=prefetch, param_persistence_threshold=0)
    manager = ZeroParamManager(
        model, ShardGroup(None, 0, 1), policy, LeanPolicy(stream_ordered_release=lean), StreamSet(LaggingBackend(lag))
    )
    manager.boundary_samples = []
    losses = []
    x = torch.randn(4, WIDTH)
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.item())
    return manager, losses


@pytest.mark.parametrize("prefetch_units", [0, 1, 2])
def test_stream_ordered_release_is_bounded_by_the_prefetch_window(prefetch_units: int) -> None:
    manager, _ = _run(True, prefetch_units * UNIT, lag=10**6)
    samples = manager.boundary_samples
    assert samples and max(s.units_active for s in samples) == 1
    excess = max(s.units_alive - s.units_active for s in samples)
    assert excess <= prefetch_units
    assert max(s.units_alive for s in samples) <= 1 + prefetch_units
    if prefetch_units:
        assert excess == prefetch_units  # the prefetcher really did run ahead, and no further
    manager.destroy()


def test_deferred_baseline_grows_with_host_run_ahead() -> None:
    lagging, losses = _run(False, 0, lag=10**6)
    caught_up, _ = _run(False, 0, lag=0)
    assert max(s.units_alive for s in caught_up.boundary_samples) == 1
    assert max(s.units_alive for s in lagging.boundary_samples) == LAYERS  # everything held until the GPU catches up
    lean, lean_losses = _run(True, 0, lag=10**6)
    assert losses == lean_losses
    for manager in (lagging, caught_up, lean):
        manager.destroy()
        assert all(s.state is ShardedState.SHARDED and not s.holds_memory for s in manager.states.values())


def test_nothing_gathered_after_backward_or_eval_and_destroy_removes_hooks() -> None:
    manager, _ = _run(True, UNIT, lag=0)
    assert manager.count_gathered().params_alive == 0
    with torch.no_grad():
        manager.module(torch.randn(2, WIDTH))
    assert manager.count_gathered().params_alive == 0
    model = manager.module
    manager.destroy()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
