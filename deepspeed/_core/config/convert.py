"""The one conversion from validated config blocks to the frozen run plan (``deepspeed/_core/config/plan.py``).

Every place that needs a plan calls this module:

* ``DeepSpeedConfig.plan`` (the engine path): :func:`run_plan` on the validated top-level model;
* the façades that integrations construct without the engine, ``DeepSpeedZeroOptimizer`` and
  ``DeepSpeedZeRoOffload``: they first turn upstream's keyword arguments into the same validated
  ``zero_optimization`` block (``DeepSpeedZeroConfig``), then call :func:`zero_plan`, :func:`stage3_policy`,
  :func:`precision_policy` and :func:`grad_policy` here, so the same settings give the same plan on both paths.

It lives beside the pydantic models rather than in ``deepspeed/_core/config``: its input is those models (upstream
keys, aliases, deprecations resolved), and ``_core`` never imports a façade module. A plain-values version inside
``_core`` would have to list every key a second time, with the model-reading half still needed out here.

Keys that change nothing in this package have no plan field; what users are told about them is the config surface
(``deepspeed/_core/config/surface.py``).
"""

from __future__ import annotations

import torch

from deepspeed._core.config.offload import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig
from deepspeed._core.config.plan import (
    BatchPlan,
    BucketPolicy,
    GradPolicy,
    LeafModulePolicy,
    LeanPolicy,
    LossScalePolicy,
    MemoryTimelinePolicy,
    OffloadDevice,
    OffloadPolicy,
    PrecisionPolicy,
    ReduceOp,
    RunPlan,
    Stage3Policy,
    ZeroPlan,
)
from deepspeed._core.config.precision import DeepSpeedFP16Config, to_torch_dtype
from deepspeed._core.config.schema import MemoryTimelineConfig, RootConfig, mode_dtype
from deepspeed._core.config.zero import DeepSpeedZeroConfig

__all__ = [
    "run_plan",
    "zero_plan",
    "stage3_policy",
    "offload_policy",
    "precision_policy",
    "grad_policy",
    "loss_scale_policy",
]


def loss_scale_policy(fp16: DeepSpeedFP16Config) -> LossScalePolicy | None:
    """The fp16 block's loss scaling, or ``None`` when fp16 is off."""
    if not fp16.enabled:
        return None
    return LossScalePolicy(
        dynamic=fp16.dynamic_loss_scale,
        static_scale=float(fp16.loss_scale or 1.0),
        initial_scale_power=fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_scale=float(fp16.min_loss_scale),
    )


def precision_policy(
    param_dtype: torch.dtype,
    *,
    grad_accum_dtype: torch.dtype | None = None,
    comm_dtype: torch.dtype | None = None,
    buffer_dtype: torch.dtype | None = None,
    loss_scale: LossScalePolicy | None = None,
    auto_cast: bool = False,
    fp16_master_weights_and_grads: bool = False,
    bf16_master_weights_and_grads: bool = False,
    check_grad_overflow: bool = True,
) -> PrecisionPolicy:
    """Working dtypes from the working parameter dtype and the precision settings.

    Unset accumulation and communication dtypes follow ``param_dtype``. Master weights are fp32 unless the master
    flag of the working 16-bit dtype is set. ``check_grad_overflow`` matters under bf16 only (fp16 always checks,
    fp32 never), so it is recorded as true elsewhere.
    """
    low_precision_master = (param_dtype == torch.float16 and fp16_master_weights_and_grads) or (
        param_dtype == torch.bfloat16 and bf16_master_weights_and_grads
    )
    return PrecisionPolicy(
        param_dtype=param_dtype,
        grad_accum_dtype=grad_accum_dtype or param_dtype,
        comm_dtype=comm_dtype or param_dtype,
        buffer_dtype=buffer_dtype,
        loss_scale=loss_scale,
        auto_cast=auto_cast,
        master_dtype=param_dtype if low_precision_master else torch.float32,
        check_grad_overflow=bool(check_grad_overflow) if param_dtype == torch.bfloat16 else True,
    )


def grad_policy(*, clip_norm: float, prescale: bool, predivide_factor: float, reduce_op: ReduceOp | str) -> GradPolicy:
    """Gradient clipping, pre-division and reduction op."""
    return GradPolicy(
        clip_norm=float(clip_norm),
        prescale=bool(prescale),
        predivide_factor=float(predivide_factor),
        reduce_op=ReduceOp(reduce_op),
    )


