"""Block parsing: upstream example configs, "auto" handling, aliases, deprecations, unknown keys."""

from __future__ import annotations

import copy
import logging
import pickle
import sys
from pathlib import Path

import pytest

from deepspeed.comm.config import CommsLoggerConfig
from deepspeed.monitor.config import get_monitor_config
from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum, get_zero_config
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

# HF Transformers' documented ZeRO-2 / ZeRO-3 templates after TrainingArguments filled the batch keys, i.e. with
# every model-dependent "auto" still in place.
HF_ZERO2 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 10}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": 2,
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": 4,
    "wall_clock_breakdown": False,
}

HF_ZERO3 = {
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": "auto",
}

# What Accelerate hands over: mixed-precision blocks it injected, steps_per_print=inf, an unknown "msamp" key.
ACCELERATE = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none", "nvme_path": None},
        "offload_param": {"device": "none", "nvme_path": None},
        "stage3_gather_16bit_weights_on_model_save": False,
    },
    "gradient_clipping": 1.0,
    "steps_per_print": float("inf"),
    "fp16": {"enabled": True, "auto_cast": True},
    "bf16": {"enabled": False},
    "msamp": {"enabled": False, "opt_level": "O1"},
}


def test_hf_zero2_template(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = DeepSpeedConfig(copy.deepcopy(HF_ZERO2))
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 2)
    assert cfg.fp16_enabled is False and cfg.bfloat16_enabled is False  # "auto" dropped -> default
    assert cfg.zero_config.reduce_bucket_size == 500_000_000
    assert cfg.zero_config.allgather_bucket_size == 200_000_000
    assert cfg.zero_config.offload_optimizer.device == OffloadDeviceEnum.cpu
    assert cfg.gradient_clipping == 1.0
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params["lr"] == 3e-5
    assert cfg.scheduler_name == "WarmupLR" and cfg.scheduler_params["warmup_num_steps"] == 10
    assert cfg.steps_per_print == 2000


def test_hf_zero3_template() -> None:
    cfg = DeepSpeedConfig(copy.deepcopy(HF_ZERO3))
    zero = cfg.zero_config
    assert cfg.train_micro_batch_size_per_gpu == 8
    assert zero.stage == ZeroStageEnum.weights
    assert zero.prefetch_bucket_size == 50_000_000 and zero.param_persistence_threshold == 100_000
    assert zero.max_live_parameters == 1_000_000_000 and zero.sub_group_size == 1_000_000_000
    assert zero.gather_16bit_weights_on_model_save is True
    assert zero.offload_param.device == "cpu" and zero.offload_param.pin_memory is True
    assert cfg.optimizer_params == {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}


