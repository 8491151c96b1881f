"""Per-micro-batch activation slots of one pipeline stage, and when they are released.

How long activations live ([Note: pipeline activation release] in ``docs/design/pipeline_engine.md``): under
the 1F1B schedule stage ``s`` of ``P`` has at most ``min(P - s, G)`` micro-batches between their forward and their
backward, so that is all it has to hold. A slot keeps a micro-batch's inputs (received or loaded), its outputs
and, on the last stage, its labels and loss graph, and is emptied by :meth:`StageBuffers.release` right after
that micro-batch's backward has run and its input gradients have been sent.
``ReleasePolicy.RETAIN_LAST_STAGE_OUTPUTS`` reproduces upstream's behaviour for A/B runs: the last stage keeps every
micro-batch's outputs until the step ends, so its activation memory grows with ``gradient_accumulation_steps``.
Whatever the policy, :meth:`StageBuffers.end_step` empties everything, also after an fp16-overflow-skipped step.

:class:`ActivationLedger` counts, through weak references, which micro-batches still have a live activation
tensor anywhere in the process, so tests measure what is really alive, not what the slots claim.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch


class ReleasePolicy(enum.Enum):
    """When the last stage lets go of a micro-batch's outputs (``zero_optimization.lean_pipeline_release``)."""

    AFTER_BACKWARD = "after_backward"  # lean: every stage frees a micro-batch once its backward has run
    RETAIN_LAST_STAGE_OUTPUTS = "retain_last_stage_outputs"  # upstream: the last stage keeps them until step end

    @staticmethod
    def from_switch(lean_pipeline_release: bool) -> ReleasePolicy:
        """The policy for the config switch."""
        return ReleasePolicy.AFTER_BACKWARD if lean_pipeline_release else ReleasePolicy.RETAIN_LAST_STAGE_OUTPUTS

    def for_stage(self, position: StagePosition) -> ReleasePolicy:
        """The policy one stage follows: only the last stage (which computes the loss) retains outputs."""
        return self if position is StagePosition.LAST else ReleasePolicy.AFTER_BACKWARD


class StagePosition(enum.Enum):
    """Whether a pipeline stage is the last one, which computes the loss."""

    LAST = "last"
    EARLIER = "earlier"


@dataclass
class Slot:
    """One micro-batch in flight on this stage."""

    micro_batch: int = -1
    inputs: Any = None
    labels: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None
    grads: list[torch.Tensor | None] | None = None  # received gradients of ``outputs`` (not on the last stage)

    def clear(self) -> None:
        """Drop every reference this slot holds."""
        self.micro_batch, self.inputs, self.labels = -1, None, None
        self.outputs, self.loss, self.grads = None, None, None


@dataclass
class ActivationLedger:
    """Weak references to every activation tensor of the current step, by micro-batch."""

    refs: dict[int, list[weakref.ref]] = field(default_factory=dict)
    peak: int = 0

    def track(self, micro_batch: int, value: Any) -> None:
        """Remember the tensors in ``value`` (a tensor or a tuple/list of them) as ``micro_batch``'s."""
        values = value if isinstance(value, (tuple, list)) else (value,)
        for t in values:
            if isinstance(t, torch.Tensor):
                self.refs.setdefault(micro_batch, []).append(weakref.ref(t))

    def live(self) -> list[int]:
        """Micro-batches with at least one activation tensor still alive, in order."""
        return sorted(m for m, refs in self.refs.items() if any(r() is not None for r in refs))

    def observe(self) -> int:
        """Count live micro-batches now and update :attr:`peak`."""
        alive = len(self.live())
        self.peak = max(self.peak, alive)
        return alive

    def reset(self) -> None:
        """Forget the step (called when a new step starts)."""
        self.refs.clear()
        self.peak = 0


class StageBuffers:
    """The slots of one stage (``num_buffers`` of them, indexed by the schedule's ``buffer_id``).

    Args:
        num_buffers: the schedule's ``num_pipe_buffers()``.
        policy: this stage's release policy (:meth:`ReleasePolicy.for_stage`).
    """

    def __init__(self, num_buffers: int, policy: ReleasePolicy) -> None:
        self.slots = [Slot() for _ in range(num_buffers)]
        self.policy = policy
        self.retained: list[Any] = []  # upstream behaviour only: outputs kept until the step ends
        self.ledger = ActivationLedger()

    def __getitem__(self, buffer_id: int) -> Slot:
        return self.slots[buffer_id]

    def start(self, buffer_id: int, micro_batch: int) -> Slot:
        """Claim ``buffer_id`` for ``micro_batch``; a slot still holding another micro-batch is a schedule bug."""
        slot = self.slots[buffer_id]
        if slot.micro_batch not in (-1, micro_batch):
            raise RuntimeError(
                f"pipeline buffer {buffer_id} still holds micro-batch {slot.micro_batch} when micro-batch "
                f"{micro_batch} needs it: the schedule reuses a buffer before its backward"
            )
        slot.micro_batch = micro_batch
        return slot

    def after_backward(self, buffer_id: int, has_upstream: bool) -> None:
        """Right after a micro-batch's backward: its outputs, loss and output gradients are done with.

        The inputs stay while their gradient still has to go to the previous stage (``has_upstream``); the
        first stage has no such send, so its slot is free at once.
        """
        slot = self.slots[buffer_id]
        if self.policy is ReleasePolicy.RETAIN_LAST_STAGE_OUTPUTS:
            self.retained.append(slot.outputs)
        if not has_upstream:
            slot.clear()
            return
        slot.outputs, slot.loss, slot.labels, slot.grads = None, None, None, None

    def release(self, buffer_id: int) -> None:
        """After the slot's input gradients were sent: nothing of the micro-batch is needed any more."""
        self.slots[buffer_id].clear()

    def end_step(self) -> None:
        """Free everything the step still holds (normal, skipped or failed step alike)."""
        for slot in self.slots:
            slot.clear()
        self.retained.clear()

    def held_micro_batches(self) -> int:
        """Micro-batches whose slot is in use now."""
        return sum(slot.micro_batch >= 0 for slot in self.slots)
