"""The schema of a DeepSpeed config: every pydantic block of the top level, validated in one pass.

``_RootConfig`` holds each modelled top-level key (upstream names, aliases and defaults); the blocks owned by other
packages (``zero_optimization``, ``fp16``/``bf16``, ``comms_logger``, the monitors, ``activation_checkpointing``)
are imported from their upstream modules, and the small blocks upstream reads key by key are defined here. Unknown
top-level keys are ignored with one warning; unknown keys inside strict blocks are errors (see docs/config.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field, field_validator, model_validator

from deepspeed._core.config.plan import ReduceOp
from deepspeed.comm.config import CommsLoggerConfig
from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig
from deepspeed.runtime.config_utils import DeepSpeedConfigModel, DeepSpeedLenientConfigModel
from deepspeed.runtime.constants import ValidationMode
from deepspeed.runtime.precision_config import (
    DataTypesConfig,
    DeepSpeedBF16Config,
    DeepSpeedFP16Config,
    to_torch_dtype,
    validate_float_dtype_name,
)
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum, read_zero_config_deprecated

# --------------------------------------------------------------------------------------------------------------
# Blocks upstream reads key by key (unknown keys ignored with a warning).


class DeepSpeedFlopsProfilerConfig(DeepSpeedLenientConfigModel):
    """``flops_profiler`` block; enabling it also turns on ``wall_clock_breakdown``."""

    config_block: ClassVar[str] = "flops_profiler"

    enabled: bool = False
    """Profile one training step's FLOPs, latency and parameters."""
    recompute_fwd_factor: float = 0.0
    """Extra forward cost of activation recomputation, as a fraction of one forward."""
    profile_step: int = Field(1, ge=0)
    """Global step at which to profile."""
    module_depth: int = -1
    """Depth of the module tree to report (-1 = all)."""
    top_modules: int = 1
    """How many of the most expensive modules to list."""
    detailed: bool = True
    """Print the per-module breakdown."""
    output_file: str | None = None
    """Write the report here instead of stdout."""


class CheckpointParallelWriteConfig(DeepSpeedLenientConfigModel):
    """``checkpoint.parallel_write``."""

    config_block: ClassVar[str] = "checkpoint.parallel_write"

    pipeline_stage: bool = False
    """Pipeline runs: every stage writes its own layers in parallel."""


class CheckpointConfig(DeepSpeedLenientConfigModel):
    """``checkpoint`` block."""

    config_block: ClassVar[str] = "checkpoint"
    tolerated_keys: ClassVar[frozenset[str]] = frozenset({"writer"})

    tag_validation: str = ValidationMode.WARN
    """Check that all ranks save with the same tag: ``WARN``, ``IGNORE`` or ``FAIL`` (case-insensitive)."""
    load_universal: bool = False
    """Load a universal (world-size independent) checkpoint."""
    use_node_local_storage: bool = False
    """Each node writes to its own storage (local rank 0 of every node writes)."""
    parallel_write: CheckpointParallelWriteConfig = Field(default_factory=CheckpointParallelWriteConfig)
    """Parallel-write options."""
    checkpoint_serialization: bool = True
    """Serialize with ``torch.save`` (upstream switch; other writers are not implemented)."""

    @field_validator("tag_validation")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        mode = str(value).upper()
        if mode not in (ValidationMode.WARN, ValidationMode.IGNORE, ValidationMode.FAIL):
            raise ValueError(f"must be one of WARN, IGNORE, FAIL; got {value!r}")
        return mode


class AioConfig(DeepSpeedLenientConfigModel):
    """``aio`` block: asynchronous NVMe I/O settings."""

    config_block: ClassVar[str] = "aio"
    tolerated_keys: ClassVar[frozenset[str]] = frozenset({"thread_count"})

    block_size: int = Field(1048576, gt=0)
    """Bytes per I/O request."""
    queue_depth: int = Field(8, gt=0)
    """Outstanding requests per I/O thread."""
    intra_op_parallelism: int = Field(1, gt=0)
    """I/O threads per operation."""
    single_submit: bool = False
    """Submit requests one at a time instead of batched."""
    overlap_events: bool = True
    """Overlap request submission with completion polling."""
    use_gds: bool = False
    """Use GPUDirect Storage."""


