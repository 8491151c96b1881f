"""``DeepSpeedConfig``: read a DeepSpeed JSON config once, validate it, and build the frozen run plan.

Flow (see docs/config.md); each step is its own module of this room:

1. ``load.load_config_dict`` turns a dict / file path (JSON or hjson) / base64 or raw JSON string into a dict.
2. ``schema.RootConfig`` validates every block in one pass (pydantic models with upstream keys, aliases,
   defaults); ``enforce.enforce_surface`` then refuses keys asking for what is not implemented, warns about keys
   without effect and about unknown top-level keys.
3. ``batch.resolve_batch`` settles the batch-size triangle against the data-parallel world size.
4. ``convert.run_plan`` converts the validated models into a :class:`deepspeed._core.config.plan.RunPlan`, once
   (the only conversion; the ZeRO façades call the same module).

``DeepSpeedConfig`` itself only holds those results and exposes upstream attribute names as properties
(``deepspeed/runtime/config.py`` re-exports it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from deepspeed._core.config.base import DeepSpeedConfigError
from deepspeed._core.config.batch import check_batch, data_parallel_world_size, resolve_batch
from deepspeed._core.config.blocks import DEEPSPEED_OPTIMIZERS, ValidationMode
from deepspeed._core.config.comms import DeepSpeedCommsConfig
from deepspeed._core.config.convert import run_plan
from deepspeed._core.config.enforce import enforce_surface
from deepspeed._core.config.load import load_config_dict
from deepspeed._core.config.monitor import DeepSpeedMonitorConfig
from deepspeed._core.config.plan import RunPlan
from deepspeed._core.config.precision import to_torch_dtype
from deepspeed._core.config.schema import RootConfig
from deepspeed._foundation.logging import logger

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]


class _ModelView:
    """Read-only ``DeepSpeedConfig`` attribute backed by one field of the validated root model."""

    def __init__(self, path: str, doc: str) -> None:
        self._parts = path.split(".")
        self.__doc__ = doc

    def __get__(self, obj: DeepSpeedConfig | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value: Any = obj._model
        for part in self._parts:
            value = getattr(value, part)
        return value


class DeepSpeedConfig:
    """A validated DeepSpeed config (upstream class name, constructor and attribute names).

    Args:
        config: dict, path to a JSON/hjson file, or (urlsafe-base64) JSON string; see :func:`load_config_dict`.
        mpu: optional model-parallel unit; its ``get_data_parallel_world_size()`` sets the batch world size.
        mesh_device: optional device mesh whose ``data_parallel`` dimension sets the batch world size.

    Raises:
        DeepSpeedConfigError: on any invalid key or value; the message names the key and what is valid.

    The resolved :class:`deepspeed._core.config.plan.RunPlan` is available as :attr:`plan`.
    """

    def __init__(self, config: str | os.PathLike | dict, mpu: Any = None, mesh_device: Any = None) -> None:
        self._param_dict = load_config_dict(config)
        self._model = RootConfig.from_dict(self._param_dict)
        enforce_surface(self._model, self._param_dict)
        self.world_size = data_parallel_world_size(mpu, mesh_device, self._model.sequence_parallel_size)
        self._batch = resolve_batch(
            self._model.train_batch_size,
            self._model.train_micro_batch_size_per_gpu,
            self._model.gradient_accumulation_steps,
            self.world_size,
        )
        self.monitor_config = DeepSpeedMonitorConfig(
            tensorboard=self._model.tensorboard,
            wandb=self._model.wandb,
            csv_monitor=self._model.csv_monitor,
            comet=self._model.comet,
        )
        self.comms_config = DeepSpeedCommsConfig.from_block(
            self._model.comms_logger, "comms_logger" in self._model.model_fields_set
        )
        self._plan: RunPlan | None = None

    @property
    def plan(self) -> RunPlan:
        """The frozen run plan, built on first access and cached (rebuilt after a batch-size setter)."""
        if self._plan is None:
            if None in (
                self._batch.train_batch_size,
                self._batch.micro_batch_per_gpu,
                self._batch.gradient_accumulation_steps,
            ):
                self._configure_train_batch_size()
            check_batch(self._batch)
            self._plan = run_plan(self._model, self._batch)
        return self._plan

    # Batch triangle: settable because upstream's engine.set_train_batch_size() assigns these; the invariant is
    # re-checked when the plan is next built, since callers update two of them one after the other.
    def _set_batch(self, **change: int | None) -> None:
        # ``None`` leaves a corner for :meth:`_configure_train_batch_size` to derive (upstream callers assign it).
        self._batch = dataclasses.replace(self._batch, **change)  # type: ignore[arg-type]
        self._plan = None

    def _configure_train_batch_size(self) -> None:
        """Derive the unset corners of the batch triangle from the current attributes (upstream's method).

        Reads ``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` (``None``
        where unset) and ``world_size``, fills in what follows from them, and raises ``AssertionError`` naming the
        values when they are inconsistent, as upstream does.
        """
        b = self._batch
        triangle = (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps)
        try:
            resolved = resolve_batch(*triangle, self.world_size)
            check_batch(resolved)
        except DeepSpeedConfigError as err:
            raise AssertionError(str(err)) from err
        self._batch, self._plan = resolved, None

    @property
    def train_batch_size(self) -> int:
        """Global batch size per optimizer step."""
        return self._batch.train_batch_size

    @train_batch_size.setter
    def train_batch_size(self, value: int | None) -> None:
        self._set_batch(train_batch_size=None if value is None else int(value))

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        """Micro-batch size on one data-parallel rank."""
        return self._batch.micro_batch_per_gpu

    @train_micro_batch_size_per_gpu.setter
    def train_micro_batch_size_per_gpu(self, value: int | None) -> None:
        self._set_batch(micro_batch_per_gpu=None if value is None else int(value))

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self._batch.gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int | None) -> None:
        self._set_batch(gradient_accumulation_steps=None if value is None else int(value))

    # Plain views of validated fields.
    steps_per_print = _ModelView("steps_per_print", "Progress-log interval (None = off, may be inf).")
    gradient_clipping = _ModelView("gradient_clipping", "Global-norm clip value (0.0 = off).")
    prescale_gradients = _ModelView("prescale_gradients", "Divide gradients before reducing them.")
    gradient_predivide_factor = _ModelView("gradient_predivide_factor", "Pre-reduction divide factor.")
    gradient_allreduce_op = _ModelView("gradient_allreduce_op", "'mean' or 'sum'.")
    zero_allow_untested_optimizer = _ModelView("zero_allow_untested_optimizer", "Allow unknown client optimizers.")
    zero_force_ds_cpu_optimizer = _ModelView("zero_force_ds_cpu_optimizer", "Offload requires a DS CPU optimizer.")
    memory_breakdown = _ModelView("memory_breakdown", "Log memory usage.")
    dump_state = _ModelView("dump_state", "Log engine state after setup.")
    disable_allgather = _ModelView("disable_allgather", "Upstream legacy switch.")
    sparse_gradients_enabled = _ModelView("sparse_gradients", "Sparse embedding gradients.")
    dataloader_drop_last = _ModelView("dataloader_drop_last", "Drop the last incomplete batch.")
    graph_harvesting = _ModelView("graph_harvesting", "Upstream CUDA-graph switch.")
    vocabulary_size = _ModelView("vocabulary_size", "Model vocabulary size, if given.")
    sequence_parallel_size = _ModelView("sequence_parallel_size", "Sequence-parallel group size.")
    managed_gradient_accumulation = _ModelView("managed_gradient_accumulation", "Engine-owned GA boundary.")
    zero_config = _ModelView("zero_optimization", "The validated DeepSpeedZeroConfig.")
    float16_config = _ModelView("fp16", "The validated DeepSpeedFP16Config.")
    bfloat16_config = _ModelView("bf16", "The validated DeepSpeedBF16Config.")
    fp16_enabled = _ModelView("fp16.enabled", "fp16 training on.")
    fp16_auto_cast = _ModelView("fp16.auto_cast", "Cast forward inputs to fp16.")
    fp16_master_weights_and_gradients = _ModelView("fp16.fp16_master_weights_and_grads", "fp16 master weights.")
    bfloat16_enabled = _ModelView("bf16.enabled", "bf16 training on.")
    bfloat16_immediate_grad_update = _ModelView("bf16.immediate_grad_update", "bf16 immediate grad update.")
    bfloat16_check_grad_overflow = _ModelView("bf16.check_grad_overflow", "bf16 overflow check.")
    bf16_master_weights_and_grads = _ModelView("bf16.bf16_master_weights_and_grads", "bf16 master weights.")
    bf16_optimizer_states = _ModelView("bf16.bf16_optimizer_states", "bf16 optimizer states.")
    mics_shard_size = _ModelView("zero_optimization.mics_shard_size", "MiCS shard size (-1 = off).")
    mics_hierarchial_params_gather = _ModelView(
        "zero_optimization.mics_hierarchical_params_gather", "MiCS hierarchical gather (upstream attribute spelling)."
    )
    grad_accum_dtype = _ModelView("data_types.grad_accum_dtype", "Gradient-accumulation dtype name, or None.")
    activation_checkpointing_config = _ModelView("activation_checkpointing", "The activation_checkpointing block.")
    flops_profiler_config = _ModelView("flops_profiler", "The flops_profiler block.")
    timers_config = _ModelView("timers.throughput", "The timers.throughput block (the throughput timer).")
    checkpoint_config = _ModelView("checkpoint", "The checkpoint block.")
    load_universal_checkpoint = _ModelView("checkpoint.load_universal", "Load a universal checkpoint.")
    use_node_local_storage = _ModelView("checkpoint.use_node_local_storage", "Per-node checkpoint writers.")
    checkpoint_parallel_write_pipeline = _ModelView(
        "checkpoint.parallel_write.pipeline_stage", "Pipeline stages write in parallel."
    )

    # Derived values.
    @property
    def zero_enabled(self) -> bool:
        """True for ZeRO stage 1, 2 or 3."""
        return self.zero_optimization_stage > 0

    @property
    def zero_optimization_stage(self) -> int:
        """The ZeRO stage as an int (0–3)."""
        return int(self._model.zero_optimization.stage)

    @property
    def wall_clock_breakdown(self) -> bool:
        """Timers on; forced on by an enabled flops profiler."""
        return self._model.wall_clock_breakdown or self._model.flops_profiler.enabled

    @property
    def communication_data_type(self) -> torch.dtype | None:
        """dtype for gradient reduction, or None to follow the working dtype."""
        return to_torch_dtype(self._model.communication_data_type)

    @property
    def seq_parallel_communication_data_type(self) -> torch.dtype:
        """dtype gradients are reduced in under sequence parallelism (replaces communication_data_type there)."""
        return to_torch_dtype(self._model.seq_parallel_communication_data_type)

    @property
    def optimizer_name(self) -> str | None:
        """Optimizer type; DeepSpeed optimizer names are lower-cased, torch names kept as written."""
        name = self._model.optimizer.type if self._model.optimizer else None
        return name.lower() if name is not None and name.lower() in DEEPSPEED_OPTIMIZERS else name

    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        """Optimizer constructor keywords (None without an optimizer type)."""
        block = self._model.optimizer
        return block.params if block is not None and block.type is not None else None

    @property
    def optimizer_legacy_fusion(self) -> bool:
        """Upstream legacy fusion switch."""
        return bool(self._model.optimizer and self._model.optimizer.legacy_fusion)

    @property
    def scheduler_name(self) -> str | None:
        """Scheduler type, or None."""
        return self._model.scheduler.type if self._model.scheduler else None

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        """Scheduler constructor keywords (None without a scheduler type)."""
        block = self._model.scheduler
        return block.params if block is not None and block.type is not None else None

    @property
    def loss_scale(self) -> float:
        """fp16 static loss scale (0 = dynamic); 1.0 under bf16; 0 otherwise (upstream semantics)."""
        if self.fp16_enabled:
            return self._model.fp16.loss_scale
        return 1.0 if self.bfloat16_enabled else 0

    @property
    def initial_dynamic_scale(self) -> int:
        """First dynamic loss scale: 2**initial_scale_power under fp16, 1 under bf16."""
        if self.bfloat16_enabled:
            return 1
        return self._model.fp16.initial_dynamic_scale()

    @property
    def dynamic_loss_scale_args(self) -> dict[str, Any] | None:
        """Dynamic loss-scaler arguments under dynamic fp16, else None."""
        fp16 = self._model.fp16
        return fp16.dynamic_loss_scale_args() if fp16.enabled and fp16.dynamic_loss_scale else None

    @property
    def checkpoint_tag_validation_enabled(self) -> bool:
        """Tag validation is WARN or FAIL."""
        return self._model.checkpoint.tag_validation != ValidationMode.IGNORE

    @property
    def checkpoint_tag_validation_fail(self) -> bool:
        """Tag validation is FAIL."""
        return self._model.checkpoint.tag_validation == ValidationMode.FAIL

    @property
    def aio_config(self) -> dict[str, Any]:
        """The ``aio`` block as a plain dict (upstream shape)."""
        return self._model.aio.model_dump()

    @property
    def amp_enabled(self) -> bool:
        """Always False: apex AMP is rejected at construction."""
        return False

    @property
    def elasticity_enabled(self) -> bool:
        """Always False: elastic training is rejected at construction."""
        return False

    def log_config(self, name: str = "DeepSpeedConfig") -> None:
        """Log the effective (validated, defaults filled) config and the user's raw dict."""
        effective = self._model.model_dump(mode="json", exclude_none=True)
        logger.info(f"{name}: effective config {json.dumps(effective, sort_keys=True, default=str)}")
        logger.info(f"{name}: user config {json.dumps(self._param_dict, sort_keys=True, default=str)}")
