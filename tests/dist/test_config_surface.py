"""The config-surface table (``deepspeed._core.config.surface``) against the parser and the engine, both ways.

* Every key the parser accepts (the pydantic models walked, nested blocks included, plus the upstream blocks it
  accepts unmodelled) is in the table, and every table key is one the parser accepts.
* ``implemented``: setting the key changes what its consumer reads (the run plan or the config attribute the engine
  or the helper module reads); every implemented key needs an entry in ``EFFECTS`` unless a plan field names it
  (``tests/unit/config/test_plan_keys.py`` checks those).
* ``refused`` (and the refused values of implemented keys): ``deepspeed.initialize`` raises
  ``DeepSpeedConfigError`` naming the key, its block and what is supported; the five configs a user could set
  without a word before are checked at world size 2 (every rank raises).
* ``no effect``: initialize succeeds and logs one warning naming the key, once per process.
* ``pipeline engine`` / ``moe`` keys belong to the pipeline engine and the MoE layer, which check them; they are only
  checked for presence here.
"""

from __future__ import annotations

import logging
import operator
from pathlib import Path
from typing import Any

import pytest

from deepspeed._core.config.surface import SURFACE, Status
from deepspeed._core.config.schema import TOLERATED_TOP_LEVEL_KEYS, RootConfig
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed._core.config.convert import plan_keys
from deepspeed._core.config.docs import render_status_table
from deepspeed._core.config.base import model_keys
from tests._harness import run_distributed
from tests.reference.models import make_model

BASE = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
RAW_TOP_LEVEL = TOLERATED_TOP_LEVEL_KEYS - {"bfloat16"}  # bfloat16 is read as the bf16 block


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _config(flat: dict[str, Any]) -> dict:
    return _merge(BASE, _nest(flat))


# --------------------------------------------------------------------------------------------------------------
# Both directions: parser keys <-> table keys.


def test_every_parsed_key_is_in_the_table_and_back() -> None:
    parsed = {key for key, _ in model_keys(RootConfig)}
    missing = sorted((parsed | RAW_TOP_LEVEL) - set(SURFACE))
    assert not missing, f"keys the parser accepts but the surface table lacks: {missing}"
    unknown = sorted(k for k in SURFACE if k not in parsed and k.split(".")[0] not in RAW_TOP_LEVEL)
    assert not unknown, f"table keys the parser does not accept: {unknown}"


def test_docs_hold_the_generated_table() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    assert render_status_table() in doc, "docs/config.md is stale: python -m deepspeed._core.config.docs"


# --------------------------------------------------------------------------------------------------------------
# implemented: the key reaches its consumer. key -> (value, context keys, what the consumer reads).

