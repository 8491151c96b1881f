"""Pipeline-engine pieces that need no process group: p2p metadata, activation slots and their release policy,
the data contract."""

from __future__ import annotations

import gc

import pytest
import torch

from deepspeed._core.pipe.buffers import ActivationLedger, ReleasePolicy, StageBuffers, StagePosition
from deepspeed._core.pipe.data import DataFeed, check_item
from deepspeed._core.pipe.p2p import Payload, TensorMeta, as_tensors


@pytest.mark.parametrize(
    "value",
    [
        torch.zeros(3, 5, 7),
        (torch.zeros(2, 4, dtype=torch.bfloat16, requires_grad=True), torch.ones(2, 4, dtype=torch.bool)),
        [torch.zeros(1), torch.zeros((), dtype=torch.int64), torch.zeros(1, 2, 3, 4, 5, 6, 7, 8, dtype=torch.float16)],
    ],
)
def test_payload_round_trips_through_its_packed_form(value: object) -> None:
    payload = Payload.of(value)
    packed = payload.pack()
    assert packed.dtype == torch.int64 and packed.numel() == 256  # fixed length: the receiver posts it blindly
    assert Payload.unpack(packed) == payload
    assert payload.is_tuple == (not isinstance(value, torch.Tensor))


def test_only_floating_tensors_in_a_graph_ask_for_a_gradient() -> None:
    x = torch.zeros(2, requires_grad=True)
    assert TensorMeta.of(x * 2).requires_grad
    assert not TensorMeta.of(torch.zeros(2)).requires_grad
    assert not TensorMeta.of(torch.zeros(2, dtype=torch.long)).requires_grad


@pytest.mark.parametrize("value", [None, 3, (), (torch.zeros(1), "mask"), {"h": torch.zeros(1)}])
def test_a_stage_output_that_cannot_travel_is_a_clear_error(value: object) -> None:
    with pytest.raises(TypeError, match="a pipeline stage must output a tensor or a non-empty tuple of tensors"):
        as_tensors(value)


def test_too_large_a_description_is_refused() -> None:
    with pytest.raises(ValueError, match="too large to describe"):
        Payload.of(tuple(torch.zeros(*([1] * 8)) for _ in range(40))).pack()


def _fill(buffers: StageBuffers, buffer_id: int, micro_batch: int) -> list:
    slot = buffers.start(buffer_id, micro_batch)
    slot.inputs, slot.outputs = torch.zeros(4), torch.ones(4)
    buffers.ledger.track(micro_batch, slot.inputs)
    buffers.ledger.track(micro_batch, slot.outputs)
    return [slot.inputs, slot.outputs]


@pytest.mark.parametrize(
    "policy, live_after",
    [(ReleasePolicy.AFTER_BACKWARD, [0, 0, 0]), (ReleasePolicy.RETAIN_LAST_STAGE_OUTPUTS, [1, 2, 3])],
)
def test_last_stage_release_policy(policy: ReleasePolicy, live_after: list[int]) -> None:
    buffers = StageBuffers(1, policy.for_stage(StagePosition.LAST))
    seen = []
    for mb in range(3):
        _fill(buffers, 0, mb)
        buffers.after_backward(0, has_upstream=True)
        buffers.release(0)  # input gradient sent
        gc.collect()
        seen.append(len(buffers.ledger.live()))
    assert seen == live_after
    buffers.end_step()
    assert buffers.ledger.live() == [] and buffers.held_micro_batches() == 0


def test_only_the_last_stage_retains_outputs() -> None:
    retain = ReleasePolicy.RETAIN_LAST_STAGE_OUTPUTS
    assert retain.for_stage(StagePosition.LAST) is retain
    assert retain.for_stage(StagePosition.EARLIER) is ReleasePolicy.AFTER_BACKWARD
    buffers = StageBuffers(1, retain.for_stage(StagePosition.EARLIER))
    _fill(buffers, 0, 0)
    buffers.after_backward(0, has_upstream=True)
    buffers.release(0)
    gc.collect()
    assert buffers.retained == [] and buffers.ledger.live() == []


def test_inputs_stay_until_their_gradient_is_sent() -> None:
    buffers = StageBuffers(2, ReleasePolicy.AFTER_BACKWARD.for_stage(StagePosition.EARLIER))
    _fill(buffers, 0, 0)
    buffers.after_backward(0, has_upstream=True)
    assert buffers[0].outputs is None and buffers[0].inputs is not None
    assert buffers.ledger.live() == [0]
    buffers.release(0)
    assert buffers.ledger.live() == []
    _fill(buffers, 1, 1)
    buffers.after_backward(1, has_upstream=False)  # first stage: nothing to send back
    assert buffers.ledger.live() == [] and buffers.held_micro_batches() == 0


def test_reusing_a_busy_buffer_is_a_schedule_bug() -> None:
    buffers = StageBuffers(1, ReleasePolicy.AFTER_BACKWARD.for_stage(StagePosition.EARLIER))
    _fill(buffers, 0, 0)
    with pytest.raises(RuntimeError, match="still holds micro-batch 0 when micro-batch 1 needs it"):
        buffers.start(0, 1)


def test_ledger_sees_references_held_elsewhere() -> None:
    ledger = ActivationLedger()
    kept = torch.zeros(2)
    ledger.track(0, (kept, torch.zeros(2)))
    ledger.track(1, torch.zeros(2))
    assert ledger.live() == [0] and ledger.observe() == 1 and ledger.peak == 1


@pytest.mark.parametrize(
    "item, message",
    [
        (torch.zeros(3), "must yield \\(inputs, labels\\) pairs .* got a Tensor"),
        ((torch.zeros(3),), "got a tuple of length 1"),
        (("text", torch.zeros(3)), "inputs must be a tensor or a tuple of tensors, got str"),
    ],
)
def test_data_contract(item: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_item(item)


def test_data_feed_reads_and_checks_the_whole_batch_up_front() -> None:
    items = [(torch.zeros(1), torch.ones(1)), (torch.ones(1), torch.zeros(1)), (torch.ones(1), torch.ones(1))]
    it = iter(items)
    feed = DataFeed(it, batch_fn=None, reads=2)
    assert feed.prime() is None
    assert next(it) is items[2]  # exactly the batch's micro-batches were consumed
    assert feed.next()[0].item() == 0 and feed.next()[0].item() == 1
    with pytest.raises(RuntimeError, match="schedule bug"):
        feed.next()
    late_bad = DataFeed(iter([items[0], torch.zeros(1)]), None, reads=2)
    assert "must yield (inputs, labels)" in late_bad.prime()  # a bad second item is found before any transfer
    assert "exhausted" in DataFeed(iter([items[0]]), None, 2).prime()
    assert "no data iterator was given" in DataFeed(None, None, 1).prime()
    assert DataFeed(None, None, reads=0).prime() is None  # a middle stage reads nothing
    doubled = DataFeed(iter([torch.zeros(2)]), batch_fn=lambda t: (t, t), reads=1)
    assert doubled.prime() is None  # batch_fn runs before the contract is checked
