"""Bad configs fail on every rank, with a message naming the key, before any collective can hang."""

from __future__ import annotations

import json
import os

import pytest

from tests._harness import run_distributed
from tests.reference.models import make_model

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

CASES = {
    "negative_bucket": ({**BASE, "zero_optimization": {"stage": 2, "reduce_bucket_size": -5}}, "reduce_bucket_size"),
    "stage_7": ({**BASE, "zero_optimization": {"stage": 7}}, "stage"),
    "fp16_and_bf16": ({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16"),
    "batch_mismatch": (
        {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1},
        "train_batch_size",
    ),
    "unknown_zero_key": ({**BASE, "zero_optimization": {"stage": 2, "overlap_com": True}}, "overlap_comm"),
    "unknown_scheduler": ({**BASE, "scheduler": {"type": "NoSuchLR", "params": {}}}, "NoSuchLR"),
}


def _try_initialize(world: int, config: object) -> str:
    import deepspeed

    try:
        deepspeed.initialize(model=make_model(0), config=config)
    except (ValueError, AssertionError) as exc:  # DeepSpeedConfigError is a ValueError
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config_fails_on_every_rank(case: str) -> None:
    config, key = CASES[case]
    messages = run_distributed(_try_initialize, 2, 2, config, timeout=60)
    for message in messages:
        assert message != "no error"
        assert key in message, message


def test_config_file_that_is_not_json(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "ds.json")
    with open(path, "w") as f:
        f.write("{ this is not: json, [")
    for message in run_distributed(_try_initialize, 2, 2, path, timeout=60):
        assert "ds.json" in message, message


def test_model_without_trainable_parameters() -> None:
    messages = run_distributed(_frozen_model, 2, 2, timeout=60)
    for message in messages:
        assert "no trainable parameters" in message, message


def _frozen_model(world: int) -> str:
    import deepspeed

    model = make_model(0)
    model.requires_grad_(False)
    try:
        deepspeed.initialize(model=model, config=json.loads(json.dumps(BASE)))
    except ValueError as exc:
        return str(exc)
    return "no error"


def _optimizer_twice(world: int) -> str:
    import torch

    import deepspeed

    model = make_model(0)
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=BASE)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_optimizer_in_config_and_as_object() -> None:
    for message in run_distributed(_optimizer_twice, 2, 2, timeout=60):
        assert "both" in message, message


def _double_backward(world: int) -> str:
    import deepspeed
    from tests.reference.models import micro_batch

    engine, *_ = deepspeed.initialize(model=make_model(0), config=BASE)
    engine.backward(engine(*micro_batch(0, 0, micro=2)))
    try:
        engine.backward(engine(*micro_batch(0, 1, micro=2)))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_backward_twice_at_boundary_without_step() -> None:
    for message in run_distributed(_double_backward, 2, 2, timeout=60):
        assert "step()" in message, message
