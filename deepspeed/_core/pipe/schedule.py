"""Pipeline schedules as plain instruction streams (pure data: nothing here communicates or computes).

A schedule yields, for each time step, the list of instructions one stage executes in order. The engine
interprets them; tests replay them. Buffers are slots the engine keeps per stage for a micro-batch's input,
output and their gradients; micro-batch ``m`` uses buffer ``m % num_pipe_buffers()``.

[Note: 1F1B timing] With ``P`` stages and ``G`` micro-batches, stage ``s`` runs the forward of micro-batch ``m``
at step ``s + 2m`` and its backward at step ``2P - 1 - s + 2m``. Forward steps of a stage have the parity of ``s``
and backward steps the other parity, so each step holds at most one pass. Right after the forward of ``m`` the
stage has ``min(P - s, G)`` micro-batches in flight (forwarded, not yet backwarded), which is its buffer count.

[Note: matched sends] Results are sent one step after they are computed, in the step where the neighbour
receives them, so every send has its receive in the same step. At step ``t`` the only talking pairs are
``(s, s + 1)`` with ``s`` in a backward step and ``s + 1`` in a forward step, and within a pair the order is
fixed so that blocking point-to-point calls never wait on each other:

- backward step of ``s``: ``RecvGrad`` (from ``s + 1``), ``SendActivation`` (of its previous forward), ``BackwardPass``;
- forward step of ``s + 1``: ``SendGrad`` (of its previous backward), ``RecvActivation`` (from ``s``), ``ForwardPass``.

``SendGrad`` comes before ``RecvActivation`` because the arriving micro-batch may reuse the buffer whose input
gradient is being sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


# ---------------------------------------------------------------------- instructions
class PipeInstruction:
    """One step of work for the engine; keyword arguments become attributes (e.g. ``buffer_id``).

    Two instructions are equal when they have the same type and the same keyword arguments.
    """

    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer (after the gradients are reduced)."""


class ReduceGrads(PipeInstruction):
    """Reduce gradients over the data-parallel group."""


class ReduceTiedGrads(PipeInstruction):
    """All-reduce the gradients of tied weights over the stages that hold them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction acting on one pipeline buffer."""

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro-batch into a buffer: inputs on the first stage, labels on the last."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's layers on the buffer's input."""


class BackwardPass(BufferOpInstruction):
    """Backpropagate the buffer's output gradient (or the loss, on the last stage)."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's output to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's output as the buffer's input."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's input to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of the buffer's output from the next stage."""


