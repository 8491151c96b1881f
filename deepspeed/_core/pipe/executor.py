"""Executes a pipeline schedule's instruction stream on one stage: load, forward, backward, p2p, reduce, step.

The schedule (``deepspeed._core.pipe.schedule``) is pure data; this module gives each instruction its effect.
Activations live in :class:`StageBuffers` ([Note: pipeline activation release]) and cross stage boundaries
through :class:`StageLink` ([Note: pipeline p2p]). Gradients follow the engine's one micro-step protocol
(``prepare_backward`` / ``finish_backward`` of :class:`EngineOptimizer`), so ZeRO-1 and plain data parallelism
need no pipeline branch:

- every backward but the window's last is an ``ACCUMULATE`` micro-step; the last one reduces over the
  data-parallel group while it runs (``REDUCE``), as a non-pipelined engine does;
- a stage that shares tied weights with another stage must first sum those weights' gradients over the
  stages (``ReduceTiedGrads``), so all its backwards accumulate and ``ReduceGrads`` runs the reduction
  afterwards (a ``REDUCE`` micro-step with no backward in it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import broadcast_tensor, sum_over
from deepspeed._core.engine.precision import cast_inputs
from deepspeed._core.optim.base import EngineOptimizer, MicroStepKind
from deepspeed._core.pipe import schedule as sched
from deepspeed._core.pipe.buffers import ReleasePolicy, StageBuffers, StagePosition
from deepspeed._core.pipe.data import DataFeed, agree_or_raise
from deepspeed._core.pipe.p2p import StageLink, as_tensors


@dataclass(frozen=True)
class StageInfo:
    """Where this rank sits in the pipeline, and the groups it talks to."""

    stage_id: int
    num_stages: int
    pipe_group: Any  # this replica's stages
    dp_group: Any  # the same stage in every replica
    last_stage_rank: int  # global rank of this replica's last stage (loss broadcast source)

    @property
    def is_first(self) -> bool:
        """Stage 0."""
        return self.stage_id == 0

    @property
    def is_last(self) -> bool:
        """The stage that computes the loss."""
        return self.stage_id == self.num_stages - 1


@dataclass
class _Run:
    """State of one ``train_batch`` / ``eval_batch`` call."""

    mode: str
    micro_batches: int
    feed: DataFeed
    buffers: StageBuffers
    steps: list[list[Any]]
    compute_loss: bool = True
    next_micro_batch: int = 0
    backwards: int = 0
    losses: list[Any] = field(default_factory=list)  # per micro-batch (a tensor, or what an eval forward gave)
    last_outputs: Any = None


class PipeExecutor:
    """Runs schedules for one stage.

    Args:
        module: the stage's ``PipelineModule`` (its ``forward`` runs the local layers; ``loss_fn`` on the last stage).
        stage: this rank's :class:`StageInfo`.
        link: the p2p links to the neighbouring stages.
        device: the compute device.
        input_dtype: floating inputs of the first stage are cast to it (the working dtype), or ``None``.
        policy: when activations are released.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        stage: StageInfo,
        link: StageLink,
        device: torch.device,
        input_dtype: torch.dtype | None,
        policy: ReleasePolicy,
    ) -> None:
        self.module = module
        self.stage = stage
        self.link = link
        self.device = device
        self.input_dtype = input_dtype
        self.policy = policy
        self.optimizer: EngineOptimizer | None = None
        self.optimizer_step: Callable[[], None] = lambda: None
        tied_weights = getattr(module, "get_tied_weights_and_groups", None)  # a PipelineModule's, if any
        self.tied = list(tied_weights()) if tied_weights is not None else []
        self.grad_boundary = False
        self.last_run: _Run | None = None  # kept for inspection (tests read its ledger)
        self.observer: Callable[[str, Any, StageBuffers], None] | None = None
        self._handlers: dict[type, Callable[[Any, _Run], None]] = {
            sched.LoadMicroBatch: self._load,
            sched.ForwardPass: self._forward,
            sched.BackwardPass: self._backward,
            sched.SendActivation: self._send_activation,
            sched.RecvActivation: self._recv_activation,
            sched.SendGrad: self._send_grad,
            sched.RecvGrad: self._recv_grad,
            sched.ReduceTiedGrads: self._reduce_tied,
            sched.ReduceGrads: self._reduce_grads,
            sched.OptimizerStep: self._step,
        }

    # --- entry points ---------------------------------------------------------------------------------------
    def train(self, schedule: sched.PipeSchedule, feed_iter: Any, batch_fn: Any) -> torch.Tensor:
        """One global batch; returns the mean loss over micro-batches and data-parallel ranks, on every rank."""
        if self.optimizer is None:
            raise RuntimeError("train_batch() needs an optimizer: pass one to deepspeed.initialize or configure one")
        self.module.train()
        run = self._start("train", schedule, feed_iter, batch_fn, compute_loss=True)
        self._execute(schedule, run)
        loss = self._mean_loss(run, broadcast=True)
        assert loss is not None, "a broadcast mean loss reaches every stage"
        return loss

    def evaluate(
        self,
        schedule: sched.PipeSchedule,
        feed_iter: Any,
        batch_fn: Any,
        compute_loss: bool,
        reduce_output: str | None,
        bcast_loss: bool,
    ) -> tuple[Any, Any]:
        """Forward only; returns ``(reduced output, last micro-batch's outputs or None)``."""
        was_training = self.module.training
        self.module.eval()
        try:
            run = self._start("eval", schedule, feed_iter, batch_fn, compute_loss=compute_loss)
            with torch.no_grad():
                self._execute(schedule, run)
            if reduce_output is None:
                return (run.losses if self.stage.is_last else None), run.last_outputs
            return self._mean_loss(run, broadcast=bcast_loss), run.last_outputs
        finally:
            self.module.train(was_training)

    # --- the instruction loop ---------------------------------------------------------------------------------
    def _start(
        self, mode: str, schedule: sched.PipeSchedule, feed_iter: Any, batch_fn: Any, compute_loss: bool
    ) -> _Run:
        steps = list(schedule.steps())
        reads = sum(isinstance(cmd, sched.LoadMicroBatch) for step in steps for cmd in step)
        feed = DataFeed(feed_iter, batch_fn, reads)
        # Before any point-to-point transfer: every rank fails together on bad data ([Note: pipeline data]).
        agree_or_raise(feed.prime(), self.link.comm_device)
        position = StagePosition.LAST if self.stage.is_last else StagePosition.EARLIER
        buffers = StageBuffers(schedule.num_pipe_buffers(), self.policy.for_stage(position))
        run = _Run(mode, schedule.micro_batches, feed, buffers, steps, compute_loss, losses=[])
        self.last_run = run
        return run

    def _execute(self, schedule: sched.PipeSchedule, run: _Run) -> None:
        try:
            for step in run.steps:
                for cmd in step:
                    handler = self._handlers.get(type(cmd))
                    if handler is None:
                        raise RuntimeError(f"the pipeline engine cannot execute schedule instruction {cmd!r}")
                    handler(cmd, run)
                    if self.observer is not None:
                        self.observer(type(cmd).__name__, cmd, run.buffers)
                self.link.drain()
        finally:
            self.link.drain()
            run.buffers.end_step()
            self.grad_boundary = False

    def _slot(self, run: _Run, buffer_id: int) -> Any:
        slot = run.buffers[buffer_id]
        if slot.micro_batch < 0:
            slot = run.buffers.start(buffer_id, run.next_micro_batch)
            run.next_micro_batch += 1
        return slot

    # --- data and forward -----------------------------------------------------------------------------------
    def _load(self, cmd: Any, run: _Run) -> None:
        slot = self._slot(run, cmd.buffer_id)
        inputs, labels = run.feed.next()
        if self.stage.is_first:
            inputs = _to_device(inputs, self.device)
            if self.input_dtype is not None:
                inputs = cast_inputs(inputs, self.input_dtype)
            slot.inputs = inputs
            run.buffers.ledger.track(slot.micro_batch, inputs)
        if self.stage.is_last:
            slot.labels = _to_device(labels, self.device)

    def _forward(self, cmd: Any, run: _Run) -> None:
        slot = self._slot(run, cmd.buffer_id)
        if slot.inputs is None:
            raise RuntimeError(f"pipeline buffer {cmd.buffer_id} has no input for its forward (schedule bug)")
        outputs = self.module(slot.inputs)
        if not self.stage.is_last:
            slot.outputs = outputs
            run.buffers.ledger.track(slot.micro_batch, outputs)
            run.buffers.ledger.observe()  # a forward is where the count of live micro-batches can rise
            return
        loss = outputs
        loss_fn = getattr(self.module, "loss_fn", None) if run.compute_loss else None
        if loss_fn is not None:
            loss = loss_fn(outputs, slot.labels)
        if run.mode == "train":
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(
                    "the last pipeline stage must produce a scalar loss (set PipelineModule's loss_fn), "
                    f"got {type(loss).__name__}"
                )
            slot.outputs, slot.loss = outputs, loss
            run.buffers.ledger.track(slot.micro_batch, outputs)
            run.buffers.ledger.observe()
        else:
            run.last_outputs = outputs
            slot.clear()  # nothing of an evaluated micro-batch is needed once its loss is taken
        run.losses.append(loss.detach() if isinstance(loss, torch.Tensor) else loss)

    # --- backward -----------------------------------------------------------------------------------------------
    def _backward(self, cmd: Any, run: _Run) -> None:
        slot = run.buffers[cmd.buffer_id]
        opt = self._optimizer()
        run.backwards += 1
        last = run.backwards == run.micro_batches
        kind = MicroStepKind.REDUCE if last and not self.tied else MicroStepKind.ACCUMULATE
        opt.prepare_backward(kind)
        if self.stage.is_last:
            if slot.loss is None:
                raise RuntimeError(f"pipeline buffer {cmd.buffer_id} has no loss for its backward (schedule bug)")
            scaled = slot.loss * (opt.cur_scale / run.micro_batches)
            scaled.backward()
        else:
            if slot.grads is None:
                raise RuntimeError(
                    f"pipeline buffer {cmd.buffer_id} received no gradients before its backward (schedule bug)"
                )
            pairs = [(t, g) for t, g in zip(as_tensors(slot.outputs), slot.grads, strict=True) if g is not None]
            if pairs:  # an output outside any graph (every layer so far frozen) has nothing to backpropagate
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        opt.finish_backward()
        run.buffers.after_backward(cmd.buffer_id, has_upstream=not self.stage.is_first)

    # --- point-to-point -------------------------------------------------------------------------------------------
    def _send_activation(self, cmd: Any, run: _Run) -> None:
        slot = run.buffers[cmd.buffer_id]
        self.link.send_activation(slot.outputs, run.mode)
        if run.mode == "eval":
            slot.clear()

    def _recv_activation(self, cmd: Any, run: _Run) -> None:
        slot = self._slot(run, cmd.buffer_id)
        slot.inputs = self.link.recv_activation(run.mode)
        run.buffers.ledger.track(slot.micro_batch, slot.inputs)

    def _send_grad(self, cmd: Any, run: _Run) -> None:
        slot = run.buffers[cmd.buffer_id]
        self.link.send_grads(slot.inputs)
        run.buffers.release(cmd.buffer_id)

    def _recv_grad(self, cmd: Any, run: _Run) -> None:
        run.buffers[cmd.buffer_id].grads = self.link.recv_grads(run.mode)

    # --- reduction and step -----------------------------------------------------------------------------------------
    def _reduce_tied(self, cmd: Any, run: _Run) -> None:
        self.grad_boundary = True
        if not self.tied:
            return
        weights = [w for w, _ in self.tied]
        for grad, (_, group) in zip(self._optimizer().window_grads(weights), self.tied, strict=True):
            sum_over(grad, group)

    def _reduce_grads(self, cmd: Any, run: _Run) -> None:
        self.grad_boundary = True
        if self.tied:  # the backwards only accumulated: reduce over the data-parallel group now
            opt = self._optimizer()
            opt.prepare_backward(MicroStepKind.REDUCE)
            opt.finish_backward()

    def _optimizer(self) -> EngineOptimizer:
        # Only train() runs the backward, reduction and step commands, and it refuses to start without one.
        if self.optimizer is None:
            raise RuntimeError("pipeline schedule reached a backward or reduction without an optimizer")
        return self.optimizer

    def _step(self, cmd: Any, run: _Run) -> None:
        self.grad_boundary = True
        self.optimizer_step()

    # --- the loss every rank reports ----------------------------------------------------------------------------------
    def _mean_loss(self, run: _Run, broadcast: bool) -> torch.Tensor | None:
        """Last stage: mean over micro-batches, then over data-parallel ranks; broadcast to the other stages."""
        comm = self.link.comm_device
        if self.stage.is_last:
            losses = [torch.as_tensor(x, dtype=torch.float32) for x in run.losses]
            loss = torch.stack([x.float().mean().to(comm) for x in losses]).mean()
            if dist.get_world_size(group=self.stage.dp_group) > 1:
                sum_over(loss, self.stage.dp_group)
                loss /= dist.get_world_size(group=self.stage.dp_group)
        else:
            if not broadcast:
                return None
            loss = torch.zeros((), dtype=torch.float32, device=comm)
        if broadcast and self.stage.num_stages > 1:
            broadcast_tensor(loss, self.stage.last_stage_rank, self.stage.pipe_group)
        return loss.to(self.device)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value
