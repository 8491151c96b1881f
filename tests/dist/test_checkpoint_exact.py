"""Exact resume for ZeRO stages 1-3 in fp32, bf16 and fp16: N steps straight == k steps, save, fresh load,
N-k steps, bitwise. Resume at another world size is checked against the reference in
test_checkpoint_zero12.py and test_zero3_engine.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index

GAS = 2


def _config(stage: int, precision: str) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 400, "stage3_param_persistence_threshold": 30},
    }
    # A small initial fp16 scale that grows every 2 steps, so the loss-scaler state really moves.
    if precision != "fp32":
        extra = {"initial_scale_power": 4, "loss_scale_window": 2} if precision == "fp16" else {}
        cfg[precision] = {"enabled": True, **extra}
    return cfg


def _train(engine, steps: range, world: int) -> None:  # noqa: ANN001
    from deepspeed import comm as dist

    for step in steps:
        for m in range(GAS):
            engine.backward(engine(*micro_batch(step, engine_micro_index(m, dist.get_rank(), world))))
            engine.step()


def _snapshot(engine) -> dict:  # noqa: ANN001
    if engine.zero_optimization_stage() == 3:
        sd = engine._zero3_consolidated_16bit_state_dict()
        from deepspeed import comm as dist

        box = [sd]
        dist.broadcast_object_list(box, src=0)
        sd = box[0]
    else:
        sd = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    return dict(
        weights=sd,
        scale=engine.optimizer.cur_scale,
        lr=engine.get_lr(),
        steps=engine.global_steps,
        skipped=engine.skipped_steps,
    )


def _straight_and_resumed(world: int, stage: int, precision: str, save_dir: str) -> tuple[dict, dict]:
    import deepspeed

    cfg = _config(stage, precision)
    straight, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    _train(straight, range(4), world)
    first = _snapshot(straight)
    straight.destroy()
    before, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    _train(before, range(2), world)
    before.save_checkpoint(save_dir)
    before.destroy()
    after, *_ = deepspeed.initialize(model=make_model(5), config=cfg)
    after.load_checkpoint(save_dir)
    _train(after, range(2, 4), world)
    return first, _snapshot(after)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_exact_resume(tmp_path: object, stage: int, precision: str) -> None:
    save_dir = os.path.join(str(tmp_path), "ckpt")
    for straight, resumed in run_distributed(_straight_and_resumed, 2, 2, stage, precision, save_dir):
        assert resumed["steps"] == straight["steps"] == 4
        assert resumed["scale"] == straight["scale"] and resumed["lr"] == straight["lr"]
        assert resumed["skipped"] == straight["skipped"]
        for k, v in straight["weights"].items():
            assert torch.equal(resumed["weights"][k], v), k
