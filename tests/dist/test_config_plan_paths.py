"""One config-to-plan conversion: the ZeRO façades built without the engine plan exactly what the engine path plans.

``DeepSpeedZeroOptimizer(...)`` and ``DeepSpeedZeRoOffload(...)`` take upstream's keyword arguments; the engine
reads a config. Both go through ``deepspeed/_core/config/convert.py``, so the same settings must give equal plan
objects, and a no-effect keyword warns naming its key, as the config key does.
"""

from __future__ import annotations

import logging

import torch

from tests._harness import run_distributed

ZERO = {
    "stage": 2,
    "reduce_bucket_size": 1234,
    "allgather_bucket_size": 5678,
    "overlap_comm": True,
    "reduce_scatter": False,
    "offload_optimizer": {"device": "cpu", "pin_memory": False},
}
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 3,
    "gradient_clipping": 0.5,
    "prescale_gradients": True,
    "gradient_predivide_factor": 2.0,
    "communication_data_type": "fp32",
    "bf16": {"enabled": True, "check_grad_overflow": False},
    "data_types": {"grad_accum_dtype": "fp32"},
    "zero_optimization": ZERO,
}


def _stage12_plans() -> tuple:
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    engine_plan = DeepSpeedConfig(CONFIG).plan
    zero = DeepSpeedConfig(CONFIG).zero_config
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt = DeepSpeedZeroOptimizer(
        torch.optim.AdamW(model.parameters()),
        None,
        None,
        None,
        reduce_bucket_size=1234,
        allgather_bucket_size=5678,
        overlap_comm=True,
        reduce_scatter=False,
        offload_optimizer_config=zero.offload_optimizer,
        clip_grad=0.5,
        postscale_gradients=False,
        gradient_predivide_factor=2.0,
        communication_data_type=torch.float32,
        gradient_accumulation_dtype=torch.float32,
        gradient_accumulation_steps=3,
        partition_grads=True,
        check_grad_overflow=False,
    )
    return engine_plan, opt.plan


def _stage3_policies() -> tuple:
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    cfg = DeepSpeedConfig(
        {
            "train_batch_size": 1,
            "zero_optimization": {
                "stage": 3,
                "stage3_prefetch_bucket_size": 11,
                "stage3_max_live_parameters": 22,
                "stage3_max_reuse_distance": 33,
                "stage3_param_persistence_threshold": 0,
                "stage3_model_persistence_threshold": 44,
                "stage3_module_granularity_threshold": 55,
                "offload_param": {"device": "cpu", "pin_memory": False},
                "leaf_module": {"names": ["0"]},
            },
        }
    )
    zero = cfg.zero_config
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    offload = DeepSpeedZeRoOffload(
        model,
        ds_config=cfg,
        prefetch_bucket_size=11,
        max_live_parameters=22,
        max_reuse_distance=33,
        param_persistence_threshold=0,
        model_persistence_threshold=44,
        zero_module_granularity_threshold=55,
        offload_param_config=zero.offload_param,
    )
    manager = offload.manager
    shard = next(model.parameters()).ds_tensor  # upstream attribute: this rank's partition
    out = (cfg.plan.zero.stage3, manager.policy, (str(shard.device), shard.is_pinned()))
    offload.destroy()
    return out


def _keyword_warnings() -> list[str]:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils.logging import logger

    records: list[str] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        model = torch.nn.Linear(4, 4)
        DeepSpeedZeroOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            None,
            None,
            None,
            round_robin_gradients=True,
            communication_data_type=torch.float32,
        )
    finally:
        logger.removeHandler(handler)
    return records


def test_stage12_facade_plans_what_the_engine_plans() -> None:
    engine_plan, facade_plan = run_distributed(_stage12_plans, 1)[0]
    assert facade_plan.zero == engine_plan.zero
    assert facade_plan.grads == engine_plan.grads
    assert facade_plan.precision == engine_plan.precision
    assert facade_plan.batch.gradient_accumulation_steps == 3
    # The settings above are not the defaults, so equality is not trivially true.
    assert facade_plan.zero.buckets.reduce_bucket_size == 1234 and not facade_plan.zero.offload_optimizer.pin_memory
    assert facade_plan.precision.grad_accum_dtype == torch.float32 and not facade_plan.precision.check_grad_overflow


def test_stage3_facade_plans_what_the_engine_plans() -> None:
    engine_policy, facade_policy, shard = run_distributed(_stage3_policies, 1)[0]
    assert facade_policy == engine_policy
    assert (facade_policy.prefetch_bucket_size, facade_policy.module_granularity_threshold) == (11, 55)
    assert facade_policy.leaf_module.names == ("0",)
    assert shard == ("cpu", False)  # offload_param {device: cpu, pin_memory: false}


def test_no_effect_keyword_of_the_facade_warns_naming_its_key() -> None:
    warnings = run_distributed(_keyword_warnings, 1)[0]
    assert any(
        w.startswith("zero_optimization.round_robin_gradients is accepted but has no effect") for w in warnings
    ), warnings
