"""The worker stream on real streams ([Note: worker stream]): a host worker's copies see what the submitting thread's
stream wrote before the hand-over, even while that stream is still busy, and after ``join`` the submitting stream
sees the worker's."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from deepspeed._core.comm.streams import WorkerStream, record_current
from deepspeed.accelerator import get_accelerator

pytestmark = pytest.mark.gpu

SPIN_CYCLES = 200_000_000  # keeps the compute stream busy for tens of milliseconds


def _on_worker(fn: Callable[[], None]) -> None:
    device = get_accelerator().current_device()
    errors: list[BaseException] = []

    def run() -> None:
        get_accelerator().set_device(device)
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def test_a_workers_copy_waits_for_what_was_written_before_the_hand_over() -> None:
    device = torch.device(get_accelerator().current_device_name())
    grad = torch.zeros(1 << 20, device=device)
    host = torch.empty(grad.numel(), pin_memory=True)
    work = WorkerStream()
    torch.cuda._sleep(SPIN_CYCLES)  # the compute stream is still busy when the worker starts
    grad.fill_(7.0)
    ready = work.mark()

    def copy_down() -> None:
        with work.after(ready):
            host.copy_(grad, non_blocking=True)
            record_current().synchronize()

    _on_worker(copy_down)
    assert torch.all(host == 7.0)
    work.join()


def test_join_orders_the_submitting_stream_after_the_workers_copies() -> None:
    device = torch.device(get_accelerator().current_device_name())
    target = torch.zeros(1 << 20, device=device)
    source = torch.full((target.numel(),), 3.0).pin_memory()
    work = WorkerStream()
    ready = work.mark()

    def copy_up() -> None:
        with work.after(ready):
            torch.cuda._sleep(SPIN_CYCLES)  # on the side stream: the copy lands late
            target.copy_(source, non_blocking=True)

    _on_worker(copy_up)
    work.join()
    assert float(target.sum()) == 3.0 * target.numel()  # read on the submitting thread's stream
