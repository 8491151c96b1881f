"""The config surface: what deepspeed-lean does with every key its parser accepts, as data.

Each dotted key (``zero_optimization.offload_optimizer.device``) maps to a :class:`KeyRule` with one of four
statuses:

* ``implemented``: the key takes effect;
* ``no effect``: accepted, but it changes nothing in the results (performance or logging knobs of upstream that
  this package does not have); a value other than the default logs one warning naming the key, once per process;
* ``refused``: a value that asks for the feature raises ``DeepSpeedConfigError`` naming the key, its block and
  what is supported (an ``implemented`` key can also carry a refusal for the values it does not support);
* ``pipeline engine`` / ``moe``: owned by the pipeline engine and the MoE layer, which decide themselves.

The table is the one place these statuses live: ``enforce.py`` enforces it when a config is read (on every rank,
before any collective), ``docs.py`` renders the status table of docs/config.md from it (``python -m
deepspeed._core.config.docs`` regenerates that page's tables after a change here), and
``tests/dist/test_config_surface.py`` checks both directions (every parsed key is listed; every key behaves as
listed). Blocks this package accepts without modelling them (``compile``, ``tensor_parallel``, …) are listed by
block name; a ``block.key`` entry takes precedence over its block's entry for that key.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Predicate = Callable[[Any, Mapping[str, Any]], bool]
"""``(value, effective)``: ``effective`` maps every modelled dotted key to its validated value."""


class Status(str, enum.Enum):
    """What the package does with a key."""

    IMPLEMENTED = "implemented"
    NO_EFFECT = "no effect"
    REFUSED = "refused"
    PIPELINE = "pipeline engine"
    MOE = "moe"


@dataclass(frozen=True)
class KeyRule:
    """One key's status.

    Attributes:
        status: see :class:`Status`.
        note: one line for the docs table (for ``refused``: what is not implemented).
        refuse_when: values that are refused; ``None`` means never for ``implemented`` / ``no effect`` keys.
        supported: what is supported instead, quoted in the error message.
    """

    status: Status
    note: str = ""
    refuse_when: Predicate | None = None
    supported: str = ""


def _truthy(value: Any, _: Mapping[str, Any]) -> bool:
    return bool(value)


def _given(value: Any, _: Mapping[str, Any]) -> bool:
    return value is not None and value != {} and value is not False


def _enabled(value: Any, _: Mapping[str, Any]) -> bool:
    """A raw upstream block asks for its feature: ``true`` or a dict with a true ``enabled``."""
    return value is True or (isinstance(value, dict) and bool(value.get("enabled", False)))


def _above(limit: int) -> Predicate:
    return lambda value, _: value is not None and not isinstance(value, bool) and value > limit


def _equals(wanted: Any) -> Predicate:
    return lambda value, _: value == wanted


_DTYPE_CANON = {
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
}


def _bf16_master_alone(value: Any, effective: Mapping[str, Any]) -> bool:
    # Torch optimizers create their states in the dtype of the tensors they step, so bf16 masters mean bf16
    # states; upstream's bf16 masters with fp32 states are not implemented.
    return bool(value) and not (effective.get("bf16.enabled") and effective.get("bf16.bf16_optimizer_states"))


def _stage0_accum_differs(value: Any, effective: Mapping[str, Any]) -> bool:
    # Stage 0 accumulates in the parameters' own .grad, so only the working dtype is possible there.
    if value is None or int(effective.get("zero_optimization.stage", 0)) != 0:
        return False
    working = "bf16" if effective.get("bf16.enabled") else "fp16" if effective.get("fp16.enabled") else "fp32"
    return _DTYPE_CANON.get(str(value).lower()) != working


def _universal_without_zero(value: Any, effective: Mapping[str, Any]) -> bool:
    # A universal checkpoint is read into the ZeRO optimizer's flat masters; stage 0 has none.
    return bool(value) and int(effective.get("zero_optimization.stage", 0)) == 0


def _impl(note: str = "", refuse_when: Predicate | None = None, supported: str = "") -> KeyRule:
    return KeyRule(Status.IMPLEMENTED, note, refuse_when, supported)


def _noop(note: str) -> KeyRule:
    return KeyRule(Status.NO_EFFECT, note)


def _refused(note: str, supported: str, refuse_when: Predicate = _truthy) -> KeyRule:
    return KeyRule(Status.REFUSED, note, refuse_when, supported)


_NVME_PARAM = "NVMe parameter swapping at ZeRO-3; with another device, a non-default value warns that it does nothing"
_NVME_OPT = "NVMe optimizer swapping at ZeRO-3"
_NVME_OPT_KEY = "NVMe optimizer swapping at ZeRO-3; with another device, a non-default value warns that it does nothing"

_TOP_LEVEL: dict[str, KeyRule] = {
    "train_batch_size": _impl(),
    "train_micro_batch_size_per_gpu": _impl(),
    "gradient_accumulation_steps": _impl(),
    "managed_gradient_accumulation": _refused(
        "false (every step() a boundary) is not implemented; the engine always owns the boundary",
        "true",
        _equals(False),
    ),
    "steps_per_print": _impl(),
    "wall_clock_breakdown": _impl(),
    "memory_breakdown": _impl(),
    "dump_state": _noop("the engine state is not logged"),
    "sparse_gradients": _noop("embedding gradients are reduced dense (same values)"),
    "disable_allgather": _noop("upstream legacy switch"),
    "dataloader_drop_last": _impl(),
    "gradient_clipping": _impl(),
    "prescale_gradients": _impl(),
    "gradient_predivide_factor": _impl(),
    "gradient_allreduce_op": _impl(),
    "communication_data_type": _impl(),
    "seq_parallel_communication_data_type": _impl(
        "with sequence parallelism gradients are reduced in this dtype instead of communication_data_type; "
        "without it, given at all, it warns that it does nothing"
    ),
    "zero_allow_untested_optimizer": _impl(),
    "zero_force_ds_cpu_optimizer": _impl(),
    "vocabulary_size": _noop("not checked"),
    "log_level": _noop("set DS_LOG_LEVEL instead"),
    "graph_harvesting": _noop("CUDA-graph capture is not implemented"),
    "sequence_parallel_size": _impl(
        "sequence-parallel groups of this size; data parallelism over world / size; ZeRO shards over every rank"
    ),
    "optimizer.type": _impl(),
    "optimizer.params": _impl(),
    "optimizer.legacy_fusion": _noop("upstream legacy switch"),
    "scheduler.type": _impl(),
    "scheduler.params": _impl(),
}

_ZERO: dict[str, KeyRule] = {
    "stage": _impl(),
    "contiguous_gradients": _noop("gradients always go to the flat reduction buckets"),
    "reduce_scatter": _impl(),
    "reduce_bucket_size": _impl(),
    "use_multi_rank_bucket_allreduce": _noop("bucket reduction strategy is fixed (same values)"),
    "allgather_partitions": _noop("updated partitions are always all-gathered (same values)"),
    "allgather_bucket_size": _impl(),
    "overlap_comm": _impl(),
    "load_from_fp32_weights": _impl(),
    "elastic_checkpoint": _noop("ZeRO-1/2 checkpoints load at any data-parallel size regardless"),
    "offload_param.device": _impl(
        "ZeRO-3 only (stages 0-2 ignore offload_param as upstream does, with a warning): cpu keeps partitions in "
        "host memory, nvme in swap files read through a pool of pinned buffers ahead of each gather"
    ),
    "offload_param.nvme_path": _impl("required with device nvme at ZeRO-3, and a writable directory; " + _NVME_PARAM),
    "offload_param.buffer_count": _impl("pinned buffers partitions are read into before a gather; " + _NVME_PARAM),
    "offload_param.buffer_size": _impl(
        "elements per buffer; a larger partition is refused before partitioning; " + _NVME_PARAM
    ),
    "offload_param.max_in_cpu": _impl(
        "elements of the first partitions kept in host memory instead of swapped (partitions under "
        "max(1 MiB, aio.block_size) bytes always stay and do not count); " + _NVME_PARAM
    ),
    "offload_param.pin_memory": _impl(),
    "offload_optimizer.device": _impl("nvme: swap files at ZeRO-3; ZeRO-1/2 keep the state on the cpu (a warning)"),
    "offload_optimizer.nvme_path": _impl("required with device nvme, and a writable directory; " + _NVME_OPT_KEY),
    "offload_optimizer.buffer_count": _impl(_NVME_OPT_KEY),
    "offload_optimizer.pin_memory": _impl(),
    "offload_optimizer.pipeline_read": _impl(_NVME_OPT_KEY),
    "offload_optimizer.pipeline_write": _impl(_NVME_OPT_KEY),
    "offload_optimizer.fast_init": _noop("the initial NVMe state is written once, chunk by chunk"),
    "offload_optimizer.ratio": _noop("all optimizer state is offloaded (partial offload is not implemented)"),
    "offload_optimizer.super_offload": _refused(
        "SuperOffload is not implemented; the delayed-update mode available is zero_optimization.zenflow",
        "false, or a zero_optimization.zenflow block (stages 1 and 2)",
    ),
    "offload_optimizer.cpuadam_cores_perc": _noop("the CPU step uses torch's thread pool"),
    "sub_group_size": _impl(
        "NVMe optimizer offload: elements per swapped step chunk (at most the step chunk); the step chunk itself "
        "follows its own rule: a sixteenth of the master, within 64-256 MiB"
    ),
    "cpu_offload_param": _impl("deprecated: offload_param {device: cpu}"),
    "cpu_offload_use_pin_memory": _noop("deprecated; use pin_memory in the offload blocks"),
    "cpu_offload": _impl("deprecated: offload_optimizer {device: cpu}"),
    "prefetch_bucket_size": _impl(),
    "param_persistence_threshold": _impl(),
    "model_persistence_threshold": _impl(),
    "max_live_parameters": _impl(),
    "max_reuse_distance": _impl(),
    "gather_16bit_weights_on_model_save": _impl(),
    "module_granularity_threshold": _impl(),
    "use_all_reduce_for_fetch_params": _noop("parameters are always all-gathered (same values)"),
    "allgather_sequential": _noop("parameter gathers are always coalesced (same values)"),
    "stage3_gather_fp16_weights_on_model_save": _impl("deprecated: gather_16bit_weights_on_model_save"),
    "ignore_unused_parameters": _noop("parameters without a gradient never raise"),
    "legacy_stage1": _noop("upstream legacy switch"),
    "round_robin_gradients": _noop("gradient copy order is fixed (same values)"),
    "zero_hpz_partition_size": _refused("ZeRO++ hierarchical partitioning is not implemented", "1", _above(1)),
    "zero_quantized_weights": _refused("ZeRO++ quantized weight all-gather is not implemented", "false"),
    "zero_quantized_nontrainable_weights": _refused("ZeRO++ quantized frozen weights are not implemented", "false"),
    "zero_quantized_gradients": _refused("ZeRO++ quantized gradient reduction is not implemented", "false"),
    "zeropp_loco_param": _refused("ZeRO++ LoCo is not implemented", "null", _given),
    "mics_shard_size": _refused("MiCS sharding is not implemented", "-1 (off)", _above(0)),
    "mics_hierarchical_params_gather": _refused("MiCS hierarchical gather is not implemented", "false"),
    "memory_efficient_linear": _noop("linear layers are not replaced"),
    "pipeline_loading_checkpoint": KeyRule(Status.PIPELINE, "read by the pipeline engine"),
    "override_module_apply": _noop("Module.apply is not wrapped by zero.Init"),
    "log_trace_cache_warnings": _noop("not logged"),
    "enable_sanity_checks": _noop("no extra checks run"),
    "save_muon_momentum_buffer_in_memory": _noop("Muon is not implemented"),
    "leaf_module.classes": _impl(),
    "leaf_module.names": _impl(),
    "leaf_module.name_suffixes": _impl(),
    **{
        f"zenflow.{k}": _impl("stages 1 and 2 with offload_optimizer cpu; stage 3 is refused")
        for k in (
            "topk_ratio",
            "select_strategy",
            "select_interval",
            "update_interval",
            "overlap_step",
            "auto_ratio",
            "full_warm_up_rounds",
            "steps_per_epoch",
        )
    },
    "zenflow.offload": _noop("all optimizer state already lives with the host master"),
    "zenflow.pt_reserved_cores_perc": _noop("the host update uses torch's thread pool"),
    "lean_inplace_flatten": _impl(),
    "lean_eager_grad_release": _impl(),
    "lean_stream_ordered_release": _impl(),
    "lean_grads_in_param_shards": _impl(),
    "lean_pipeline_release": _impl(),
    "lean_gather_from_master": _impl(),
    "lean_block_fetch_units": _impl(),
    "lean_unit_grad_reduce": _impl(),
    "lean_overlap_offload_step": _impl(),
    "lean_short_switch_interval": _impl(),
}

_PRECISION: dict[str, KeyRule] = {
    **{
        f"fp16.{k}": _impl()
        for k in (
            "enabled",
            "auto_cast",
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "consecutive_hysteresis",
            "min_loss_scale",
            "fp16_master_weights_and_grads",
        )
    },
    "bf16.enabled": _impl(),
    "bf16.immediate_grad_update": _noop("gradients are folded at the bucket flush (same values)"),
    "bf16.check_grad_overflow": _impl(),
    "bf16.bf16_master_weights_and_grads": _impl(
        "bf16 masters with fp32 optimizer states are not implemented (states follow the master dtype)",
        _bf16_master_alone,
        "true together with bf16.enabled and bf16.bf16_optimizer_states",
    ),
    "bf16.bf16_optimizer_states": _impl("optimizer states in the master dtype (bf16)"),
    "data_types.grad_accum_dtype": _impl(
        "stages 1-3; stage 0 accumulates in the working dtype only",
        _stage0_accum_differs,
        "at stage 0, the working dtype (or unset)",
    ),
    "data_types.param_dtype": _impl(),
    "data_types.buffer_dtype": _impl(),
}

_OTHER_BLOCKS: dict[str, KeyRule] = {
    "checkpoint.tag_validation": _impl(),
    "checkpoint.load_universal": _impl(
        "load_checkpoint reads a universal checkpoint (ds_to_universal) at any data-parallel size, ZeRO stage 1-3",
        _universal_without_zero,
        "true with zero_optimization.stage 1, 2 or 3",
    ),
    "checkpoint.use_node_local_storage": _impl(),
    "checkpoint.parallel_write.pipeline_stage": KeyRule(Status.PIPELINE, "read by the pipeline engine"),
    "checkpoint.checkpoint_serialization": _noop("checkpoints are always written with torch.save"),
    **{
        f"activation_checkpointing.{k}": _impl()
        for k in (
            "partition_activations",
            "contiguous_memory_optimization",
            "cpu_checkpointing",
            "number_checkpoints",
            "synchronize_checkpoint_boundary",
            "profile",
        )
    },
    "flops_profiler.enabled": _impl("also turns on wall_clock_breakdown"),
    **{
        f"flops_profiler.{k}": _impl()
        for k in ("recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed", "output_file")
    },
    **{
        f"aio.{k}": _impl(_NVME_OPT)
        for k in ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events")
    },
    "aio.use_gds": _refused("GPUDirect Storage is not implemented", "false"),
    **{f"comms_logger.{k}": _impl() for k in ("enabled", "prof_all", "prof_ops", "verbose", "debug")},
    **{f"tensorboard.{k}": _impl() for k in ("enabled", "output_path", "job_name")},
    **{f"wandb.{k}": _impl() for k in ("enabled", "group", "team", "project")},
    **{f"csv_monitor.{k}": _impl() for k in ("enabled", "output_path", "job_name")},
    **{f"timers.throughput.{k}": _impl() for k in ("enabled", "synchronized")},
    **{
        f"comet.{k}": _impl()
        for k in (
            "enabled",
            "samples_log_interval",
            "project",
            "workspace",
            "api_key",
            "experiment_name",
            "experiment_key",
            "online",
            "mode",
        )
    },
    **{f"memory_timeline.{k}": _impl() for k in ("enabled", "step", "path", "max_entries")},
}

# Upstream blocks accepted without a model: judged on the raw value the user gave.
_RAW_BLOCKS: dict[str, KeyRule] = {
    "amp": _refused("apex AMP is not implemented", "the fp16 or bf16 block", _enabled),
    "torch_autocast": _refused("torch.autocast training is not implemented", "the fp16 or bf16 block", _enabled),
    "elasticity": _refused("elastic training is not implemented", "a fixed batch configuration", _enabled),
    "autotuning": _noop("the autotuner is not implemented"),
    "compression_training": _refused(
        "compression training is not implemented", "no compression_training block", _given
    ),
    "data_efficiency": _refused("data-efficiency sampling/routing is not implemented", "enabled: false", _enabled),
    "curriculum_learning": _refused("curriculum learning is not implemented", "enabled: false", _enabled),
    "eigenvalue": _refused("eigenvalue computation is not implemented", "enabled: false", _enabled),
    "progressive_layer_drop": _refused("progressive layer drop is not implemented", "enabled: false", _enabled),
    "sparse_attention": _refused("sparse attention is not implemented", "no sparse_attention block", _given),
    "compile": _noop("DeepCompile options; only compile.deepcompile is checked"),
    "compile.deepcompile": _refused("DeepCompile is not implemented; use engine.compile()", "false"),
    "deepcompile": _refused("DeepCompile is not implemented; use engine.compile()", "false", _given),
    "nebula": _refused("Nebula checkpointing is not implemented", "enabled: false", _enabled),
    "weight_quantization": _refused("weight quantization is not implemented", "no weight_quantization block", _given),
    "hybrid_engine": _refused("the hybrid (RLHF) engine is not implemented", "enabled: false", _enabled),
    "tensor_parallel": _noop("AutoTP options; only tensor_parallel.autotp_size is checked"),
    "tensor_parallel.autotp_size": _refused("AutoTP tensor parallelism is not implemented", "1 (off)", _above(1)),
    "data_parallel_size": _noop("the data-parallel size comes from the process group (or the mpu)"),
    "quantize_training": _refused("quantization-aware training is not implemented", "enabled: false", _enabled),
    "zenflow": _refused(
        "ZenFlow is configured inside zero_optimization", "zero_optimization.zenflow (stages 1 and 2)", _given
    ),
    "pipeline": KeyRule(Status.PIPELINE, "read by the pipeline engine"),
    "use_data_before_expert_parallelism": KeyRule(Status.MOE, "read by the MoE layer"),
    "expert_parallel": KeyRule(Status.MOE, "read by the MoE layer"),
}

SURFACE: dict[str, KeyRule] = {
    **_TOP_LEVEL,
    **{f"zero_optimization.{k}": rule for k, rule in _ZERO.items()},
    **_PRECISION,
    **_OTHER_BLOCKS,
    **_RAW_BLOCKS,
}
"""Every accepted key (dotted) -> its rule."""

RAW_BLOCKS: frozenset[str] = frozenset(k.split(".")[0] for k in _RAW_BLOCKS)
"""Top-level blocks judged on the user's raw value (no pydantic model)."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of judging one config."""

    refusals: tuple[str, ...]
    no_effect: tuple[str, ...]


