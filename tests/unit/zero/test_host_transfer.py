"""Host transfers through the bounded staging ring: folded exactly once, in order, with bounded memory."""

from __future__ import annotations

import torch

from deepspeed._core.comm.host_transfer import Fold, HostTransfers, Staging, slot_bytes_for


def test_submissions_fold_only_on_drain() -> None:
    target = torch.zeros(6)
    transfers = HostTransfers(slots=4, staging=Staging.ALWAYS)
    transfers.submit(target[:3], torch.tensor([1.0, 2.0, 3.0]), Fold.ADD)
    transfers.submit(target[:3], torch.tensor([1.0, 1.0, 1.0]), Fold.ADD)
    transfers.submit(target[3:], torch.tensor([7.0, 8.0, 9.0], dtype=torch.bfloat16), Fold.COPY)
    assert torch.count_nonzero(target) == 0  # nothing lands before drain while slots are free
    transfers.drain()
    assert target.tolist() == [2.0, 3.0, 4.0, 7.0, 8.0, 9.0]
    assert not transfers.pending
    transfers.drain()  # idempotent once empty
    assert target.tolist() == [2.0, 3.0, 4.0, 7.0, 8.0, 9.0]


def test_source_can_be_reused_right_after_submit() -> None:
    target = torch.zeros(2)
    source = torch.tensor([5.0, 6.0])
    transfers = HostTransfers(staging=Staging.ALWAYS)
    transfers.submit(target, source, Fold.ADD)
    source.fill_(-1.0)  # the staging copy, not the source, is what gets folded
    transfers.drain()
    assert target.tolist() == [5.0, 6.0]


def test_ring_is_bounded_and_folds_oldest_first_when_full() -> None:
    """Twenty submissions through 2 slots: never more than 2 in flight, staging memory fixed, sums exact."""
    target = torch.zeros(1024)
    transfers = HostTransfers(slot_bytes=4096, slots=2, staging=Staging.ALWAYS)
    expected = torch.zeros(1024)
    for i in range(20):
        piece = torch.full((1024,), float(i))
        expected += piece
        transfers.submit(target, piece, Fold.ADD)
        assert len(transfers.pending) <= 2
        assert transfers.pinned_bytes == 2 * 4096
    transfers.drain()
    assert torch.equal(target, expected)


def test_pieces_larger_than_a_slot_are_split() -> None:
    target = torch.zeros(5000, dtype=torch.float32)
    source = torch.arange(5000, dtype=torch.bfloat16)
    transfers = HostTransfers(slot_bytes=4096, slots=2, staging=Staging.ALWAYS)  # 2048 bf16 values a slot
    transfers.submit(target, source, Fold.COPY)
    transfers.drain()
    assert torch.equal(target, source.float())
    assert transfers.pinned_bytes == 2 * 4096


def test_direct_copies_take_no_slot_and_keep_submission_order() -> None:
    """A direct copy between ring submissions: the ring still waits in order, and only slots bound it."""
    target = torch.zeros(6)
    transfers = HostTransfers(slot_bytes=4096, slots=1, staging=Staging.ALWAYS)
    transfers.submit(target[:2], torch.tensor([1.0, 1.0]), Fold.ADD)
    transfers.submit_direct(target[2:4], torch.tensor([5.0, 6.0]))
    transfers.submit_direct(target[4:], torch.tensor([7.0, 8.0]))
    assert len(transfers.pending) == 3 and transfers.pinned_bytes == 4096
    transfers.submit(target[:2], torch.tensor([2.0, 2.0]), Fold.ADD)  # the one slot: the oldest completes first
    assert target[:2].tolist() == [1.0, 1.0] and len(transfers.pending) == 3  # only the slot-holder completed
    transfers.drain()
    assert target.tolist() == [3.0, 3.0, 5.0, 6.0, 7.0, 8.0]
    transfers.submit_direct(target[:2], torch.tensor([9.0, 9.0]))
    transfers.discard()  # a direct copy has no slot to return
    assert transfers.pinned_bytes == 4096 and not transfers.pending


def test_discard_returns_slots_without_folding() -> None:
    target = torch.zeros(4)
    transfers = HostTransfers(slot_bytes=4096, slots=1, staging=Staging.ALWAYS)
    transfers.submit(target, torch.ones(4), Fold.ADD)
    transfers.discard()
    assert torch.count_nonzero(target) == 0
    transfers.submit(target, torch.ones(4), Fold.ADD)  # the slot is usable again
    transfers.drain()
    assert target.tolist() == [1.0] * 4
    transfers.release()
    assert transfers.pinned_bytes == 0


def test_host_pieces_fold_at_once_by_default() -> None:
    target = torch.zeros(3)
    transfers = HostTransfers()
    transfers.submit(target, torch.ones(3), Fold.ADD)
    assert target.tolist() == [1.0, 1.0, 1.0]
    assert transfers.pinned_bytes == 0  # nothing staged, nothing pinned


def test_slot_size_is_a_power_of_two_with_a_cap() -> None:
    assert slot_bytes_for(1000) == 4096
    assert slot_bytes_for(5000) == 8192
    assert slot_bytes_for(10**12) == 1 << 26