_Z = "zero_optimization."
_S3 = {_Z + "stage": 3}
_FP16 = {"fp16.enabled": True}
_BF16 = {"bf16.enabled": True}
EFFECTS: dict[str, tuple[Any, dict[str, Any], str]] = {
    "train_batch_size": (2, {}, "plan.batch.train_batch_size"),
    "train_micro_batch_size_per_gpu": (2, {}, "plan.batch.micro_batch_per_gpu"),
    "gradient_accumulation_steps": (2, {}, "plan.batch.gradient_accumulation_steps"),
    "steps_per_print": (5, {}, "plan.steps_per_print"),
    "wall_clock_breakdown": (True, {}, "plan.wall_clock_breakdown"),
    "memory_breakdown": (True, {}, "plan.memory_breakdown"),
    "dataloader_drop_last": (True, {}, "plan.dataloader_drop_last"),
    "gradient_clipping": (0.5, {}, "plan.grads.clip_norm"),
    "prescale_gradients": (True, {}, "plan.grads.prescale"),
    "gradient_predivide_factor": (2.0, {}, "plan.grads.predivide_factor"),
    "gradient_allreduce_op": ("sum", {}, "plan.grads.reduce_op"),
    "communication_data_type": ("bf16", {}, "plan.precision.comm_dtype"),
    # read by the engine under SP (tests/dist/test_ulysses_sp_precision.py checks the reduction dtype)
    "seq_parallel_communication_data_type": ("bf16", {}, "seq_parallel_communication_data_type"),
    "zero_allow_untested_optimizer": (True, {}, "plan.zero_allow_untested_optimizer"),
    "zero_force_ds_cpu_optimizer": (False, {}, "plan.zero_force_ds_cpu_optimizer"),
    "optimizer.type": ("SGD", {}, "optimizer_name"),
    "optimizer.params": ({"lr": 0.5}, {}, "optimizer_params"),
    "scheduler.type": ("WarmupLR", {}, "scheduler_name"),
    "scheduler.params": ({"warmup_num_steps": 3}, {"scheduler.type": "WarmupLR"}, "scheduler_params"),
    _Z + "stage": (2, {}, "plan.zero.stage"),
    _Z + "reduce_scatter": (False, {}, "plan.zero.buckets.reduce_scatter"),
    _Z + "reduce_bucket_size": (1000, {}, "plan.zero.buckets.reduce_bucket_size"),
    _Z + "allgather_bucket_size": (1000, {}, "plan.zero.buckets.allgather_bucket_size"),
    _Z + "overlap_comm": (True, {}, "plan.zero.buckets.overlap_comm"),
    _Z + "load_from_fp32_weights": (False, {}, "plan.zero.load_from_fp32_weights"),
    _Z + "offload_param.device": ("cpu", _S3, "plan.zero.offload_param.device"),
    _Z + "offload_param.pin_memory": (
        False,
        {**_S3, _Z + "offload_param.device": "cpu"},
        "plan.zero.offload_param.pin_memory",
    ),
    _Z + "offload_optimizer.device": ("cpu", {_Z + "stage": 2}, "plan.zero.offload_optimizer.device"),
    _Z + "offload_optimizer.pin_memory": (
        False,
        {_Z + "offload_optimizer.device": "cpu"},
        "plan.zero.offload_optimizer.pin_memory",
    ),
    _Z + "cpu_offload_param": (True, _S3, "plan.zero.offload_param.device"),
    _Z + "cpu_offload": (True, {_Z + "stage": 2}, "plan.zero.offload_optimizer.device"),
    _Z + "prefetch_bucket_size": (1000, _S3, "plan.zero.stage3.prefetch_bucket_size"),
    _Z + "param_persistence_threshold": (10, _S3, "plan.zero.stage3.param_persistence_threshold"),
    _Z + "model_persistence_threshold": (10, _S3, "plan.zero.stage3.model_persistence_threshold"),
    _Z + "max_live_parameters": (10, _S3, "plan.zero.stage3.max_live_parameters"),
    _Z + "max_reuse_distance": (10, _S3, "plan.zero.stage3.max_reuse_distance"),
    _Z + "gather_16bit_weights_on_model_save": (True, _S3, "plan.zero.stage3.gather_16bit_weights_on_model_save"),
    _Z + "stage3_gather_fp16_weights_on_model_save": (True, _S3, "plan.zero.stage3.gather_16bit_weights_on_model_save"),
    _Z + "module_granularity_threshold": (10, _S3, "plan.zero.stage3.module_granularity_threshold"),
    _Z + "leaf_module.classes": (["Block"], _S3, "plan.zero.stage3.leaf_module.classes"),
    _Z + "leaf_module.names": (["fc1"], _S3, "plan.zero.stage3.leaf_module.names"),
    _Z + "leaf_module.name_suffixes": ([".fc1"], _S3, "plan.zero.stage3.leaf_module.name_suffixes"),
    _Z + "lean_inplace_flatten": (False, {}, "plan.zero.lean.inplace_flatten"),
    _Z + "lean_eager_grad_release": (False, {}, "plan.zero.lean.eager_grad_release"),
    _Z + "lean_stream_ordered_release": (False, {}, "plan.zero.lean.stream_ordered_release"),
    _Z + "lean_grads_in_param_shards": (False, {}, "plan.zero.lean.grads_in_param_shards"),
    _Z + "lean_pipeline_release": (False, {}, "plan.zero.lean.pipeline_release"),
    _Z + "lean_gather_from_master": (False, {}, "plan.zero.lean.gather_from_master"),
    _Z + "lean_block_fetch_units": (False, {}, "plan.zero.lean.block_fetch_units"),
    _Z + "lean_unit_grad_reduce": (False, {}, "plan.zero.lean.unit_grad_reduce"),
    "fp16.enabled": (True, {}, "plan.precision.param_dtype"),
    "fp16.auto_cast": (True, _FP16, "plan.precision.auto_cast"),
    "fp16.loss_scale": (128.0, _FP16, "plan.precision.loss_scale"),
    "fp16.initial_scale_power": (8, _FP16, "plan.precision.loss_scale.initial_scale_power"),
    "fp16.loss_scale_window": (10, _FP16, "plan.precision.loss_scale.scale_window"),
    "fp16.hysteresis": (4, _FP16, "plan.precision.loss_scale.hysteresis"),
    "fp16.consecutive_hysteresis": (True, _FP16, "plan.precision.loss_scale.consecutive_hysteresis"),
    "fp16.min_loss_scale": (4, _FP16, "plan.precision.loss_scale.min_scale"),
    "fp16.fp16_master_weights_and_grads": (True, _FP16, "plan.precision.master_dtype"),
    "bf16.enabled": (True, {}, "plan.precision.param_dtype"),
    "bf16.check_grad_overflow": (False, _BF16, "plan.precision.check_grad_overflow"),
    "data_types.grad_accum_dtype": ("fp32", {**_BF16, _Z + "stage": 1}, "plan.precision.grad_accum_dtype"),
    "data_types.buffer_dtype": ("bf16", {}, "plan.precision.buffer_dtype"),
    "checkpoint.tag_validation": ("fail", {}, "checkpoint_tag_validation_fail"),
    "checkpoint.use_node_local_storage": (True, {}, "use_node_local_storage"),
    **{
        f"activation_checkpointing.{k}": (True, {}, f"activation_checkpointing_config.{k}")
        for k in (
            "partition_activations",
            "contiguous_memory_optimization",
            "cpu_checkpointing",
            "synchronize_checkpoint_boundary",
            "profile",
        )
    },
    "activation_checkpointing.number_checkpoints": (2, {}, "activation_checkpointing_config.number_checkpoints"),
    "comms_logger.enabled": (True, {}, "comms_config.comms_logger.enabled"),
    "comms_logger.prof_all": (False, {}, "comms_config.comms_logger.prof_all"),
    "comms_logger.prof_ops": (["all_reduce"], {}, "comms_config.comms_logger.prof_ops"),
    "comms_logger.verbose": (True, {}, "comms_config.comms_logger.verbose"),
    "comms_logger.debug": (True, {}, "comms_config.comms_logger.debug"),
    "memory_timeline.enabled": (True, {}, "plan.memory_timeline.enabled"),
    "memory_timeline.step": (3, {}, "plan.memory_timeline.step"),
    "memory_timeline.path": ("elsewhere", {}, "plan.memory_timeline.path"),
    "memory_timeline.max_entries": (10, {}, "plan.memory_timeline.max_entries"),
}
# Keys that take effect only together (one without the other is refused): (their values, context, consumer).
JOINT = (
    {"bf16.bf16_master_weights_and_grads": True, "bf16.bf16_optimizer_states": True},
    _BF16,
    "plan.precision.master_dtype",
)
# Keys whose effect is a check rather than a value: key -> (value, context) that the check rejects.
CHECKS: dict[str, tuple[Any, dict[str, Any]]] = {
    "data_types.param_dtype": ("fp16", _BF16),  # must agree with the precision blocks
    "sequence_parallel_size": (2, {}),  # must divide the world size (1 here)
    # strictly between 0 and 1
    _Z + "zenflow.topk_ratio": (1.0, {_Z + "stage": 2, _Z + "offload_optimizer.device": "cpu"}),
}


