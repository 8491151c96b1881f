"""The root model of a DeepSpeed config: one field per top-level key or block, validated in one pass.

:class:`RootConfig` holds each modelled top-level key (upstream names, aliases and defaults) and one field per
block; each block's model lives in its own module of this room. A new block is hooked in with one field here.
Unknown top-level keys are ignored with one warning (``enforce.py``); unknown keys inside strict blocks are errors.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field, field_validator, model_validator

from deepspeed._core.config.activation import DeepSpeedActivationCheckpointingConfig
from deepspeed._core.config.aio import AioConfig
from deepspeed._core.config.base import DeepSpeedLenientConfigModel
from deepspeed._core.config.blocks import (
    CheckpointConfig,
    DeepSpeedFlopsProfilerConfig,
    MemoryTimelineConfig,
    OptimizerBlockConfig,
    SchedulerBlockConfig,
)
from deepspeed._core.config.comms import CommsLoggerConfig
from deepspeed._core.config.monitor import CometConfig, CSVConfig, TensorBoardConfig, TimersConfig, WandbConfig
from deepspeed._core.config.plan import ReduceOp
from deepspeed._core.config.precision import (
    DataTypesConfig,
    DeepSpeedBF16Config,
    DeepSpeedFP16Config,
    to_torch_dtype,
    validate_float_dtype_name,
)
from deepspeed._core.config.zero import DeepSpeedZeroConfig, ZeroStageEnum, read_zero_config_deprecated

# --------------------------------------------------------------------------------------------------------------
# The whole config.

# Upstream top-level keys this package accepts without modelling; they never trigger the unknown-key warning.
TOLERATED_TOP_LEVEL_KEYS = frozenset(
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


class RootConfig(DeepSpeedLenientConfigModel):
    """Every modelled key of a DeepSpeed config; unknown top-level keys are ignored with one warning."""

    config_block: ClassVar[str] = ""
    tolerated_keys: ClassVar[frozenset[str]] = TOLERATED_TOP_LEVEL_KEYS
    # Every rank validates the config, some more than once (the engine, zero.Init): enforce.py warns about unknown
    # top-level keys instead, once per process and on the first rank only.
    warns_unknown_keys: ClassVar[bool] = False

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
    """dtype gradients are reduced in under sequence parallelism (replaces ``communication_data_type`` there)."""
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
    timers: TimersConfig = Field(default_factory=TimersConfig)
    """The ``timers`` block (the throughput timer)."""
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
    def _cross_block_checks(self) -> RootConfig:
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
        if self.gradient_allreduce_op == ReduceOp.SUM and self.zero_optimization.zenflow is not None:
            raise ValueError("gradient_allreduce_op='sum' is not supported with zero_optimization.zenflow; use 'mean'")
        return self


def mode_dtype(root: RootConfig) -> torch.dtype:
    """Working parameter dtype selected by the precision blocks."""
    if root.bf16.enabled:
        return torch.bfloat16
    if root.fp16.enabled:
        return torch.float16
    return torch.float32
