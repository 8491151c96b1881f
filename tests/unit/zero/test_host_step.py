"""The overlapped host step's worker rounds each stepped range into a staging buffer; the caller only publishes."""

from __future__ import annotations

import threading

import pytest
import torch

from deepspeed._core.comm.pinned_pool import Pinning
from deepspeed._core.optim.chunked_step import ChunkStepper
from deepspeed._core.optim.host_step import GroupStep, OverlappedHostStep, StepRun, pool_for_step


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


def test_a_failing_range_releases_a_worker_waiting_for_a_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller stops publishing when a range raises; a worker blocked on a staging buffer must still finish."""
    master = torch.nn.Parameter(torch.randn(1000), requires_grad=False)
    opt = torch.optim.AdamW([master], lr=1e-2)
    host = OverlappedHostStep(pool_for_step(128, Pinning.PAGEABLE))
    stepper = ChunkStepper(opt, 0, 128)
    real = ChunkStepper.step_range

    def fail_first(self: ChunkStepper, start: int, *a: object, **k: object) -> None:
        if start == 0:
            raise RuntimeError("range 0 failed")
        real(self, start, *a, **k)

    monkeypatch.setattr(ChunkStepper, "step_range", fail_first)
    update: StepRun = host.begin(
        [GroupStep(stepper, torch.zeros(1000), lambda s, p: None, torch.bfloat16)], 1.0, rounded_by_worker=True
    )
    update.submit_rest()
    with pytest.raises(RuntimeError, match="range 0 failed"):
        update.publish()
    assert all(job.done() for *_, job in update.jobs)
    host.shutdown()


def test_an_update_of_no_groups_publishes_nothing() -> None:
    host = OverlappedHostStep(pool_for_step(64, Pinning.PAGEABLE))
    host.run([], 1.0)
    assert host.chunks_published == 0
    host.shutdown()