def _implemented() -> list[str]:
    return sorted(k for k, rule in SURFACE.items() if rule.status is Status.IMPLEMENTED)


# Keys a plan field names with key(): tests/unit/config/test_plan_keys.py sets each one and reads its plan field.
PLAN_KEYED = {entry.config_keys[0] for entry in plan_keys() if not entry.derived}


def test_every_implemented_key_has_an_effect_check() -> None:
    checked = set(EFFECTS) | set(CHECKS) | set(JOINT[0]) | PLAN_KEYED
    unchecked = [k for k in _implemented() if k not in checked]
    assert not unchecked, f"implemented keys without an effect check: {unchecked}"


@pytest.mark.parametrize("key", sorted(EFFECTS))
def test_implemented_key_reaches_its_consumer(key: str) -> None:
    value, context, consumer = EFFECTS[key]
    read = operator.attrgetter(consumer)
    without = read(DeepSpeedConfig(_config(context)))
    with_key = read(DeepSpeedConfig(_config({**context, key: value})))
    assert with_key != without, f"{key}={value!r} does not change {consumer} ({without!r})"


def test_joint_keys_take_effect_together() -> None:
    keys, context, consumer = JOINT
    read = operator.attrgetter(consumer)
    assert read(DeepSpeedConfig(_config({**context, **keys}))) != read(DeepSpeedConfig(_config(context)))


