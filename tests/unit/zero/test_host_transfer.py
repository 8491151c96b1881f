"""Event-ordered host transfers fold exactly once, in order, with the requested semantics."""
from __future__ import annotations

import torch

from deepspeed._core.zero.host_transfer import Fold, HostTransfers


def test_submissions_fold_only_on_drain() -> None:
    target = torch.zeros(6)
    transfers = HostTransfers()
    transfers.submit(target[:3], torch.tensor([1.0, 2.0, 3.0]), Fold.ADD)
    transfers.submit(target[:3], torch.tensor([1.0, 1.0, 1.0]), Fold.ADD)
    transfers.submit(target[3:], torch.tensor([7.0, 8.0, 9.0], dtype=torch.bfloat16), Fold.COPY)
    assert torch.count_nonzero(target) == 0  # nothing lands before drain
    transfers.drain()
    assert target.tolist() == [2.0, 3.0, 4.0, 7.0, 8.0, 9.0]
    assert not transfers.pending
    transfers.drain()  # idempotent once empty
    assert target.tolist() == [2.0, 3.0, 4.0, 7.0, 8.0, 9.0]


def test_source_can_be_reused_right_after_submit() -> None:
    target = torch.zeros(2)
    source = torch.tensor([5.0, 6.0])
    transfers = HostTransfers()
    transfers.submit(target, source, Fold.ADD)
    source.fill_(-1.0)  # the staging copy, not the source, is what gets folded
    transfers.drain()
    assert target.tolist() == [5.0, 6.0]
