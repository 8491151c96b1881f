"""``PipelineEngine``: upstream's pipeline-parallel engine API over ``deepspeed._core.pipe``.

:func:`deepspeed.initialize` returns one for a :class:`~deepspeed.runtime.pipe.module.PipelineModule`. Training
runs one global batch per :meth:`PipelineEngine.train_batch` call through the 1F1B schedule; the data-parallel
group of ZeRO-1 and of the gradient reduction is the grid's data-parallel group, and clipping and fp16 overflow
are decided over every stage.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from deepspeed import comm as dist
from deepspeed._core.pipe.buffers import ReleasePolicy
from deepspeed._core.pipe.checkpoint import PipelineModuleFiles
from deepspeed._core.pipe.executor import PipeExecutor, StageInfo
from deepspeed._core.pipe.module import PipelineModule
from deepspeed._core.pipe.p2p import StageLink
from deepspeed._core.pipe.schedule import InferenceSchedule, TrainSchedule
from deepspeed.runtime.config import DeepSpeedConfigError
from deepspeed.runtime.dataloader import RepeatingLoader
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils.logging import logger

__all__ = ["PipelineEngine", "PipelineError", "DeepSpeedEngine"]


class PipelineError(Exception):
    """Errors related to the use of the pipeline engine (upstream name)."""


class PipelineEngine(DeepSpeedEngine):
    """Trains a :class:`PipelineModule` with pipeline parallelism (and data parallelism across replicas).

    Built by :func:`deepspeed.initialize`, which passes ``mpu=model.mpu()``. Only :meth:`train_batch` and
    :meth:`eval_batch` drive the model; ``forward``, ``backward`` and ``step`` raise :class:`PipelineError`.

    Args:
        has_bool_tensors: accepted for upstream compatibility (boolean activations cross stages as any dtype).
        super_args / super_kwargs: the :class:`DeepSpeedEngine` arguments.
    """

    _is_pipeline_engine = True

    def __init__(self, has_bool_tensors: bool = False, *super_args: Any, **super_kwargs: Any) -> None:
        model = super_kwargs.get("model", super_args[1] if len(super_args) > 1 else None)
        if not isinstance(model, PipelineModule):
            raise TypeError(f"PipelineEngine needs a PipelineModule, got {type(model).__name__}")
        self.has_bool_tensors = has_bool_tensors
        super().__init__(*super_args, **super_kwargs)
        self.grid = model.mpu()
        self.num_stages = model.num_stages
        self.stage_id = self.grid.get_stage_id()
        self.micro_batches = self.gradient_accumulation_steps()
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.is_pipe_parallel = self.num_stages > 1
        self.is_data_parallel = self.grid.get_data_parallel_world_size() > 1
        self.is_model_parallel = False  # tensor parallelism inside stages is refused in _apply_config
        self.prev_stage, self.next_stage = self.stage_id - 1, self.stage_id + 1
        self.has_attention_mask = False
        self.data_iterator: Any = None
        self._batch_fn: Any = None
        self.agg_train_loss: torch.Tensor | None = None
        self._executor = self._build_executor(model)
        if self.training_dataloader is not None:
            self.set_dataiterator(iter(RepeatingLoader(self.training_dataloader)))

    # --- set-up ----------------------------------------------------------------------------------------------
    def _apply_config(self, args: Any, config: Any, config_class: Any, mpu: Any) -> None:
        super()._apply_config(args, config, config_class, mpu)
        stage = self.plan.zero.stage
        if stage >= 2:  # refused before any device move or collective, identically on every rank
            raise DeepSpeedConfigError(
                f"zero_optimization.stage={stage} cannot be combined with pipeline parallelism (each micro-batch's "
                "gradients would be partitioned mid-schedule); valid with a PipelineModule: stage 0 or 1"
            )
        module = self.module
        assert isinstance(module, PipelineModule), "__init__ admits only a PipelineModule"
        _apply_pipeline_block(self.config.get("pipeline"), module)
        if mpu is not None and mpu.get_slice_parallel_world_size() > 1:
            raise NotImplementedError(
                "PipelineEngine: tensor (model) parallelism inside pipeline stages is not supported yet; use a "
                "topology whose 'model' axis has size 1"
            )

    def _build_executor(self, model: PipelineModule) -> PipeExecutor:
        grid = self.grid
        last = self.num_stages - 1
        stage = StageInfo(
            stage_id=self.stage_id,
            num_stages=self.num_stages,
            pipe_group=grid.get_pipe_parallel_group(),
            dp_group=grid.get_data_parallel_group(),
            last_stage_rank=grid.stage_to_global(last),
        )
        comm_device = torch.device("cpu") if dist.get_backend() == "gloo" else self.device
        link = StageLink(
            grid.stage_to_global(self.stage_id - 1) if self.stage_id > 0 else None,
            grid.stage_to_global(self.stage_id + 1) if self.stage_id < last else None,
            self.device,
            comm_device,
        )
        precision = self.plan.precision
        low = precision.param_dtype if precision.param_dtype != torch.float32 else None
        policy = ReleasePolicy.from_switch(self.plan.zero.lean.pipeline_release)
        executor = PipeExecutor(model, stage, link, self.device, low, policy)
        _mark_replicated_tied_weights(model)
        optimizer = self._stepped_optimizer
        if optimizer is not None:
            if self.num_stages > 1:
                optimizer.stage_group = stage.pipe_group
            executor.optimizer = optimizer
            executor.optimizer_step = self._take_pipeline_step
        return executor

    def _take_pipeline_step(self) -> None:
        """The optimizer step at the end of a global batch, through the engine's one training loop."""
        acc = self._loop.accumulation
        acc.micro_steps += self.micro_batches - 1
        acc.set_boundary(True)
        try:
            self._loop.step()
        finally:
            acc.set_boundary(None)

    def _checkpoint_subject(self) -> Any:
        """The engine's checkpoint subject, with the module saved as upstream's per-layer files."""
        return dataclasses.replace(super()._checkpoint_subject(), module_files=PipelineModuleFiles(self.module))

    # --- the pipeline API ----------------------------------------------------------------------------------------
    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """Train on one global batch (``gradient_accumulation_steps`` micro-batches through the pipeline).

        Args:
            data_iter: an iterator of ``(inputs, labels)`` micro-batches; default the one set before
                (:meth:`set_dataiterator`, or ``training_data`` given to ``deepspeed.initialize``).

        Returns:
            The mean loss over the micro-batches and data-parallel replicas, on every rank.
        """
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        schedule = TrainSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)
        self.agg_train_loss = self._executor.train(schedule, self.data_iterator, self._batch_fn)
        self._loop.observer.write_scalar("Train/Samples/train_loss", self.agg_train_loss, self.global_samples)
        return self.agg_train_loss

    def eval_batch(
        self,
        data_iter: Any,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward ``num_micro_batches`` (default: the accumulation steps) micro-batches without training.

        Returns the mean loss (``reduce_output="avg"``; averaged over data-parallel replicas and, with
        ``bcast_loss``, on every rank), or the last stage's per-micro-batch list (``reduce_output=None``).
        With ``return_logits`` a pair ``(loss, logits of the last micro-batch)`` (logits on the last stage only).
        """
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch: reduce_output={reduce_output!r} is not valid; valid: 'avg', None")
        micro = self.micro_batches if num_micro_batches is None else int(num_micro_batches)
        schedule = InferenceSchedule(micro_batches=micro, stages=self.num_stages, stage_id=self.stage_id)
        data = iter(data_iter) if data_iter is not None and not hasattr(data_iter, "__next__") else data_iter
        output, logits = self._executor.evaluate(
            schedule, data, self._batch_fn, compute_loss, reduce_output, bcast_loss
        )
        if isinstance(output, torch.Tensor):
            self._loop.observer.write_scalar("Train/Samples/eval_loss", output, self.global_samples)
        return (output, logits) if return_logits else output

    def set_dataiterator(self, iterator: Any) -> None:
        """Use ``iterator`` for the following :meth:`train_batch` calls."""
        self.data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        """Train from ``loader`` (iterated afresh) in the following :meth:`train_batch` calls."""
        self.training_dataloader = loader
        self.data_iterator = iter(loader)

    def set_has_attention_mask(self, value: bool) -> None:
        """Record that the inputs carry an attention mask (upstream API).

        Nothing else is needed here: a boolean or integer tensor never asks for a gradient, so a mask crosses stage
        boundaries like any other tensor and gets no gradient back ([Note: pipeline p2p]).
        """
        if not isinstance(value, bool):
            raise TypeError(f"set_has_attention_mask expects a bool, got {type(value).__name__}")
        self.has_attention_mask = value

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size through the number of micro-batches per :meth:`train_batch`."""
        super().set_train_batch_size(train_batch_size)
        self.micro_batches = self.gradient_accumulation_steps()

    def set_batch_fn(self, fn: Any) -> None:
        """Apply ``fn`` to every item the data iterator yields (before the ``(inputs, labels)`` split)."""
        self._batch_fn = fn

    def is_first_stage(self) -> bool:
        """True on pipeline stage 0."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """True on the stage that computes the loss."""
        return self.stage_id == self.num_stages - 1

    def is_gradient_accumulation_boundary(self) -> bool:
        """True only while a :meth:`train_batch` reduces gradients and steps the optimizer."""
        return self._executor.grad_boundary

    # --- what pipeline mode does not offer ----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Not available in pipeline mode: use :meth:`train_batch` / :meth:`eval_batch`."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        """Not available in pipeline mode: use :meth:`train_batch`."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Not available in pipeline mode: use :meth:`train_batch`."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")


# Upstream's ``pipeline`` config keys. Only the checkpoint interval reaches the engine; the others are read by the
# code that builds the PipelineModule (GPT-NeoX, Megatron-DeepSpeed) or only matter with tensor parallelism.
_PIPELINE_KEYS = (
    "stages",
    "partition",
    "seed_layers",
    "activation_checkpoint_interval",
    "pipe_partitioned",
    "grad_partitioned",
)


def _apply_pipeline_block(block: Any, module: PipelineModule) -> None:
    """Validate the ``pipeline`` config block; apply ``activation_checkpoint_interval``, warn about the rest."""
    if block is None:
        return
    if not isinstance(block, dict):
        raise DeepSpeedConfigError(f"pipeline must be an object with keys {list(_PIPELINE_KEYS)}, got {block!r}")
    unknown = sorted(set(block) - set(_PIPELINE_KEYS))
    if unknown:
        raise DeepSpeedConfigError(f"pipeline: unknown key(s) {unknown}; valid keys: {list(_PIPELINE_KEYS)}")
    interval = block.get("activation_checkpoint_interval")
    if interval is not None:
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
            raise DeepSpeedConfigError(f"pipeline.activation_checkpoint_interval must be an int >= 0, got {interval!r}")
        if interval > 0:
            module.activation_checkpoint_interval = interval
    ignored = [k for k in block if k != "activation_checkpoint_interval"]
    if ignored:
        logger.warning(
            f"pipeline config keys {ignored} do not change the PipelineEngine: stages, partitioning and layer "
            "seeding are fixed when the PipelineModule is built, and pipe_partitioned / grad_partitioned only "
            "apply to tensor parallelism"
        )


def _mark_replicated_tied_weights(model: PipelineModule) -> None:
    """Flag each tied weight's copies beyond its first holder, so the global norm counts it once."""
    rank = dist.get_rank()
    for comm in getattr(model, "tied_comms", {}).values():
        if rank == min(comm["ranks"]):
            continue
        for attr in comm["weight_attr"]:
            weight = comm["module"]
            for part in attr.split("."):
                weight = getattr(weight, part)
            weight.ds_pipe_replicated = True
