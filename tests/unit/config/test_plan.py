"""DeepSpeedConfig.plan: dtypes, loss scaling, lean switches, overlap_comm defaults, offload and bucket policies."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepspeed._core.config.plan import OffloadDevice, ReduceOp, RunPlan
from deepspeed.runtime.config import DeepSpeedConfig


def _plan(**extra: object) -> RunPlan:
    return DeepSpeedConfig({"train_batch_size": 8, **extra}).plan


def test_plan_is_cached_and_frozen() -> None:
    cfg = DeepSpeedConfig({"train_batch_size": 8})
    assert cfg.plan is cfg.plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.plan.zero.stage = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "extra,param,accum,comm",
    [
        ({}, torch.float32, torch.float32, torch.float32),
        ({"fp16": {"enabled": True}}, torch.float16, torch.float16, torch.float16),
        ({"bf16": {"enabled": True}}, torch.bfloat16, torch.bfloat16, torch.bfloat16),
        # Stage 0 accumulates in the working dtype only (other grad_accum_dtype values are refused there).
        (
            {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}},
            torch.bfloat16,
            torch.float32,
            torch.bfloat16,
        ),
        ({"fp16": {"enabled": True}, "communication_data_type": "fp32"}, torch.float16, torch.float16, torch.float32),
        (
            {
                "bfloat16": {"enabled": True},
                "data_types": {"grad_accum_dtype": "float"},
                "communication_data_type": "bf16",
                "zero_optimization": {"stage": 2},
            },
            torch.bfloat16,
            torch.float32,
            torch.bfloat16,
        ),
    ],
)
def test_dtype_resolution(extra: dict, param: torch.dtype, accum: torch.dtype, comm: torch.dtype) -> None:
    precision = _plan(**extra).precision
    assert (precision.param_dtype, precision.grad_accum_dtype, precision.comm_dtype) == (param, accum, comm)
    assert precision.master_dtype == torch.float32


def test_buffer_and_master_dtypes() -> None:
    precision = _plan(
        bf16={"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        data_types={"buffer_dtype": "bf16", "param_dtype": "bf16"},
    ).precision
    assert precision.buffer_dtype == torch.bfloat16 and precision.master_dtype == torch.bfloat16
    assert _plan().precision.buffer_dtype is None


def test_loss_scale_only_for_fp16() -> None:
    assert _plan().precision.loss_scale is None
    assert _plan(bf16={"enabled": True}).precision.loss_scale is None
    dynamic = _plan(
        fp16={
            "enabled": True,
            "initial_scale_power": 12,
            "loss_scale_window": 500,
            "min_loss_scale": 2,
            "hysteresis": 4,
            "auto_cast": True,
        }
    ).precision
    assert dynamic.loss_scale.dynamic is True and dynamic.loss_scale.initial_scale_power == 12
    assert dynamic.loss_scale.scale_window == 500 and dynamic.loss_scale.min_scale == 2.0
    assert dynamic.loss_scale.hysteresis == 4 and dynamic.auto_cast is True
    static = _plan(fp16={"enabled": True, "loss_scale": 1024}).precision.loss_scale
    assert static.dynamic is False and static.static_scale == 1024.0


def test_bf16_overflow_check_flag() -> None:
    assert _plan(bf16={"enabled": True, "check_grad_overflow": False}).precision.check_grad_overflow is False
    assert _plan(bf16={"enabled": True}).precision.check_grad_overflow is True


def test_lean_switches_default_on_and_can_be_turned_off() -> None:
    lean = _plan(zero_optimization={"stage": 2}).zero.lean
    assert (lean.inplace_flatten, lean.eager_grad_release, lean.stream_ordered_release) == (True, True, True)
    off = _plan(
        zero_optimization={
            "stage": 3,
            "lean_inplace_flatten": False,
            "lean_eager_grad_release": False,
            "lean_stream_ordered_release": False,
        }
    ).zero.lean
    assert (off.inplace_flatten, off.eager_grad_release, off.stream_ordered_release) == (False, False, False)
    one = _plan(zero_optimization={"lean_eager_grad_release": False}).zero.lean
    assert (one.inplace_flatten, one.eager_grad_release, one.stream_ordered_release) == (True, False, True)
    assert lean.gather_from_master and one.gather_from_master
    assert not _plan(zero_optimization={"stage": 3, "lean_gather_from_master": False}).zero.lean.gather_from_master


@pytest.mark.parametrize("stage,expected", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_default_by_stage(stage: int, expected: bool) -> None:
    assert _plan(zero_optimization={"stage": stage}).zero.buckets.overlap_comm is expected


@pytest.mark.parametrize("stage", [2, 3])
def test_overlap_comm_explicit_wins(stage: int) -> None:
    assert _plan(zero_optimization={"stage": stage, "overlap_comm": stage != 3}).zero.buckets.overlap_comm is (
        stage != 3
    )


def test_zero_plan_fields() -> None:
    zero = _plan(
        zero_optimization={
            "stage": 3,
            "reduce_bucket_size": 1e7,
            "allgather_bucket_size": 2e7,
            "reduce_scatter": False,
            "stage3_prefetch_bucket_size": 3e6,
            "stage3_max_live_parameters": 4e8,
            "stage3_max_reuse_distance": 5e8,
            "stage3_param_persistence_threshold": 1e4,
            "stage3_gather_16bit_weights_on_model_save": True,
            "load_from_fp32_weights": False,
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "offload_param": {"device": "cpu"},
        }
    ).zero
    assert zero.stage == 3 and not zero.load_from_fp32_weights
    assert (zero.buckets.reduce_bucket_size, zero.buckets.allgather_bucket_size) == (10_000_000, 20_000_000)
    assert not zero.buckets.reduce_scatter
    s3 = zero.stage3
    assert (s3.prefetch_bucket_size, s3.max_live_parameters, s3.max_reuse_distance) == (
        3_000_000,
        400_000_000,
        500_000_000,
    )
    assert s3.param_persistence_threshold == 10_000 and s3.gather_16bit_weights_on_model_save
    assert zero.offload_optimizer.device == OffloadDevice.CPU and zero.offload_optimizer.enabled
    assert zero.offload_optimizer.pin_memory is False and zero.offload_param.pin_memory is True
    assert zero.offload_param.device == OffloadDevice.CPU


# Keys accepted for upstream configs that change nothing here: parsed and validated, but absent from the plan (the
# config surface warns about them), so no core code can start reading a value that does nothing.
NO_PLAN_FIELD = {
    "contiguous_gradients": False,
    "use_multi_rank_bucket_allreduce": False,
    "round_robin_gradients": True,
    "ignore_unused_parameters": False,
    "elastic_checkpoint": True,
    "offload_optimizer": {"device": "cpu", "ratio": 0.5, "fast_init": True},
}


def _plan_field_names(obj: object) -> set[str]:
    names = set()
    for f in dataclasses.fields(obj):
        names.add(f.name)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            names |= _plan_field_names(value)
    return names


def test_no_effect_keys_are_parsed_but_not_planned() -> None:
    cfg = DeepSpeedConfig(
        {
            "train_batch_size": 8,
            "managed_gradient_accumulation": True,
            "zero_optimization": {"stage": 3, **NO_PLAN_FIELD},
        }
    )
    zero = cfg.zero_config
    assert (zero.contiguous_gradients, zero.round_robin_gradients) == (False, True)
    assert zero.offload_optimizer.ratio == 0.5
    names = _plan_field_names(cfg.plan) - {"nvme_path", "buffer_count"}
    dead = {"managed_gradient_accumulation", "ratio", "fast_init"} | set(NO_PLAN_FIELD) - {"offload_optimizer"}
    assert not names & dead, names & dead
    # Same plan as without those keys: they change nothing.
    assert cfg.plan.zero == _plan(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}}).zero


def test_dataloader_drop_last_is_planned() -> None:
    assert _plan(dataloader_drop_last=True).dataloader_drop_last and not _plan().dataloader_drop_last


def test_no_offload_by_default() -> None:
    zero = _plan(zero_optimization={"stage": 3}).zero
    assert not zero.offload_optimizer.enabled and not zero.offload_param.enabled


def test_grad_policy_and_run_flags() -> None:
    plan = _plan(
        gradient_clipping=0.0,
        prescale_gradients=True,
        gradient_predivide_factor=2.0,
        gradient_allreduce_op="sum",
        steps_per_print=float("inf"),
        wall_clock_breakdown=True,
        zero_allow_untested_optimizer=True,
        zero_force_ds_cpu_optimizer=False,
    )
    assert plan.grads.clip_norm == 0.0 and plan.grads.prescale and plan.grads.predivide_factor == 2.0
    assert plan.grads.reduce_op == ReduceOp.SUM
    assert plan.steps_per_print == float("inf") and plan.wall_clock_breakdown
    assert plan.zero_allow_untested_optimizer and not plan.zero_force_ds_cpu_optimizer
    default = _plan()
    assert default.grads.clip_norm == 1.0 and default.steps_per_print is None and default.zero.stage == 0
