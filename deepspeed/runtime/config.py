"""``DeepSpeedConfig``: read a DeepSpeed JSON config once, validate it, and build the frozen run plan.

Flow (see docs/config.md):

1. :func:`load_config_dict` turns a dict / file path (JSON or hjson) / base64 or raw JSON string into a dict.
2. ``_RootConfig`` validates every block in one pass (pydantic models with upstream keys, aliases, defaults).
   Unknown top-level keys are ignored with one warning; unknown keys inside strict blocks are errors.
3. :func:`resolve_batch` settles the batch-size triangle against the data-parallel world size.
4. ``DeepSpeedConfig.plan`` converts the validated models into a :class:`deepspeed._core.config.plan.RunPlan` once.

``DeepSpeedConfig`` itself only holds those results and exposes upstream attribute names as properties.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import os
from typing import Any, ClassVar

import hjson
import torch
from pydantic import Field, field_validator, model_validator

from deepspeed._core.config.plan import (BatchPlan, BucketPolicy, GradPolicy, LeafModulePolicy, LeanPolicy, LossScalePolicy,
                                  MemoryTimelinePolicy, OffloadDevice, OffloadPolicy, PrecisionPolicy, ReduceOp,
                                  RunPlan, Stage3Policy, ZeroPlan)
from deepspeed.comm.config import CommsLoggerConfig, DeepSpeedCommsConfig
from deepspeed.monitor.config import CometConfig, CSVConfig, DeepSpeedMonitorConfig, TensorBoardConfig, WandbConfig
from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig
from deepspeed.runtime.config_surface import enforce_surface
from deepspeed.runtime.config_utils import (DeepSpeedConfigError, DeepSpeedConfigModel, DeepSpeedLenientConfigModel,
                                            dict_raise_error_on_duplicate_keys)
from deepspeed.runtime.constants import (ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAM_W_MODE, ADAM_W_MODE_DEFAULT,
                                         ADAMW_OPTIMIZER, DEEPSPEED_OPTIMIZERS, LAMB_OPTIMIZER, LION_OPTIMIZER,
                                         MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUON_OPTIMIZER, MUSGD_OPTIMIZER,
                                         ONEBIT_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER, TORCH_ADAM_PARAM,
                                         ZERO_ONE_ADAM_OPTIMIZER, ValidationMode)
from deepspeed.runtime.precision_config import (DataTypesConfig, DeepSpeedBF16Config, DeepSpeedFP16Config, DtypeEnum,
                                                validate_float_dtype_name, to_torch_dtype)
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum, read_zero_config_deprecated
from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig
from deepspeed.utils.logging import logger

__all__ = [
    "DeepSpeedConfig", "DeepSpeedConfigError", "DtypeEnum", "load_config_dict", "resolve_batch", "build_run_plan",
    "ADAGRAD_OPTIMIZER", "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER",
    "ZERO_ONE_ADAM_OPTIMIZER", "ONEBIT_LAMB_OPTIMIZER", "MUADAM_OPTIMIZER", "MUADAMW_OPTIMIZER", "MUSGD_OPTIMIZER",
    "LION_OPTIMIZER", "MUON_OPTIMIZER", "DEEPSPEED_OPTIMIZERS", "TORCH_ADAM_PARAM", "ADAM_W_MODE",
    "ADAM_W_MODE_DEFAULT"
]

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
            raise ValueError("'max_grad_norm' is not supported as an optimizer parameter; use the top-level "
                             "'gradient_clipping' key instead")
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
_TOLERATED_TOP_LEVEL_KEYS = frozenset({
    "amp", "torch_autocast", "pipeline", "elasticity", "autotuning", "compression_training", "data_efficiency",
    "curriculum_learning", "eigenvalue", "progressive_layer_drop", "sparse_attention", "compile", "timers", "nebula",
    "weight_quantization", "hybrid_engine", "tensor_parallel", "data_parallel_size", "quantize_training",
    "use_data_before_expert_parallelism", "bfloat16", "zenflow", "deepcompile", "expert_parallel"
})


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
        default_factory=DeepSpeedActivationCheckpointingConfig)
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

    _dtype_names_valid = field_validator("communication_data_type",
                                         "seq_parallel_communication_data_type")(validate_float_dtype_name)

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
    def _cross_block_checks(self) -> "_RootConfig":
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled cannot both be true; enable at most one")
        wanted = to_torch_dtype(self.data_types.param_dtype)
        if wanted is not None and wanted != _mode_dtype(self):
            raise ValueError(f"data_types.param_dtype={self.data_types.param_dtype!r} disagrees with the fp16/bf16 "
                             f"blocks, which select {_mode_dtype(self)}")
        if self.gradient_allreduce_op == ReduceOp.SUM and self.zero_optimization.stage == ZeroStageEnum.weights:
            raise ValueError("gradient_allreduce_op='sum' is not supported with zero_optimization.stage 3; use 'mean'")
        return self


def _mode_dtype(root: _RootConfig) -> torch.dtype:
    """Working parameter dtype selected by the precision blocks."""
    if root.bf16.enabled:
        return torch.bfloat16
    if root.fp16.enabled:
        return torch.float16
    return torch.float32


def _check_unsupported(root: _RootConfig, param_dict: dict) -> None:
    """Refuse keys asking for features this package does not implement; warn about keys without effect (the
    table is ``deepspeed._core.config.surface``)."""
    enforce_surface(root, param_dict)


# --------------------------------------------------------------------------------------------------------------
# Input forms.


def load_config_dict(config: str | os.PathLike | dict) -> dict:
    """Return the config as a dict.

    Args:
        config: a dict (returned as is, not copied: the engine exposes it as ``engine.config``); a path to a
            JSON/hjson file (duplicate keys rejected); a urlsafe-base64 encoded JSON string; or a raw JSON
            object string (the form HF Transformers and Accelerate also accept).

    Raises:
        DeepSpeedConfigError: the input is none of those, or it does not parse to a JSON object.
    """
    if isinstance(config, dict):
        return config
    if isinstance(config, os.PathLike):
        return _read_config_file(os.fspath(config))
    if isinstance(config, str):
        if os.path.isfile(config):
            return _read_config_file(config)
        return _decode_config_string(config)
    raise DeepSpeedConfigError("DeepSpeed config must be a dict, a path to a JSON/hjson file, or a (base64) JSON "
                               f"string; got {type(config).__name__}")


def _read_config_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        # hjson accepts plain JSON plus comments and relaxed syntax, as upstream does.
        parsed = hjson.loads(text, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    except DeepSpeedConfigError as err:
        raise DeepSpeedConfigError(f"DeepSpeed config file '{path}': {err}") from err
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DeepSpeedConfigError(f"DeepSpeed config file '{path}' is not valid JSON/hjson: {err}") from err
    return _require_object(parsed, f"DeepSpeed config file '{path}'")


def _decode_config_string(text: str) -> dict:
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            return _require_object(json.loads(stripped, object_pairs_hook=dict_raise_error_on_duplicate_keys),
                                   "DeepSpeed config string")
        except json.JSONDecodeError as err:
            raise DeepSpeedConfigError(f"DeepSpeed config string looks like JSON but does not parse: {err}") from err
    try:
        decoded = base64.urlsafe_b64decode(stripped.encode("ascii")).decode("utf-8")
        parsed = json.loads(decoded, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    except (binascii.Error, UnicodeError, ValueError) as err:
        if stripped.endswith((".json", ".hjson", ".conf")) or os.sep in stripped:
            raise DeepSpeedConfigError(f"DeepSpeed config file not found: '{text}'") from err
        raise DeepSpeedConfigError("DeepSpeed config string is neither an existing file path, a JSON object, nor "
                                   f"urlsafe-base64 encoded JSON: {text[:80]!r}") from err
    return _require_object(parsed, "decoded base64 DeepSpeed config")


def _require_object(parsed: Any, origin: str) -> dict:
    if not isinstance(parsed, dict):
        raise DeepSpeedConfigError(f"{origin} must hold a JSON object at the top level; got {type(parsed).__name__}")
    return parsed


# --------------------------------------------------------------------------------------------------------------
# Batch-size triangle.


def data_parallel_world_size(mpu: Any = None, mesh_device: Any = None, sequence_parallel_size: int = 1) -> int:
    """Data-parallel world size used by the batch triangle.

    Order: ``mpu.get_data_parallel_world_size()``; else ``deepspeed.comm`` (the mesh's data-parallel group when a
    mesh is given) if it is initialised; else env ``WORLD_SIZE``; else 1. Without an mpu or mesh the size is
    divided by ``sequence_parallel_size``.
    """
    if mpu is not None:
        return int(mpu.get_data_parallel_world_size())
    world = _comm_world_size(mesh_device)
    if world is None:
        raw = os.environ.get("WORLD_SIZE", "1")
        if not raw.strip().isdigit() or int(raw) < 1:
            raise DeepSpeedConfigError(f"environment variable WORLD_SIZE must be a positive integer; got {raw!r}")
        world = int(raw)
    if mesh_device is None and sequence_parallel_size > 1:
        if world % sequence_parallel_size:
            raise DeepSpeedConfigError(f"sequence_parallel_size ({sequence_parallel_size}) must divide the world "
                                       f"size ({world})")
        world //= sequence_parallel_size
    return world


def _comm_world_size(mesh_device: Any) -> int | None:
    # Imported lazily: deepspeed.comm imports config-adjacent modules, and this layer must work (on env
    # WORLD_SIZE) before or without an initialised process group.
    try:
        from deepspeed import comm as dist
    except ImportError:
        return None
    is_initialized = getattr(dist, "is_initialized", None)
    get_world_size = getattr(dist, "get_world_size", None)
    if not callable(is_initialized) or not callable(get_world_size) or not is_initialized():
        return None
    if mesh_device is not None:
        return int(get_world_size(mesh_device.get_group(mesh_dim="data_parallel")))
    return int(get_world_size())


def resolve_batch(train_batch_size: int | None, micro_batch: int | None, grad_acc: int | None,
                  world_size: int) -> BatchPlan:
    """Fill in the missing corner of the batch triangle and check it.

    Any two of ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps``
    determine the third; one alone implies ``gradient_accumulation_steps = 1``.

    Raises:
        DeepSpeedConfigError: neither batch size is given, a value is not positive, or
            ``train_batch_size != micro * accumulation * world_size``.
    """
    for key, value in (("train_batch_size", train_batch_size), ("train_micro_batch_size_per_gpu", micro_batch),
                       ("gradient_accumulation_steps", grad_acc)):
        if value is not None and value <= 0:
            raise DeepSpeedConfigError(f"{key}: {value} has to be greater than 0")
    derived = sum(value is None for value in (train_batch_size, micro_batch, grad_acc)) > 0
    if train_batch_size is not None and micro_batch is not None and grad_acc is None:
        grad_acc = train_batch_size // micro_batch // world_size
    elif train_batch_size is not None and grad_acc is not None and micro_batch is None:
        micro_batch = train_batch_size // world_size // grad_acc
    elif micro_batch is not None and grad_acc is not None and train_batch_size is None:
        train_batch_size = micro_batch * grad_acc * world_size
    elif train_batch_size is not None and micro_batch is None and grad_acc is None:
        grad_acc, micro_batch = 1, train_batch_size // world_size
    elif micro_batch is not None and train_batch_size is None and grad_acc is None:
        grad_acc, train_batch_size = 1, micro_batch * world_size
    elif train_batch_size is None and micro_batch is None:
        raise DeepSpeedConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    plan = BatchPlan(train_batch_size, micro_batch, grad_acc, world_size)
    check_batch(plan, derived)
    return plan


def check_batch(plan: BatchPlan, derived: bool = False) -> None:
    """Raise :class:`DeepSpeedConfigError` unless ``plan`` satisfies the batch-size invariant."""
    product = plan.micro_batch_per_gpu * plan.gradient_accumulation_steps * plan.dp_world_size
    if plan.train_batch_size == product and product > 0:
        return
    hint = " (a value was derived from the others; they do not divide evenly)" if derived else ""
    raise DeepSpeedConfigError(
        "Check batch related parameters: train_batch_size must equal train_micro_batch_size_per_gpu * "
        "gradient_accumulation_steps * data-parallel world size, but "
        f"{plan.train_batch_size} != {plan.micro_batch_per_gpu} * {plan.gradient_accumulation_steps} * "
        f"{plan.dp_world_size}{hint}")


# --------------------------------------------------------------------------------------------------------------
# Plan building: validated models -> frozen policies (deepspeed._core.config.plan).


def _loss_scale_policy(fp16: DeepSpeedFP16Config) -> LossScalePolicy | None:
    if not fp16.enabled:
        return None
    return LossScalePolicy(dynamic=fp16.dynamic_loss_scale, static_scale=float(fp16.loss_scale or 1.0),
                           initial_scale_power=fp16.initial_scale_power, scale_window=fp16.loss_scale_window,
                           hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis,
                           min_scale=float(fp16.min_loss_scale))


def _precision_policy(root: _RootConfig) -> PrecisionPolicy:
    param_dtype = _mode_dtype(root)
    low_precision_master = ((root.fp16.enabled and root.fp16.fp16_master_weights_and_grads)
                            or (root.bf16.enabled and root.bf16.bf16_master_weights_and_grads))
    return PrecisionPolicy(
        param_dtype=param_dtype,
        grad_accum_dtype=to_torch_dtype(root.data_types.grad_accum_dtype) or param_dtype,
        comm_dtype=to_torch_dtype(root.communication_data_type) or param_dtype,
        buffer_dtype=to_torch_dtype(root.data_types.buffer_dtype),
        loss_scale=_loss_scale_policy(root.fp16),
        auto_cast=root.fp16.enabled and root.fp16.auto_cast,
        master_dtype=param_dtype if low_precision_master else torch.float32,
        check_grad_overflow=root.bf16.check_grad_overflow if root.bf16.enabled else True,
    )


def _grad_policy(root: _RootConfig) -> GradPolicy:
    return GradPolicy(clip_norm=root.gradient_clipping, prescale=root.prescale_gradients,
                      predivide_factor=root.gradient_predivide_factor, reduce_op=ReduceOp(root.gradient_allreduce_op))


def _offload_policy(block: DeepSpeedZeroOffloadParamConfig | DeepSpeedZeroOffloadOptimizerConfig | None,
                    default_buffers: int) -> OffloadPolicy:
    if block is None:
        return OffloadPolicy(buffer_count=default_buffers)
    return OffloadPolicy(device=OffloadDevice(block.device), pin_memory=block.pin_memory,
                         buffer_count=block.buffer_count, ratio=getattr(block, "ratio", 1.0),
                         nvme_path=None if block.nvme_path is None else str(block.nvme_path))


def _zero_plan(zero: DeepSpeedZeroConfig) -> ZeroPlan:
    buckets = BucketPolicy(reduce_bucket_size=zero.reduce_bucket_size, allgather_bucket_size=zero.allgather_bucket_size,
                           overlap_comm=bool(zero.overlap_comm), reduce_scatter=zero.reduce_scatter,
                           contiguous_gradients=zero.contiguous_gradients,
                           use_multi_rank_bucket_allreduce=zero.use_multi_rank_bucket_allreduce)
    stage3 = Stage3Policy(prefetch_bucket_size=zero.prefetch_bucket_size, max_live_parameters=zero.max_live_parameters,
                          max_reuse_distance=zero.max_reuse_distance,
                          param_persistence_threshold=zero.param_persistence_threshold,
                          model_persistence_threshold=zero.model_persistence_threshold,
                          gather_16bit_weights_on_model_save=zero.gather_16bit_weights_on_model_save,
                          module_granularity_threshold=zero.module_granularity_threshold,
                          sub_group_size=zero.sub_group_size,
                          leaf_module=LeafModulePolicy(classes=tuple(zero.leaf_module.classes),
                                                       names=tuple(zero.leaf_module.names),
                                                       name_suffixes=tuple(zero.leaf_module.name_suffixes)))
    lean = LeanPolicy(inplace_flatten=zero.lean_inplace_flatten, eager_grad_release=zero.lean_eager_grad_release,
                      stream_ordered_release=zero.lean_stream_ordered_release,
                      grads_in_param_shards=zero.lean_grads_in_param_shards,
                      pipeline_release=zero.lean_pipeline_release)
    return ZeroPlan(stage=int(zero.stage), buckets=buckets, offload_optimizer=_offload_policy(zero.offload_optimizer, 4),
                    offload_param=_offload_policy(zero.offload_param, 5), lean=lean, stage3=stage3,
                    round_robin_gradients=zero.round_robin_gradients,
                    ignore_unused_parameters=zero.ignore_unused_parameters,
                    load_from_fp32_weights=zero.load_from_fp32_weights, elastic_checkpoint=zero.elastic_checkpoint)


def _memory_timeline_policy(block: MemoryTimelineConfig) -> MemoryTimelinePolicy:
    return MemoryTimelinePolicy(enabled=block.enabled, step=block.step, path=block.path, max_entries=block.max_entries)


def build_run_plan(root: _RootConfig, batch: BatchPlan) -> RunPlan:
    """Convert validated config models and a resolved batch into the frozen :class:`RunPlan`."""
    return RunPlan(batch=batch, precision=_precision_policy(root), grads=_grad_policy(root),
                   zero=_zero_plan(root.zero_optimization), steps_per_print=root.steps_per_print,
                   wall_clock_breakdown=root.wall_clock_breakdown or root.flops_profiler.enabled,
                   memory_breakdown=root.memory_breakdown,
                   zero_allow_untested_optimizer=root.zero_allow_untested_optimizer,
                   zero_force_ds_cpu_optimizer=root.zero_force_ds_cpu_optimizer,
                   managed_gradient_accumulation=root.managed_gradient_accumulation,
                   memory_timeline=_memory_timeline_policy(root.memory_timeline))


# --------------------------------------------------------------------------------------------------------------
# The façade.


class _ModelView:
    """Read-only ``DeepSpeedConfig`` attribute backed by one field of the validated root model."""

    def __init__(self, path: str, doc: str) -> None:
        self._parts = path.split(".")
        self.__doc__ = doc

    def __get__(self, obj: "DeepSpeedConfig | None", owner: type | None = None) -> Any:
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
        self._model = _RootConfig.from_dict(self._param_dict)
        _check_unsupported(self._model, self._param_dict)
        self.world_size = data_parallel_world_size(mpu, mesh_device, self._model.sequence_parallel_size)
        self._batch = resolve_batch(self._model.train_batch_size, self._model.train_micro_batch_size_per_gpu,
                                    self._model.gradient_accumulation_steps, self.world_size)
        self.monitor_config = DeepSpeedMonitorConfig(tensorboard=self._model.tensorboard, wandb=self._model.wandb,
                                                     csv_monitor=self._model.csv_monitor, comet=self._model.comet)
        self.comms_config = DeepSpeedCommsConfig(self._param_dict)
        self._plan: RunPlan | None = None

    @property
    def plan(self) -> RunPlan:
        """The frozen run plan, built on first access and cached (rebuilt after a batch-size setter)."""
        if self._plan is None:
            check_batch(self._batch)
            self._plan = build_run_plan(self._model, self._batch)
        return self._plan

    # Batch triangle: settable because upstream's engine.set_train_batch_size() assigns these; the invariant is
    # re-checked when the plan is next built, since callers update two of them one after the other.
    def _set_batch(self, **change: int) -> None:
        self._batch = dataclasses.replace(self._batch, **change)
        self._plan = None

    @property
    def train_batch_size(self) -> int:
        """Global batch size per optimizer step."""
        return self._batch.train_batch_size

    @train_batch_size.setter
    def train_batch_size(self, value: int) -> None:
        self._set_batch(train_batch_size=int(value))

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        """Micro-batch size on one data-parallel rank."""
        return self._batch.micro_batch_per_gpu

    @train_micro_batch_size_per_gpu.setter
    def train_micro_batch_size_per_gpu(self, value: int) -> None:
        self._set_batch(micro_batch_per_gpu=int(value))

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self._batch.gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self._set_batch(gradient_accumulation_steps=int(value))

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
    mics_hierarchial_params_gather = _ModelView("zero_optimization.mics_hierarchical_params_gather",
                                                "MiCS hierarchical gather (upstream attribute spelling).")
    grad_accum_dtype = _ModelView("data_types.grad_accum_dtype", "Gradient-accumulation dtype name, or None.")
    activation_checkpointing_config = _ModelView("activation_checkpointing", "The activation_checkpointing block.")
    flops_profiler_config = _ModelView("flops_profiler", "The flops_profiler block.")
    checkpoint_config = _ModelView("checkpoint", "The checkpoint block.")
    load_universal_checkpoint = _ModelView("checkpoint.load_universal", "Load a universal checkpoint.")
    use_node_local_storage = _ModelView("checkpoint.use_node_local_storage", "Per-node checkpoint writers.")
    checkpoint_parallel_write_pipeline = _ModelView("checkpoint.parallel_write.pipeline_stage",
                                                    "Pipeline stages write in parallel.")

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
        """dtype for sequence-parallel communication."""
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