class OptimizerBlockConfig(DeepSpeedLenientConfigModel):
    """``optimizer`` block: ``{"type": name, "params": {...}}``; params pass through to the optimizer."""

    config_block: ClassVar[str] = "optimizer"

    type: str | None = None
    """Optimizer name: a DeepSpeed optimizer (compared lower-case) or a ``torch.optim`` class name."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the optimizer constructor."""
    legacy_fusion: bool = False
    """Upstream legacy fused-optimizer switch (accepted; ignored)."""

    @field_validator("params")
    @classmethod
    def _no_max_grad_norm(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "max_grad_norm" in value:
            raise ValueError(
                "'max_grad_norm' is not supported as an optimizer parameter; use the top-level "
                "'gradient_clipping' key instead"
            )
        return value


class SchedulerBlockConfig(DeepSpeedLenientConfigModel):
    """``scheduler`` block: ``{"type": name, "params": {...}}``."""

    config_block: ClassVar[str] = "scheduler"

    type: str | None = None
    """Scheduler name from ``deepspeed.runtime.lr_schedules`` or ``torch.optim.lr_scheduler``."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the scheduler constructor."""


class MemoryTimelineConfig(DeepSpeedConfigModel):
    """``memory_timeline`` block (a deepspeed-lean key): record one optimizer step's allocator history and write
    it with a per-category summary and chart (see docs/config.md)."""

    config_block: ClassVar[str] = "memory_timeline"

    enabled: bool = False
    """Record the allocator history of one optimizer step (CUDA only; elsewhere one warning, nothing recorded)."""
    step: int = Field(2, ge=1)
    """Global optimizer step to record, counting from 1: from its first micro-step through its optimizer step."""
    path: str = Field("memory_timeline", min_length=1)
    """Output prefix: every rank writes ``<path>_rank<r>.pickle``, ``.json`` and (with matplotlib) ``.png``."""
    max_entries: int = Field(1_000_000, ge=1)
    """Size of the allocator's history ring buffer; entries beyond it overwrite the oldest."""


# --------------------------------------------------------------------------------------------------------------
# The whole config.

# Upstream top-level keys this package accepts without modelling; they never trigger the unknown-key warning.
_TOLERATED_TOP_LEVEL_KEYS = frozenset(
    {
        "amp",
        "torch_autocast",
        "pipeline",
        "elasticity",
        "autotuning",
        "compression_training",
        "data_efficiency",
        "curriculum_learning",
        "eigenvalue",
        "progressive_layer_drop",
        "sparse_attention",
        "compile",
        "timers",
        "nebula",
        "weight_quantization",
        "hybrid_engine",
        "tensor_parallel",
        "data_parallel_size",
        "quantize_training",
        "use_data_before_expert_parallelism",
        "bfloat16",
        "zenflow",
        "deepcompile",
        "expert_parallel",
    }
)


class _RootConfig(DeepSpeedLenientConfigModel):
    """Every modelled key of a DeepSpeed config; unknown top-level keys are ignored with one warning."""

    config_block: ClassVar[str] = ""
    tolerated_keys: ClassVar[frozenset[str]] = _TOLERATED_TOP_LEVEL_KEYS

    train_batch_size: int | None = None
    """Global batch size per optimizer step (see the batch triangle)."""
    train_micro_batch_size_per_gpu: int | None = None
    """Samples per forward/backward on one data-parallel rank."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches accumulated before each optimizer step."""
    managed_gradient_accumulation: bool = True
    """The engine decides the accumulation boundary; false means every ``step()`` is a boundary."""
    steps_per_print: int | float | None = None
    """Log progress every N steps; ``None`` disables it, ``inf`` is accepted (Accelerate passes it)."""
    wall_clock_breakdown: bool = False
    """Time forward/backward/step (forced on by an enabled ``flops_profiler``)."""
    memory_breakdown: bool = False
    """Log memory usage at step boundaries."""
    dump_state: bool = False
    """Log the engine state after initialisation."""
    sparse_gradients: bool = False
    """Reduce ``nn.Embedding`` gradients as sparse tensors."""
    disable_allgather: bool = False
    """Upstream legacy switch (accepted; ignored)."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch in the engine-built data loader."""
    gradient_clipping: float = Field(1.0, ge=0.0)
    """Global gradient-norm clip; 0.0 disables. Default 1.0 since upstream v0.19.3."""
    prescale_gradients: bool = False
    """Divide gradients by the world size before the reduction instead of after."""
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    """Divide gradients by this before the reduction and by world/factor after it."""
    gradient_allreduce_op: ReduceOp = ReduceOp.MEAN
    """How data-parallel gradients are combined: ``mean`` or ``sum`` (``sum`` is rejected with ZeRO-3)."""
    communication_data_type: str | None = None
    """dtype for gradient reduction (``fp16``/``bf16``/``fp32``); unset follows the working dtype."""
    seq_parallel_communication_data_type: str = "fp32"
    """dtype for sequence-parallel communication."""
    zero_allow_untested_optimizer: bool = False
    """Allow a client optimizer ZeRO does not know."""
    zero_force_ds_cpu_optimizer: bool = True
    """With optimizer offload, require a DeepSpeed CPU optimizer."""
    vocabulary_size: int | None = None
    """Model vocabulary size (warns when not a multiple of 8)."""
    log_level: str | None = None
    """Logger level for DeepSpeed messages."""
    graph_harvesting: bool = False
    """Upstream CUDA-graph switch (accepted; ignored)."""
    sequence_parallel_size: int = Field(1, ge=1)
    """Ranks per sequence-parallel group; the data-parallel size is world / this."""
    optimizer: OptimizerBlockConfig | None = None
    """The ``optimizer`` block."""
    scheduler: SchedulerBlockConfig | None = None
    """The ``scheduler`` block."""
    zero_optimization: DeepSpeedZeroConfig = Field(default_factory=DeepSpeedZeroConfig)
    """The ``zero_optimization`` block."""
    fp16: DeepSpeedFP16Config = Field(default_factory=DeepSpeedFP16Config)
    """The ``fp16`` block."""
    bf16: DeepSpeedBF16Config = Field(default_factory=DeepSpeedBF16Config)
    """The ``bf16`` block (legacy spelling ``bfloat16``)."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """The ``data_types`` block."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """The ``checkpoint`` block."""
    activation_checkpointing: DeepSpeedActivationCheckpointingConfig = Field(
        default_factory=DeepSpeedActivationCheckpointingConfig
    )
    """The ``activation_checkpointing`` block."""
    flops_profiler: DeepSpeedFlopsProfilerConfig = Field(default_factory=DeepSpeedFlopsProfilerConfig)
    """The ``flops_profiler`` block."""
    aio: AioConfig = Field(default_factory=AioConfig)
    """The ``aio`` block."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """The ``comms_logger`` block."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """The ``tensorboard`` monitor block."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """The ``wandb`` monitor block."""
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    """The ``csv_monitor`` monitor block."""
    comet: CometConfig = Field(default_factory=CometConfig)
    """The ``comet`` monitor block."""
    memory_timeline: MemoryTimelineConfig = Field(default_factory=MemoryTimelineConfig)
    """The ``memory_timeline`` block (allocator history of one step, by category)."""

    _dtype_names_valid = field_validator("communication_data_type", "seq_parallel_communication_data_type")(
        validate_float_dtype_name
    )

    @classmethod
    def _rewrite_legacy_input(cls, data: dict) -> dict:
        if isinstance(data.get("zero_optimization"), bool):
            data["zero_optimization"] = read_zero_config_deprecated(data)
        if "bfloat16" in data:
            # Legacy block name; "bf16" wins when both are given.
            legacy = data.pop("bfloat16")
            data.setdefault("bf16", legacy)
        return data

    @field_validator("steps_per_print")
    @classmethod
    def _positive_or_none(cls, value: int | float | None) -> int | float | None:
        if value is not None and not value > 0:  # also rejects NaN
            raise ValueError(f"must be > 0, inf or null; got {value!r}")
        return value

    @model_validator(mode="after")
    def _cross_block_checks(self) -> _RootConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled cannot both be true; enable at most one")
        wanted = to_torch_dtype(self.data_types.param_dtype)
        if wanted is not None and wanted != mode_dtype(self):
            raise ValueError(
                f"data_types.param_dtype={self.data_types.param_dtype!r} disagrees with the fp16/bf16 "
                f"blocks, which select {mode_dtype(self)}"
            )
        if self.gradient_allreduce_op == ReduceOp.SUM and self.zero_optimization.stage == ZeroStageEnum.weights:
            raise ValueError("gradient_allreduce_op='sum' is not supported with zero_optimization.stage 3; use 'mean'")
        return self


def mode_dtype(root: _RootConfig) -> torch.dtype:
    """Working parameter dtype selected by the precision blocks."""
    if root.bf16.enabled:
        return torch.bfloat16
    if root.fp16.enabled:
        return torch.float16
    return torch.float32
