"""Every optimizer type the config block accepts builds, steps, and lands as the expected class."""

from __future__ import annotations

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch

TYPES = {
    "Adam": ({"lr": 1e-3}, "FusedAdam"),
    "AdamW": ({"lr": 1e-3, "weight_decay": 0.01}, "FusedAdam"),
    "Adam_torch": ({"lr": 1e-3, "torch_adam": True, "adam_w_mode": False}, "Adam"),
    "SGD": ({"lr": 1e-2, "momentum": 0.9}, "SGD"),
    "Adagrad": ({"lr": 1e-2}, "Adagrad"),
    "Lion": ({"lr": 1e-4}, "FusedLion"),
}


def _build_all(world: int) -> dict:
    import torch

    import deepspeed

    out = {}
    for key, (params, _) in TYPES.items():
        name = key.split("_")[0]
        cfg = {
            "train_micro_batch_size_per_gpu": 3,
            "optimizer": {"type": name, "params": dict(params)},
            "zero_optimization": {"stage": 1},
        }
        if name == "SGD":
            cfg["zero_allow_untested_optimizer"] = True
        engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
        before = {k: v.clone() for k, v in engine.module.state_dict().items()}
        engine.backward(engine(*micro_batch(0, 0)))
        engine.step()
        moved = any(not torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
        out[key] = (type(engine.basic_optimizer).__name__, moved)
        engine.destroy()
    return out


def test_config_optimizer_types() -> None:
    (result,) = run_distributed(_build_all, 1, 1)
    for key, (_, expected_cls) in TYPES.items():
        cls, moved = result[key]
        assert cls == expected_cls, (key, cls)
        assert moved, key
