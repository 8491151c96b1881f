"""Frozen run plan: the validated config, turned once into small immutable policy objects.

The pydantic models of this room keep upstream's JSON keys, aliases and deprecations. ``DeepSpeedConfig`` validates
them once and ``convert.py`` (the one conversion, also used by the façades that build optimizers without the
engine) turns them into a :class:`RunPlan`; everything else under ``deepspeed._core`` receives these plan objects
and never the pydantic models or the raw dict. That keeps flags from being threaded through constructors (see
docs/design/conventions.md).

A config key that changes nothing here has no plan field: what users are told about such keys is the config
surface (``surface.py``).

Nothing here imports a façade module or touches a process group: plans are pure data.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


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

    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    dp_world_size: int


@dataclass(frozen=True)
class LossScalePolicy:
    """fp16 loss scaling. ``dynamic`` False means a static scale of ``static_scale``."""

    dynamic: bool = True
    static_scale: float = 1.0
    initial_scale_power: int = 16
    scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0


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

    param_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    comm_dtype: torch.dtype = torch.float32
    buffer_dtype: torch.dtype | None = None
    loss_scale: LossScalePolicy | None = None
    auto_cast: bool = False
    master_dtype: torch.dtype = torch.float32
    check_grad_overflow: bool = True

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

    clip_norm: float = 1.0
    """Global-norm clip value; ``0.0`` disables clipping (upstream ``gradient_clipping``)."""
    prescale: bool = False
    """Divide gradients before the reduction instead of after it (``prescale_gradients``)."""
    predivide_factor: float = 1.0
    """``gradient_predivide_factor``: divide by this before reducing, by world/factor after."""
    reduce_op: ReduceOp = ReduceOp.MEAN


@dataclass(frozen=True)
class BucketPolicy:
    """Bucketing of gradient reduction and parameter all-gather (sizes in elements)."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    reduce_scatter: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """One offload target (optimizer state or parameters)."""

    device: OffloadDevice = OffloadDevice.NONE
    pin_memory: bool = True

    @property
    def enabled(self) -> bool:
        """True when this tensor class is offloaded anywhere."""
        return self.device != OffloadDevice.NONE


@dataclass(frozen=True)
class LeanPolicy:
    """The memory-lean mechanisms; each one off reproduces upstream's behaviour for A/B runs.

    Attributes:
        inplace_flatten: ZeRO-1/2 flatten parameters on the device in chunks, never via host memory.
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
    """

    inplace_flatten: bool = True
    eager_grad_release: bool = True
    stream_ordered_release: bool = True
    grads_in_param_shards: bool = True
    pipeline_release: bool = True
    gather_from_master: bool = True
    block_fetch_units: bool = True
    unit_grad_reduce: bool = True


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

    classes: tuple[str, ...] = DEFAULT_LEAF_MODULE_CLASSES
    names: tuple[str, ...] = ()
    name_suffixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Stage3Policy:
    """ZeRO-3 fetch/release knobs (sizes in elements)."""

    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    gather_16bit_weights_on_model_save: bool = False
    module_granularity_threshold: int = 0
    leaf_module: LeafModulePolicy = field(default_factory=LeafModulePolicy)


@dataclass(frozen=True)
class ZeroPlan:
    """Everything the ZeRO optimizers need, resolved from ``zero_optimization``."""

    stage: int = 0
    buckets: BucketPolicy = field(default_factory=BucketPolicy)
    offload_optimizer: OffloadPolicy = field(default_factory=OffloadPolicy)
    offload_param: OffloadPolicy = field(default_factory=OffloadPolicy)
    lean: LeanPolicy = field(default_factory=LeanPolicy)
    stage3: Stage3Policy = field(default_factory=Stage3Policy)
    load_from_fp32_weights: bool = True

    @property
    def shards_are_master_views(self) -> bool:
        """ZeRO-3: whether a stepped parameter's shard becomes its slice of the device master
        (``lean_gather_from_master`` with neither the optimizer nor the parameters offloaded)."""
        return self.lean.gather_from_master and not self.offload_optimizer.enabled and not self.offload_param.enabled


@dataclass(frozen=True)
class MemoryTimelinePolicy:
    """Allocator-history recording of one optimizer step (config ``memory_timeline``).

    Attributes:
        enabled: record and write the timeline.
        step: global optimizer step to record, counting from 1 (first micro-step through the optimizer step).
        path: output prefix; each rank writes ``<path>_rank<r>.pickle``, ``.json`` and ``.png``.
        max_entries: size of the allocator's history ring buffer.
    """

    enabled: bool = False
    step: int = 2
    path: str = "memory_timeline"
    max_entries: int = 1_000_000


@dataclass(frozen=True)
class RunPlan:
    """The whole validated run configuration, as the engine consumes it.

    ``dataloader_drop_last`` is read by the engine façade when it builds the training data loader.
    """

    batch: BatchPlan
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    grads: GradPolicy = field(default_factory=GradPolicy)
    zero: ZeroPlan = field(default_factory=ZeroPlan)
    steps_per_print: float | None = None
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    dataloader_drop_last: bool = False
    memory_timeline: MemoryTimelinePolicy = field(default_factory=MemoryTimelinePolicy)