@pytest.mark.parametrize("key", sorted(CHECKS))
def test_implemented_check_rejects(key: str) -> None:
    value, context = CHECKS[key]
    DeepSpeedConfig(_config(context))
    with pytest.raises(DeepSpeedConfigError, match=key):
        DeepSpeedConfig(_config({**context, key: value}))


# --------------------------------------------------------------------------------------------------------------
# refused: initialize raises naming key, block and what is supported. key -> (value, context keys).

REFUSALS: dict[str, tuple[Any, dict[str, Any]]] = {
    "managed_gradient_accumulation": (False, {}),
    "aio.use_gds": (True, {}),
    _Z + "offload_optimizer.super_offload": (True, {**_S3, _Z + "offload_optimizer.device": "cpu"}),
    _Z + "zero_hpz_partition_size": (2, _S3),
    _Z + "zero_quantized_weights": (True, _S3),
    _Z + "zero_quantized_nontrainable_weights": (True, _S3),
    _Z + "zero_quantized_gradients": (True, _S3),
    _Z + "zeropp_loco_param": ({"err_beta": 0.8, "reset_T": 1024}, _S3),
    _Z + "mics_shard_size": (2, _S3),
    _Z + "mics_hierarchical_params_gather": (True, _S3),
    "data_types.grad_accum_dtype": ("fp32", _BF16),
    "bf16.bf16_master_weights_and_grads": (True, _BF16),
    "checkpoint.load_universal": (True, {}),
    "amp": ({"enabled": True}, {}),
    "torch_autocast": ({"enabled": True, "dtype": "bfloat16"}, {}),
    "elasticity": ({"enabled": True}, {}),
    "compression_training": ({"weight_quantization": {"shared_parameters": {"enabled": True}}}, {}),
    "data_efficiency": ({"enabled": True}, {}),
    "curriculum_learning": ({"enabled": True}, {}),
    "eigenvalue": ({"enabled": True}, {}),
    "progressive_layer_drop": ({"enabled": True}, {}),
    "sparse_attention": ({"mode": "fixed"}, {}),
    "compile.deepcompile": (True, {}),
    "deepcompile": (True, {}),
    "nebula": ({"enabled": True}, {}),
    "weight_quantization": ({"post_training_quantization": {"enabled": True}}, {}),
    "hybrid_engine": ({"enabled": True}, {}),
    "tensor_parallel.autotp_size": (2, {}),
    "quantize_training": ({"enabled": True}, {}),
    "zenflow": ({"topk_ratio": 0.1}, {}),
}
# A value the user may set without a refusal (the feature off), per refused key tested here.
ACCEPTED = {
    _Z + "zero_hpz_partition_size": 1,
    _Z + "mics_shard_size": -1,
    "tensor_parallel.autotp_size": 1,
    "compile.deepcompile": False,
    "aio.use_gds": False,
    "managed_gradient_accumulation": True,
}

# The configs a new user could set without a word before (each checked on both ranks of a world of 2).
ISSUE_CONFIGS = {
    "zero_plus_plus": (
        {**_S3, _Z + "zero_quantized_weights": True, _Z + "zero_hpz_partition_size": 2},
        "zero_optimization.zero_hpz_partition_size",
    ),
    "zenflow": ({"zenflow.topk_ratio": 0.1}, "zenflow"),
    "deepcompile": ({"compile.deepcompile": True}, "compile.deepcompile"),
    "autotp": ({"tensor_parallel.autotp_size": 2}, "tensor_parallel.autotp_size"),
}


def test_every_refusing_key_has_a_refusal_check() -> None:
    unchecked = sorted(k for k, rule in SURFACE.items() if rule.refuse_when is not None and k not in REFUSALS)
    assert not unchecked, f"keys with refused values but no refusal check: {unchecked}"


def _try_initialize(configs: dict[str, dict]) -> dict[str, tuple[str | None, list[str]]]:
    """Initialize once per config; per name: (error message or None, warnings logged on the DeepSpeed logger)."""
    import deepspeed
    from deepspeed.utils.logging import logger

    records: list[str] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    out = {}
    try:
        for name, config in configs.items():
            records.clear()
            try:
                deepspeed.initialize(model=make_model(0), config=config)
                out[name] = (None, list(records))
            except DeepSpeedConfigError as err:
                out[name] = (str(err), list(records))
    finally:
        logger.removeHandler(handler)
    return out


