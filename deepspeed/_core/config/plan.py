"""Frozen run plan: the validated config, turned once into small immutable policy objects.

The pydantic models of this room keep upstream's JSON keys, aliases and deprecations. ``DeepSpeedConfig`` validates
them once and ``convert.py`` (the one conversion, also used by the façades that build optimizers without the
engine) turns them into a :class:`RunPlan`; everything else under ``deepspeed._core`` receives these plan objects
and never the pydantic models or the raw dict. That keeps flags from being threaded through constructors (see
docs/design/conventions.md).

[Note: plan keys] Every plan field says where its value comes from, in its dataclass metadata: :func:`key`
names the config key it copies (relative to the block the policy is filled from, optionally with a converter),
:func:`nested` the block a nested policy is filled from, and :func:`derived` the keys a value is computed from by a
named function of ``convert.py``. ``convert.fill`` reads the metadata, so a key with an effect needs one plan field
and no conversion code; ``tests/unit/config/test_plan_keys.py`` checks every field against the schema and the
surface table. A config key that changes nothing here has no plan field: what users are told about such keys is the
config surface (``surface.py``).

Nothing here imports a façade module or touches a process group: plans are pure data.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any

import torch

KEY = "config_key"
"""Metadata name: the config key (dotted, relative to the policy's block) a field copies."""
CONVERT = "config_convert"
"""Metadata name: the function applied to the key's validated value (identity when absent)."""
NESTED = "config_block"
"""Metadata name: ``(block, policy class)`` of a nested policy (``""``: the same block as its parent)."""
DERIVED = "config_derived"
"""Metadata name: the config keys (relative, as for ``KEY``) a computed field is derived from."""


def key(path: str, default: Any = MISSING, convert: Callable[[Any], Any] | None = None) -> Any:
    """A plan field that copies the config key ``path`` (see [Note: plan keys])."""
    return field(default=default, metadata={KEY: path, CONVERT: convert})


def nested(block: str, policy: type, default: Any = MISSING) -> Any:
    """A plan field holding ``policy`` filled from the sub-block ``block`` (``""``: the same block)."""
    if default is MISSING:
        return field(default_factory=policy, metadata={NESTED: (block, policy)})
    return field(default=default, metadata={NESTED: (block, policy)})


def derived(*paths: str, default: Any = MISSING) -> Any:
    """A plan field computed from the config keys ``paths`` by a named function of ``convert.py``."""
    return field(default=default, metadata={DERIVED: paths})


class OffloadDevice(str, enum.Enum):
    """Where an offloaded tensor class lives (upstream ``OffloadDeviceEnum`` values)."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class ReduceOp(str, enum.Enum):
    """How data-parallel gradients are combined (``gradient_allreduce_op``)."""

    MEAN = "mean"
    SUM = "sum"


@dataclass(frozen=True)
class BatchPlan:
    """The batch-size triangle, already resolved and checked.

    Invariant: ``train_batch_size == micro_batch_per_gpu * gradient_accumulation_steps * dp_world_size``.
    """

    train_batch_size: int = derived("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    micro_batch_per_gpu: int = derived(
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
    )
    gradient_accumulation_steps: int = derived(
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
    )
    dp_world_size: int = derived("sequence_parallel_size")


@dataclass(frozen=True)
class LossScalePolicy:
    """fp16 loss scaling. ``dynamic`` False means a static scale of ``static_scale``."""

    dynamic: bool = key("loss_scale", True, lambda scale: scale == 0)
    static_scale: float = key("loss_scale", 1.0, lambda scale: float(scale or 1.0))
    initial_scale_power: int = key("initial_scale_power", 16)
    scale_window: int = key("loss_scale_window", 1000)
    hysteresis: int = key("hysteresis", 2)
    consecutive_hysteresis: bool = key("consecutive_hysteresis", False)
    min_scale: float = key("min_loss_scale", 1.0, float)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Working dtypes.

    Attributes:
        param_dtype: dtype of the model's working parameters (fp32, fp16 or bf16).
        grad_accum_dtype: dtype gradients are accumulated in across micro-batches.
        comm_dtype: dtype gradients are reduced in.
        buffer_dtype: dtype module buffers are cast to; ``None`` keeps their loaded dtype.
        loss_scale: fp16 loss-scaling policy; ``None`` when fp16 is off.
        auto_cast: cast floating inputs of ``forward`` to ``param_dtype`` (fp16 ``auto_cast``).
        master_dtype: dtype of the optimizer's master weights (fp32 unless a lean fp16/bf16 master flag is set).
        check_grad_overflow: bf16 only: whether to check gradients for inf/nan before stepping.
    """

    param_dtype: torch.dtype = derived("fp16.enabled", "bf16.enabled", default=torch.float32)
    grad_accum_dtype: torch.dtype = derived("data_types.grad_accum_dtype", default=torch.float32)
    comm_dtype: torch.dtype = derived("communication_data_type", default=torch.float32)
    buffer_dtype: torch.dtype | None = derived("data_types.buffer_dtype", default=None)
    loss_scale: LossScalePolicy | None = nested("fp16", LossScalePolicy, default=None)
    auto_cast: bool = derived("fp16.auto_cast", default=False)
    master_dtype: torch.dtype = derived(
        "fp16.fp16_master_weights_and_grads", "bf16.bf16_master_weights_and_grads", default=torch.float32
    )
    check_grad_overflow: bool = derived("bf16.check_grad_overflow", default=True)

    @property
    def fp16(self) -> bool:
        """True when working parameters are fp16 (loss scaling applies)."""
        return self.param_dtype == torch.float16

    @property
    def bf16(self) -> bool:
        """True when working parameters are bf16."""
        return self.param_dtype == torch.bfloat16


@dataclass(frozen=True)
class GradPolicy:
    """Gradient post-processing common to every stage."""

    clip_norm: float = key("gradient_clipping", 1.0, float)
    """Global-norm clip value; ``0.0`` disables clipping."""
    prescale: bool = key("prescale_gradients", False)
    """Divide gradients before the reduction instead of after it."""
    predivide_factor: float = key("gradient_predivide_factor", 1.0, float)
    """Divide by this before reducing, by world/factor after."""
    reduce_op: ReduceOp = key("gradient_allreduce_op", ReduceOp.MEAN, ReduceOp)


@dataclass(frozen=True)
class BucketPolicy:
    """Bucketing of gradient reduction and parameter all-gather (sizes in elements)."""

    reduce_bucket_size: int = key("reduce_bucket_size", 500_000_000)
    allgather_bucket_size: int = key("allgather_bucket_size", 500_000_000)
    overlap_comm: bool = key("overlap_comm", False, bool)
    reduce_scatter: bool = key("reduce_scatter", True)


@dataclass(frozen=True)
class OffloadPolicy:
    """One offload target (optimizer state or parameters)."""

    device: OffloadDevice = key("device", OffloadDevice.NONE, OffloadDevice)
    pin_memory: bool = key("pin_memory", True)

    @property
    def enabled(self) -> bool:
        """True when this tensor class is offloaded anywhere."""
        return self.device != OffloadDevice.NONE


@dataclass(frozen=True)
class OptimizerOffloadPolicy(OffloadPolicy):
    """The optimizer-state offload target; the NVMe fields apply to ``device == NVME``.

    Attributes:
        nvme_path: directory of the swap files.
        buffer_count: host buffer sets (one step chunk's master and moments each) the swapper cycles through.
        pipeline_read: read the next step chunks from NVMe while the current one steps.
        pipeline_write: write stepped chunks back to NVMe while the next ones step.
    """

    nvme_path: str | None = key("nvme_path", None, lambda path: None if path is None else str(path))
    buffer_count: int = key("buffer_count", 4)
    pipeline_read: bool = key("pipeline_read", False)
    pipeline_write: bool = key("pipeline_write", False)


@dataclass(frozen=True)
class ParamOffloadPolicy(OffloadPolicy):
    """The ZeRO-3 parameter offload target; the NVMe fields apply to ``device == NVME``.

    Attributes:
        nvme_path: directory of the parameter swap files.
        buffer_count: pinned host buffers partitions are read into for a gather.
        buffer_size: elements of each buffer (the largest partition that can be swapped).
        max_in_cpu: elements of partitions kept in host memory instead of swapped (partitions under
            max(1 MiB, ``aio.block_size``) bytes always stay and do not count).
    """

    nvme_path: str | None = key("nvme_path", None, lambda path: None if path is None else str(path))
    buffer_count: int = key("buffer_count", 5)
    buffer_size: int = key("buffer_size", 100_000_000)
    max_in_cpu: int = key("max_in_cpu", 1_000_000_000)


@dataclass(frozen=True)
class LeanPolicy:
    """The memory-lean mechanisms; each one off reproduces upstream's behaviour for A/B runs.

    Attributes:
        inplace_flatten: ZeRO-1/2 flatten parameters on the device in chunks, never via host memory; ZeRO-3 on one
            rank keeps a parameter already in place as its own shard.
        eager_grad_release: autograd ``.grad`` buffers are folded into accumulators/buckets and freed
            as each bucket is reduced.
        stream_ordered_release: ZeRO-3 gathered partitions are freed on an event-ordered schedule,
            never by recording tensors as used on a side stream.
        grads_in_param_shards: ZeRO-3 with the optimizer offloaded and one micro-step per window keeps each
            reduced gradient in its parameter's shard until the step, not in host memory.
        pipeline_release: pipeline stages free each micro-batch's activations right after its backward (the
            last stage included), never holding more than the 1F1B schedule needs.
        gather_from_master: ZeRO-3 with the optimizer state on the device: a stepped parameter's shard is its
            slice of the fp32 master (no 16-bit copy beside it; gathers convert on the way into the wire buffer).
        block_fetch_units: ZeRO-3 fetches each repeated block (a child of a ``ModuleList`` of like modules, at
            most ``stage3_max_live_parameters`` elements) as one unit, with hooks only at its boundary.
        unit_grad_reduce: ZeRO-3 over several ranks reduce-scatters each fetch unit's gradients together at the
            end of the unit's backward, not in ``reduce_bucket_size`` buckets.
        overlap_offload_step: with ``offload_optimizer``, a host worker steps chunk by chunk while each stepped chunk
            goes up to the accelerator ([Note: overlapped host step]).
        short_switch_interval: while that worker has chunks, the interpreter's switch interval is short
            ([Note: short switch interval]).
    """

    inplace_flatten: bool = key("lean_inplace_flatten", True)
    eager_grad_release: bool = key("lean_eager_grad_release", True)
    stream_ordered_release: bool = key("lean_stream_ordered_release", True)
    grads_in_param_shards: bool = key("lean_grads_in_param_shards", True)
    pipeline_release: bool = key("lean_pipeline_release", True)
    gather_from_master: bool = key("lean_gather_from_master", True)
    block_fetch_units: bool = key("lean_block_fetch_units", True)
    unit_grad_reduce: bool = key("lean_unit_grad_reduce", True)
    overlap_offload_step: bool = key("lean_overlap_offload_step", True)
    short_switch_interval: bool = key("lean_short_switch_interval", True)


DEFAULT_LEAF_MODULE_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""Upstream's default ``zero_optimization.leaf_module.classes``: Hugging Face MoE blocks whose experts run in a
data-dependent order. Entries of this list that match nothing are not reported."""


@dataclass(frozen=True)
class LeafModulePolicy:
    """ZeRO-3 leaf-module selection (``zero_optimization.leaf_module``); rules in ``_core/params/leaf_policy.py``.

    Attributes:
        classes: class names, bare (``__name__``) or fully qualified (``module.qualname``).
        names: qualified module names as ``named_modules()`` yields them.
        name_suffixes: suffixes of those qualified names.
    """

    classes: tuple[str, ...] = key("classes", DEFAULT_LEAF_MODULE_CLASSES, tuple)
    names: tuple[str, ...] = key("names", (), tuple)
    name_suffixes: tuple[str, ...] = key("name_suffixes", (), tuple)


@dataclass(frozen=True)
class Stage3Policy:
    """ZeRO-3 fetch/release knobs (sizes in elements)."""

    prefetch_bucket_size: int = key("prefetch_bucket_size", 50_000_000)
    max_live_parameters: int = key("max_live_parameters", 1_000_000_000)
    max_reuse_distance: int = key("max_reuse_distance", 1_000_000_000)
    param_persistence_threshold: int = key("param_persistence_threshold", 100_000)
    model_persistence_threshold: int = key("model_persistence_threshold", 2**63 - 1)
    gather_16bit_weights_on_model_save: bool = key("gather_16bit_weights_on_model_save", False)
    module_granularity_threshold: int = key("module_granularity_threshold", 0)
    leaf_module: LeafModulePolicy = nested("leaf_module", LeafModulePolicy)


@dataclass(frozen=True)
class ZenFlowPolicy:
    """``zero_optimization.zenflow`` (docs/offload.md); ``"auto"`` intervals stay the string ``"auto"``."""

    topk_ratio: float = key("topk_ratio", 0.1)
    select_strategy: str = key("select_strategy", "auto")
    select_interval: int | str = key("select_interval", "auto")
    update_interval: int | str = key("update_interval", "auto")
    overlap_step: bool = key("overlap_step", False)
    auto_ratio: float = key("auto_ratio", 0.99)
    full_warm_up_rounds: int = key("full_warm_up_rounds", 0)
    steps_per_epoch: int | None = key("steps_per_epoch", None)


@dataclass(frozen=True)
class ZeroPlan:
    """Everything the ZeRO optimizers need, resolved from ``zero_optimization``."""

    stage: int = key("stage", 0, int)
    buckets: BucketPolicy = nested("", BucketPolicy)
    offload_optimizer: OptimizerOffloadPolicy = nested("offload_optimizer", OptimizerOffloadPolicy)
    offload_param: ParamOffloadPolicy = nested("offload_param", ParamOffloadPolicy)
    lean: LeanPolicy = nested("", LeanPolicy)
    stage3: Stage3Policy = nested("", Stage3Policy)
    zenflow: ZenFlowPolicy | None = nested("zenflow", ZenFlowPolicy, default=None)
    load_from_fp32_weights: bool = key("load_from_fp32_weights", True)
    sub_group_size: int = key("sub_group_size", 1_000_000_000)
    """NVMe optimizer offload: at most this many elements per swapped step chunk."""

    @property
    def shards_are_master_views(self) -> bool:
        """ZeRO-3: whether a stepped parameter's shard becomes its slice of the device master
        (``lean_gather_from_master`` with neither the optimizer nor the parameters offloaded)."""
        return self.lean.gather_from_master and not self.offload_optimizer.enabled and not self.offload_param.enabled


@dataclass(frozen=True)
class AioPolicy:
    """How swap files are read and written (the ``aio`` block; the ``aio_handle`` arguments)."""

    block_size: int = key("block_size", 1048576)
    queue_depth: int = key("queue_depth", 8)
    intra_op_parallelism: int = key("intra_op_parallelism", 1)
    single_submit: bool = key("single_submit", False)
    overlap_events: bool = key("overlap_events", True)


@dataclass(frozen=True)
class MemoryTimelinePolicy:
    """Allocator-history recording of one optimizer step (config ``memory_timeline``).

    Attributes:
        enabled: record and write the timeline.
        step: global optimizer step to record, counting from 1 (first micro-step through the optimizer step).
        path: output prefix; each rank writes ``<path>_rank<r>.pickle``, ``.json`` and ``.png``.
        max_entries: size of the allocator's history ring buffer.
    """

    enabled: bool = key("enabled", False)
    step: int = key("step", 2)
    path: str = key("path", "memory_timeline")
    max_entries: int = key("max_entries", 1_000_000)


@dataclass(frozen=True)
class FileMonitorPolicy:
    """A monitor that writes files under ``<output_path>/<job_name>/`` (config ``tensorboard``, ``csv_monitor``)."""

    enabled: bool = key("enabled", False)
    output_path: str = key("output_path", "")
    job_name: str = key("job_name", "DeepSpeedJobName")


@dataclass(frozen=True)
class WandbPolicy:
    """The Weights & Biases monitor (config ``wandb``)."""

    enabled: bool = key("enabled", False)
    group: str | None = key("group", None)
    team: str | None = key("team", None)
    project: str = key("project", "deepspeed")


@dataclass(frozen=True)
class CometPolicy:
    """The Comet monitor (config ``comet``); ``None`` leaves a setting to Comet's own configuration."""

    enabled: bool = key("enabled", False)
    samples_log_interval: int = key("samples_log_interval", 100)
    project: str | None = key("project", None)
    workspace: str | None = key("workspace", None)
    api_key: str | None = key("api_key", None)
    experiment_name: str | None = key("experiment_name", None)
    experiment_key: str | None = key("experiment_key", None)
    online: bool | None = key("online", None)
    mode: str | None = key("mode", None)


@dataclass(frozen=True)
class FlopsProfilerPolicy:
    """The FLOPs profile of one training step (config ``flops_profiler``)."""

    enabled: bool = key("enabled", False)
    recompute_fwd_factor: float = key("recompute_fwd_factor", 0.0)
    profile_step: int = key("profile_step", 1)
    module_depth: int = key("module_depth", -1)
    top_modules: int = key("top_modules", 1)
    detailed: bool = key("detailed", True)
    output_file: str | None = key("output_file", None)


@dataclass(frozen=True)
class ThroughputTimerPolicy:
    """The samples-per-second timer (config ``timers.throughput``)."""

    enabled: bool = key("enabled", True)
    synchronized: bool = key("synchronized", True)


@dataclass(frozen=True)
class TimersPolicy:
    """The engine's timers (config ``timers``)."""

    throughput: ThroughputTimerPolicy = nested("throughput", ThroughputTimerPolicy)


@dataclass(frozen=True)
class RunPlan:
    """The whole validated run configuration, as the engine consumes it.

    ``dataloader_drop_last`` is read by the engine façade when it builds the training data loader.
    """

    batch: BatchPlan = field(metadata={NESTED: ("", BatchPlan)})  # resolved by batch.py, so no default
    precision: PrecisionPolicy = nested("", PrecisionPolicy)
    grads: GradPolicy = nested("", GradPolicy)
    zero: ZeroPlan = nested("zero_optimization", ZeroPlan)
    steps_per_print: float | None = key("steps_per_print", None)
    wall_clock_breakdown: bool = derived("wall_clock_breakdown", "flops_profiler.enabled", default=False)
    memory_breakdown: bool = key("memory_breakdown", False)
    zero_allow_untested_optimizer: bool = key("zero_allow_untested_optimizer", False)
    zero_force_ds_cpu_optimizer: bool = key("zero_force_ds_cpu_optimizer", True)
    dataloader_drop_last: bool = key("dataloader_drop_last", False)
    load_universal: bool = key("checkpoint.load_universal", False)
    memory_timeline: MemoryTimelinePolicy = nested("memory_timeline", MemoryTimelinePolicy)
    tensorboard: FileMonitorPolicy = nested("tensorboard", FileMonitorPolicy)
    csv_monitor: FileMonitorPolicy = nested("csv_monitor", FileMonitorPolicy)
    wandb: WandbPolicy = nested("wandb", WandbPolicy)
    comet: CometPolicy = nested("comet", CometPolicy)
    flops_profiler: FlopsProfilerPolicy = nested("flops_profiler", FlopsProfilerPolicy)
    timers: TimersPolicy = nested("timers", TimersPolicy)
    aio: AioPolicy = nested("aio", AioPolicy)