# ---------------------------------------------------------------------- schedules
class PipeSchedule:
    """Base of all schedules: ``steps()`` yields one list of instructions per time step for ``stage_id``."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        if not isinstance(stages, int) or stages < 1:
            raise ValueError(f"stages must be a positive int, got {stages!r}")
        if not isinstance(stage_id, int) or not 0 <= stage_id < stages:
            raise ValueError(f"stage_id must be in [0, {stages}), got {stage_id!r}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield the instructions of each time step, in order."""
        raise NotImplementedError

    def num_pipe_buffers(self) -> int:
        """How many buffers this stage needs."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self) -> int:
        """This schedule's stage."""
        return self.stage_id

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per global batch."""
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        """True for stage 0."""
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        """True for the last stage."""
        return self.stage_id == self.stages - 1

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()


class TrainSchedule(PipeSchedule):
    """1F1B training: warm-up forwards, then alternate one forward and one backward, then drain.

    Timing and message order: [Note: 1F1B timing], [Note: matched sends]. The last step also reduces tied and
    data-parallel gradients and steps the optimizer.
    """

    def num_pipe_buffers(self) -> int:
        """``min(P - s, G)``: the most micro-batches stage ``s`` ever holds (see [Note: 1F1B timing])."""
        return max(1, min(self.stages - self.stage_id, self.micro_batches))

    def _forward_mb(self, step: int) -> int | None:
        offset = step - self.stage_id
        return offset // 2 if offset >= 0 and offset % 2 == 0 else None

    def _backward_mb(self, step: int) -> int | None:
        offset = step - (2 * self.stages - 1 - self.stage_id)
        return offset // 2 if offset >= 0 and offset % 2 == 0 else None

    def total_steps(self) -> int:
        """Number of time steps: ``2 (G + P - 1)``."""
        return 2 * (self.micro_batches + self.stages - 1)

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield each step's instructions (see the class docstring)."""
        last = self.total_steps() - 1
        for step in range(self.total_steps()):
            cmds = self._backward_step(step) if (step - self.stage_id) % 2 else self._forward_step(step)
            if step == last:
                cmds.extend([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
            yield cmds

    def _forward_step(self, step: int) -> list[PipeInstruction]:
        cmds: list[PipeInstruction] = []
        done = self._backward_mb(step - 1)  # the backward of the previous step, whose input grad goes back now
        if done is not None and self._valid_micro_batch(done) and not self.is_first_stage:
            cmds.append(SendGrad(self._buffer_idx(done)))
        mb = self._forward_mb(step)
        if mb is not None and self._valid_micro_batch(mb):
            buf = self._buffer_idx(mb)
            if not self.is_first_stage:
                cmds.append(RecvActivation(buf))
            if self.is_first_stage or self.is_last_stage:
                cmds.append(LoadMicroBatch(buf))
            cmds.append(ForwardPass(buf))
        return cmds

    def _backward_step(self, step: int) -> list[PipeInstruction]:
        cmds: list[PipeInstruction] = []
        mb = self._backward_mb(step)
        if mb is not None and not self._valid_micro_batch(mb):
            mb = None
        if mb is not None and not self.is_last_stage:
            cmds.append(RecvGrad(self._buffer_idx(mb)))
        done = self._forward_mb(step - 1)  # the forward of the previous step, whose output goes on now
        if done is not None and self._valid_micro_batch(done) and not self.is_last_stage:
            cmds.append(SendActivation(self._buffer_idx(done)))
        if mb is not None:
            cmds.append(BackwardPass(self._buffer_idx(mb)))
        return cmds


class InferenceSchedule(PipeSchedule):
    """Forward only: stage ``s`` runs micro-batch ``m`` at step ``s + m`` and sends it on at the next step.

    Two buffers alternate (the one being sent and the one being received). In a step, even stages send before
    they receive and odd stages receive before they send, so neighbours always meet in the same order.
    """

    def num_pipe_buffers(self) -> int:
        """Two alternating buffers (one when there is a single micro-batch)."""
        return min(2, self.micro_batches)

    def total_steps(self) -> int:
        """Number of time steps: ``G + P`` (the last one only sends)."""
        return self.micro_batches + self.stages

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield each step's instructions."""
        for step in range(self.total_steps()):
            mb = step - self.stage_id
            send: list[PipeInstruction] = []
            if self._valid_micro_batch(mb - 1) and not self.is_last_stage:
                send.append(SendActivation(self._buffer_idx(mb - 1)))
            recv: list[PipeInstruction] = []
            work: list[PipeInstruction] = []
            if self._valid_micro_batch(mb):
                buf = self._buffer_idx(mb)
                if not self.is_first_stage:
                    recv.append(RecvActivation(buf))
                if self.is_first_stage or self.is_last_stage:
                    work.append(LoadMicroBatch(buf))
                work.append(ForwardPass(buf))
            yield (send + recv if self.stage_id % 2 == 0 else recv + send) + work


class DataParallelSchedule(PipeSchedule):
    """No pipelining: each micro-batch forward and backward in turn, then reduce and step."""

    def num_pipe_buffers(self) -> int:
        """One buffer is reused by every micro-batch."""
        return 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield one step per micro-batch."""
        for mb in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
            if mb == self.micro_batches - 1:
                cmds.extend([ReduceGrads(), OptimizerStep()])
            yield cmds