def test_accelerate_config_with_inf_and_unknown_key(
    ds_logs: list[logging.LogRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = DeepSpeedConfig(copy.deepcopy(ACCELERATE))
    assert cfg.steps_per_print == float("inf")
    assert cfg.fp16_enabled and cfg.fp16_auto_cast
    assert cfg.zero_config.offload_param.device == "none"
    warnings = [r.getMessage() for r in ds_logs if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "msamp" in warnings[0]


def test_unknown_top_level_keys_share_one_warning(ds_logs: list[logging.LogRecord]) -> None:
    DeepSpeedConfig({"train_batch_size": 4, "zero_optimization.reduce_bucket_size": 5, "foo": 1, "pipeline": {}})
    warnings = [r.getMessage() for r in ds_logs if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "zero_optimization.reduce_bucket_size" in warnings[0] and "'foo'" in warnings[0]
    assert "pipeline" not in warnings[0]  # known upstream block, just not modelled


def test_auto_dropping_is_logged(ds_logs: list[logging.LogRecord]) -> None:
    DeepSpeedConfig({"train_batch_size": 4, "zero_optimization": {"reduce_bucket_size": "auto"}})
    assert any("reduce_bucket_size" in r.getMessage() and "auto" in r.getMessage() for r in ds_logs)


def test_strict_mode_keeps_auto() -> None:
    with pytest.raises(DeepSpeedConfigError, match="reduce_bucket_size"):
        DeepSpeedZeroConfig(strict=True, reduce_bucket_size="auto")


@pytest.mark.parametrize(
    "alias,field,value",
    [
        ("stage3_prefetch_bucket_size", "prefetch_bucket_size", 123),
        ("stage3_param_persistence_threshold", "param_persistence_threshold", 7),
        ("stage3_model_persistence_threshold", "model_persistence_threshold", 99),
        ("stage3_max_live_parameters", "max_live_parameters", 11),
        ("stage3_max_reuse_distance", "max_reuse_distance", 12),
        ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", True),
        ("stage3_module_granularity_threshold", "module_granularity_threshold", 5),
        ("stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params", True),
        ("stage3_allgather_sequential", "allgather_sequential", True),
    ],
)
def test_zero_aliases_and_field_names(alias: str, field: str, value: object) -> None:
    assert getattr(DeepSpeedZeroConfig(**{alias: value}), field) == value
    assert getattr(DeepSpeedZeroConfig(**{field: value}), field) == value


def test_zero_defaults() -> None:
    zero = DeepSpeedZeroConfig()
    assert zero.stage == 0 and zero.overlap_comm is False
    assert zero.model_persistence_threshold == sys.maxsize
    assert zero.lean_inplace_flatten and zero.lean_eager_grad_release and zero.lean_stream_ordered_release
    assert zero.offload_param is None and zero.offload_optimizer is None


def test_deprecated_cpu_offload_maps_with_warning(ds_logs: list[logging.LogRecord]) -> None:
    zero = DeepSpeedZeroConfig(stage=2, cpu_offload=True)
    assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
    assert any("cpu_offload is deprecated" in r.getMessage() for r in ds_logs if r.levelno == logging.WARNING)


def test_deprecated_keys_map() -> None:
    assert DeepSpeedZeroConfig(stage=3, cpu_offload_param=True).offload_param.device == "cpu"
    assert DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True).gather_16bit_weights_on_model_save
    assert DeepSpeedZeroConfig(cpu_offload_use_pin_memory=True).offload_optimizer is None


def test_deprecated_and_replacement_together_rejected() -> None:
    with pytest.raises(DeepSpeedConfigError, match="cpu_offload.*offload_optimizer"):
        DeepSpeedZeroConfig(cpu_offload=True, offload_optimizer={"device": "cpu"})


def test_legacy_boolean_zero_block() -> None:
    assert DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": True}).zero_optimization_stage == 1
    assert DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": False}).zero_enabled is False
    assert get_zero_config({"zero_optimization": True}).stage == 1


def test_bfloat16_alias_block() -> None:
    assert DeepSpeedConfig({"train_batch_size": 2, "bfloat16": {"enabled": True}}).bfloat16_enabled
    both = DeepSpeedConfig({"train_batch_size": 2, "bf16": {"enabled": False}, "bfloat16": {"enabled": True}})
    assert both.bfloat16_enabled is False  # "bf16" wins


def test_offload_defaults(tmp_path: Path) -> None:
    zero = DeepSpeedZeroConfig(
        stage=3, offload_param={"device": "nvme", "nvme_path": str(tmp_path)}, offload_optimizer={"device": "cpu"}
    )
    assert zero.offload_param.buffer_count == 5 and zero.offload_param.buffer_size == 100_000_000
    assert zero.offload_param.max_in_cpu == 1_000_000_000 and zero.offload_param.nvme_path == tmp_path
    assert zero.offload_optimizer.buffer_count == 4 and zero.offload_optimizer.ratio == 1.0
    assert zero.offload_optimizer.pin_memory is True and zero.offload_optimizer.pipeline is False


def test_zero_stage_enum_is_picklable_at_upstream_path() -> None:
    restored = pickle.loads(pickle.dumps(ZeroStageEnum.gradients))
    assert restored is ZeroStageEnum.gradients and type(restored).__module__ == "deepspeed.runtime.zero.config"
    assert [int(s) for s in (ZeroStageEnum.disabled, ZeroStageEnum.optimizer_states, ZeroStageEnum.weights)] == [
        0,
        1,
        3,
    ]


def test_precision_blocks_and_loss_scale_views() -> None:
    cfg = DeepSpeedConfig({"train_batch_size": 2, "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 3}})
    assert cfg.loss_scale == 0 and cfg.initial_dynamic_scale == 256
    assert cfg.dynamic_loss_scale_args == {
        "init_scale": 256,
        "scale_window": 1000,
        "delayed_shift": 3,
        "consecutive_hysteresis": False,
        "min_scale": 1,
    }
    static = DeepSpeedConfig({"train_batch_size": 2, "fp16": {"enabled": True, "loss_scale": 128}})
    assert static.dynamic_loss_scale_args is None and static.loss_scale == 128
    bf16 = DeepSpeedConfig({"train_batch_size": 2, "bf16": {"enabled": True}})
    assert bf16.loss_scale == 1.0 and bf16.bfloat16_check_grad_overflow is True


def test_monitor_comms_and_activation_checkpointing() -> None:
    cfg = DeepSpeedConfig(
        {
            "train_batch_size": 2,
            "tensorboard": {"enabled": True, "output_path": "/tmp/tb"},
            "comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]},
            "activation_checkpointing": {"partition_activations": True, "number_checkpoints": 4, "some_future_key": 1},
        }
    )
    assert cfg.monitor_config.enabled and cfg.monitor_config.tensorboard.output_path == "/tmp/tb"
    assert cfg.monitor_config.wandb.project == "deepspeed" and cfg.monitor_config.comet.samples_log_interval == 100
    assert cfg.comms_config.comms_logger_enabled and cfg.comms_config.comms_logger.prof_ops == ["all_reduce"]
    assert cfg.activation_checkpointing_config.partition_activations is True
    assert cfg.activation_checkpointing_config.number_checkpoints == 4
    assert not DeepSpeedConfig({"train_batch_size": 2}).comms_config.comms_logger_enabled
    assert get_monitor_config({}).enabled is False
    assert CommsLoggerConfig().prof_all is True
    assert DeepSpeedActivationCheckpointingConfig({"activation_checkpointing": {"profile": True}}).profile


def test_other_blocks_and_views() -> None:
    cfg = DeepSpeedConfig(
        {
            "train_batch_size": 2,
            "checkpoint": {"tag_validation": "fail"},
            "flops_profiler": {"enabled": True},
            "aio": {"queue_depth": 16},
            "data_types": {"grad_accum_dtype": "fp32"},
            "communication_data_type": "bf16",
        }
    )
    assert cfg.checkpoint_tag_validation_enabled and cfg.checkpoint_tag_validation_fail
    assert cfg.load_universal_checkpoint is False and cfg.use_node_local_storage is False
    assert cfg.wall_clock_breakdown is True  # forced by the flops profiler
    assert cfg.aio_config["queue_depth"] == 16 and cfg.aio_config["block_size"] == 1048576
    assert cfg.grad_accum_dtype == "fp32"
    import torch

    assert cfg.communication_data_type == torch.bfloat16
    ignore = DeepSpeedConfig({"train_batch_size": 2, "checkpoint": {"tag_validation": "Ignore"}})
    assert not ignore.checkpoint_tag_validation_enabled
    default = DeepSpeedConfig({"train_batch_size": 2})
    assert default.steps_per_print is None and default.gradient_clipping == 1.0
    assert default.optimizer_name is None and default.optimizer_params is None and default.world_size == 1
