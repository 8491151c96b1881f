"""Every bad input raises DeepSpeedConfigError naming the offending key and what would be valid."""

from __future__ import annotations

import pytest

from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig


def _cfg(**extra: object) -> dict:
    return {"train_batch_size": 4, **extra}


@pytest.mark.parametrize(
    "config,patterns",
    [
        (_cfg(zero_optimization={"reduce_bucket_size": -1}), ["zero_optimization.reduce_bucket_size", ">= 0|greater"]),
        (
            _cfg(zero_optimization={"stage3_prefetch_bucket_size": -5}),
            ["zero_optimization.stage3_prefetch_bucket_size"],
        ),
        (_cfg(zero_optimization={"stage": 7}), ["zero_optimization.stage", "0, 1, 2, 3", "got 7"]),
        (_cfg(fp16={"enabled": True}, bf16={"enabled": True}), ["fp16.enabled", "bf16.enabled"]),
        (
            _cfg(zero_optimization={"overlap_com": True}),
            ["zero_optimization", "'overlap_com'", "did you mean 'overlap_comm'"],
        ),
        (
            _cfg(zero_optimization={"offload_param": {"devise": "cpu"}}),
            ["zero_optimization.offload_param", "'devise'", "did you mean 'device'"],
        ),
        (
            _cfg(zero_optimization={"offload_optimizer": {"device": "gpu"}}),
            ["zero_optimization.offload_optimizer.device", "'none', 'cpu' or 'nvme'"],
        ),
        (
            _cfg(zero_optimization={"offload_optimizer": {"device": "cpu", "ratio": 0.5}, "stage": 2}),
            ["offload_optimizer.ratio", "stage 3"],
        ),
        (_cfg(zero_optimization={"stage": 2, "allgather_bucket_size": 3}), ["allgather_bucket_size", "even"]),
        (_cfg(fp16={"enabled": True, "loss_scale": -1}), ["fp16.loss_scale", ">= 0"]),
        (_cfg(fp16={"enabled": True, "loss_scale": float("inf")}), ["fp16.loss_scale", "finite"]),
        (_cfg(fp16={"enabled": True, "loss_scale_window": 0}), ["loss_scale_window", "> 0"]),
        (_cfg(fp16={"enabeld": True}), ["fp16", "did you mean 'enabled'"]),
        (_cfg(bf16={"bf16_optimizer_states": True}), ["bf16_optimizer_states", "bf16_master_weights_and_grads"]),
        (_cfg(steps_per_print=0), ["steps_per_print", "> 0"]),
        (_cfg(steps_per_print=float("nan")), ["steps_per_print"]),
        (_cfg(gradient_clipping=-0.5), ["gradient_clipping"]),
        (_cfg(gradient_predivide_factor=0), ["gradient_predivide_factor"]),
        (_cfg(communication_data_type="fp8"), ["communication_data_type", "fp16"]),
        (_cfg(data_types={"grad_accum_dtype": "int4"}), ["data_types.grad_accum_dtype"]),
        (_cfg(data_types={"param_dtype": "bf16"}), ["data_types.param_dtype", "fp16/bf16"]),
        (_cfg(gradient_allreduce_op="max"), ["gradient_allreduce_op", "mean"]),
        (_cfg(gradient_allreduce_op="sum", zero_optimization={"stage": 3}), ["gradient_allreduce_op", "stage 3"]),
        (
            _cfg(optimizer={"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}),
            ["max_grad_norm", "gradient_clipping"],
        ),
        (_cfg(checkpoint={"tag_validation": "sometimes"}), ["checkpoint.tag_validation", "WARN, IGNORE, FAIL"]),
        (_cfg(tensorboard={"enabled": True, "output": "/tmp"}), ["tensorboard", "did you mean 'output_path'"]),
        (_cfg(comms_logger={"enabled": "maybe"}), ["comms_logger.enabled"]),
        (_cfg(elasticity={"enabled": True}), ["elasticity.enabled", "not supported"]),
        (_cfg(amp={"enabled": True}), ["amp.enabled", "not supported"]),
    ],
)
def test_bad_value_names_key(config: dict, patterns: list[str]) -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedConfig(config)
    for pattern in patterns:
        assert pytest.importorskip("re").search(pattern, str(info.value)), (pattern, str(info.value))


def test_several_problems_reported_together() -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedConfig(_cfg(zero_optimization={"reduce_bucket_size": -1}, gradient_clipping=-1))
    assert "zero_optimization.reduce_bucket_size" in str(info.value) and "gradient_clipping" in str(info.value)


def test_assignment_is_validated() -> None:
    zero = DeepSpeedZeroConfig()
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        zero.reduce_bucket_size = -3


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    with pytest.raises(DeepSpeedConfigError, match="valid keys are .*'enabled'"):
        DeepSpeedConfig(_cfg(bf16={"zzzzzz": 1}))