def offload_policy(
    block: DeepSpeedZeroOffloadParamConfig | DeepSpeedZeroOffloadOptimizerConfig | None,
) -> OffloadPolicy:
    """One validated offload block (``offload_param`` / ``offload_optimizer``), or ``None`` for no offload."""
    if block is None:
        return OffloadPolicy()
    return OffloadPolicy(device=OffloadDevice(block.device), pin_memory=block.pin_memory)


def stage3_policy(zero: DeepSpeedZeroConfig) -> Stage3Policy:
    """The ZeRO-3 fetch/release knobs of a validated ``zero_optimization`` block."""
    leaf = zero.leaf_module
    return Stage3Policy(
        prefetch_bucket_size=zero.prefetch_bucket_size,
        max_live_parameters=zero.max_live_parameters,
        max_reuse_distance=zero.max_reuse_distance,
        param_persistence_threshold=zero.param_persistence_threshold,
        model_persistence_threshold=zero.model_persistence_threshold,
        gather_16bit_weights_on_model_save=zero.gather_16bit_weights_on_model_save,
        module_granularity_threshold=zero.module_granularity_threshold,
        leaf_module=LeafModulePolicy(
            classes=tuple(leaf.classes), names=tuple(leaf.names), name_suffixes=tuple(leaf.name_suffixes)
        ),
    )


def _lean_policy(zero: DeepSpeedZeroConfig) -> LeanPolicy:
    return LeanPolicy(
        inplace_flatten=zero.lean_inplace_flatten,
        eager_grad_release=zero.lean_eager_grad_release,
        stream_ordered_release=zero.lean_stream_ordered_release,
        grads_in_param_shards=zero.lean_grads_in_param_shards,
        pipeline_release=zero.lean_pipeline_release,
        gather_from_master=zero.lean_gather_from_master,
        block_fetch_units=zero.lean_block_fetch_units,
        unit_grad_reduce=zero.lean_unit_grad_reduce,
    )


def zero_plan(zero: DeepSpeedZeroConfig) -> ZeroPlan:
    """Everything the ZeRO optimizers read, from a validated ``zero_optimization`` block."""
    buckets = BucketPolicy(
        reduce_bucket_size=zero.reduce_bucket_size,
        allgather_bucket_size=zero.allgather_bucket_size,
        overlap_comm=bool(zero.overlap_comm),
        reduce_scatter=zero.reduce_scatter,
    )
    return ZeroPlan(
        stage=int(zero.stage),
        buckets=buckets,
        offload_optimizer=offload_policy(zero.offload_optimizer),
        offload_param=offload_policy(zero.offload_param),
        lean=_lean_policy(zero),
        stage3=stage3_policy(zero),
        load_from_fp32_weights=zero.load_from_fp32_weights,
    )


def _root_precision(root: RootConfig) -> PrecisionPolicy:
    return precision_policy(
        mode_dtype(root),
        grad_accum_dtype=to_torch_dtype(root.data_types.grad_accum_dtype),
        comm_dtype=to_torch_dtype(root.communication_data_type),
        buffer_dtype=to_torch_dtype(root.data_types.buffer_dtype),
        loss_scale=loss_scale_policy(root.fp16),
        auto_cast=root.fp16.enabled and root.fp16.auto_cast,
        fp16_master_weights_and_grads=root.fp16.fp16_master_weights_and_grads,
        bf16_master_weights_and_grads=root.bf16.bf16_master_weights_and_grads,
        check_grad_overflow=root.bf16.check_grad_overflow,
    )


def _memory_timeline_policy(block: MemoryTimelineConfig) -> MemoryTimelinePolicy:
    return MemoryTimelinePolicy(enabled=block.enabled, step=block.step, path=block.path, max_entries=block.max_entries)


def run_plan(root: RootConfig, batch: BatchPlan) -> RunPlan:
    """The frozen :class:`RunPlan` of a validated top-level config and its resolved batch triangle."""
    grads = grad_policy(
        clip_norm=root.gradient_clipping,
        prescale=root.prescale_gradients,
        predivide_factor=root.gradient_predivide_factor,
        reduce_op=root.gradient_allreduce_op,
    )
    return RunPlan(
        batch=batch,
        precision=_root_precision(root),
        grads=grads,
        zero=zero_plan(root.zero_optimization),
        steps_per_print=root.steps_per_print,
        wall_clock_breakdown=root.wall_clock_breakdown or root.flops_profiler.enabled,
        memory_breakdown=root.memory_breakdown,
        zero_allow_untested_optimizer=root.zero_allow_untested_optimizer,
        zero_force_ds_cpu_optimizer=root.zero_force_ds_cpu_optimizer,
        dataloader_drop_last=root.dataloader_drop_last,
        memory_timeline=_memory_timeline_policy(root.memory_timeline),
    )