def _block(key: str, value: Any) -> str:
    if isinstance(value, dict) and "enabled" in value:  # reported as <block>.enabled
        return key
    return key.rsplit(".", 1)[0] if "." in key else "top level"


def test_refused_keys_raise_in_initialize() -> None:
    configs = {key: _config({**ctx, key: value}) for key, (value, ctx) in REFUSALS.items()}
    configs.update({f"accepted:{key}": _config({**REFUSALS[key][1], key: value}) for key, value in ACCEPTED.items()})
    results = run_distributed(_try_initialize, 1, configs, timeout=120)[0]
    for key in REFUSALS:
        message, _ = results[key]
        assert message is not None, f"{key}={REFUSALS[key][0]!r} was accepted"
        assert key in message and f"block '{_block(key, REFUSALS[key][0])}'" in message and "supported:" in message, (
            message
        )
    for key in ACCEPTED:
        assert results[f"accepted:{key}"][0] is None, results[f"accepted:{key}"]


def test_formerly_silent_configs_raise_on_every_rank() -> None:
    # One world of 2 initializes all five in turn: each must fail on both ranks (before any collective, or the
    # next case would hang).
    configs = {case: _config(flat) for case, (flat, _) in ISSUE_CONFIGS.items()}
    for rank_results in run_distributed(_try_initialize, 2, configs, timeout=90):
        for case, (_, key) in ISSUE_CONFIGS.items():
            message = rank_results[case][0]
            assert message is not None and key in message and "not supported by deepspeed-lean" in message, message


# --------------------------------------------------------------------------------------------------------------
# no effect: initialize warns once per process, naming the key.

NO_EFFECT_VALUES: dict[str, tuple[Any, dict[str, Any]]] = {
    # A torch optimizer, so that the test needs no DeepSpeed CPU Adam build.
    _Z + "offload_optimizer.ratio": (
        0.5,
        {**_S3, _Z + "offload_optimizer.device": "cpu", "optimizer.type": "SGD", "zero_force_ds_cpu_optimizer": False},
    ),
    _Z + "cpu_offload_use_pin_memory": (True, {}),
    "vocabulary_size": (50257, {}),
    "log_level": ("info", {}),
    "bf16.immediate_grad_update": (True, _BF16),
    "autotuning": ({"enabled": True}, {}),
    "compile": ({"free_activation": True}, {}),
    "tensor_parallel": ({"tp_grain_size": 64}, {}),
    "data_parallel_size": (1, {}),
    **{
        _Z + f"zenflow.{k}": (
            v,
            {
                _Z + "stage": 2,
                _Z + "offload_optimizer.device": "cpu",
                "optimizer.type": "SGD",
                "zero_force_ds_cpu_optimizer": False,
            },
        )
        for k, v in (("offload", True), ("pt_reserved_cores_perc", 0.25))
    },
}


def _no_effect_value(key: str) -> tuple[Any, dict[str, Any]]:
    if key in NO_EFFECT_VALUES:
        return NO_EFFECT_VALUES[key]
    default = dict(model_keys(RootConfig)).get(key)
    if isinstance(default, bool):
        return not default, {}
    if isinstance(default, float):
        return (default / 2 if default else 0.5), {}
    if isinstance(default, int):
        return default + 1, {}
    if default is None or isinstance(default, str):
        return "x", {}
    raise AssertionError(f"no non-default value known for no-effect key {key}; add it to NO_EFFECT_VALUES")


def test_no_effect_keys_warn_once_per_process() -> None:
    keys = sorted(k for k, rule in SURFACE.items() if rule.status is Status.NO_EFFECT)
    configs = {}
    for key in keys:
        value, ctx = _no_effect_value(key)
        configs[key] = _config({**ctx, key: value})
    configs["again"] = configs[keys[0]]
    results = run_distributed(_try_initialize, 1, configs, timeout=120)[0]
    for key in keys:
        message, warnings = results[key]
        assert message is None, f"{key}: {message}"
        named = [w for w in warnings if w.startswith(f"{key} is accepted but has no effect")]
        assert len(named) == 1, f"{key}: {warnings}"
    assert not [w for w in results["again"][1] if "has no effect" in w], results["again"]


def test_owned_elsewhere_keys_are_listed() -> None:
    # pipeline.* and the MoE keys are checked by the pipeline engine and the MoE layer (their own tests).
    owned = {k for k, rule in SURFACE.items() if rule.status in (Status.PIPELINE, Status.MOE)}
    assert {"pipeline", "expert_parallel", "use_data_before_expert_parallelism"} <= owned