def refusal_message(key: str, value: Any, rule: KeyRule) -> str:
    """One line naming the key, its block, what is not implemented and what is supported."""
    if rule.refuse_when is _enabled and isinstance(value, dict):
        key, value = f"{key}.enabled", value.get("enabled")
    block = key.rsplit(".", 1)[0] if "." in key else "top level"
    return (
        f"{key}={value!r} (block '{block}') is not supported by deepspeed-lean: {rule.note}; supported: "
        f"{rule.supported}"
    )


def judge(given: Mapping[str, Any], defaults: Mapping[str, Any], effective: Mapping[str, Any]) -> Verdict:
    """Sort the keys a user set into refusals (messages) and keys set to a value without effect.

    Args:
        given: dotted key -> value, for the keys present in the user's config (raw blocks by block name, or by
            ``block.key`` where the table has such an entry).
        defaults: dotted key -> default value of the modelled keys (raw blocks have none).
        effective: dotted key -> validated value of every modelled key (for rules that depend on other keys).
    """
    refusals, no_effect = [], []
    for key, value in given.items():
        rule = SURFACE.get(key)
        if rule is None:
            continue
        if rule.refuse_when is not None and rule.refuse_when(value, effective):
            refusals.append(refusal_message(key, value, rule))
        elif rule.status is Status.NO_EFFECT and (key not in defaults or value != defaults[key]):
            no_effect.append(key)
    return Verdict(tuple(refusals), tuple(no_effect))
