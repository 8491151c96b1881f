"""ZeRO-1/2 checkpoints: exact resume, and elastic resume at another data-parallel size."""

from __future__ import annotations

import os

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index, reference_train

GAS = 2
LR = 1e-2


def _config(stage: int, bf16: bool) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 400, "allgather_bucket_size": 600},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(engine, steps: range, world: int) -> None:  # noqa: ANN001
    from deepspeed import comm as dist

    for step in steps:
        for m in range(GAS):
            engine.backward(engine(*micro_batch(step, engine_micro_index(m, dist.get_rank(), world))))
            engine.step()


def _save(world: int, stage: int, bf16: bool, save_dir: str, steps: int) -> None:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(stage, bf16))
    _train(engine, range(steps), world)
    engine.save_checkpoint(save_dir)


def _resume(world: int, stage: int, bf16: bool, save_dir: str, start: int, end: int) -> dict:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(123), config=_config(stage, bf16))  # different init
    path, _ = engine.load_checkpoint(save_dir)
    assert path is not None and engine.global_steps == start
    _train(engine, range(start, end), world)
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _reference(worlds: list[int]) -> dict:
    """fp32 single-process training where step ``s`` sees ``worlds[s] * GAS`` micro-batches."""
    model = make_model(0)
    opt = lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01)  # noqa: E731
    reference_train(model, len(worlds), worlds, GAS, opt, clip=1.0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "stage,save_world,load_world,bf16",
    [(1, 2, 2, False), (2, 2, 2, True), (2, 2, 1, False), (1, 2, 4, False), (2, 4, 2, False)],
)
def test_resume(tmp_path: object, stage: int, save_world: int, load_world: int, bf16: bool) -> None:
    save_dir = os.path.join(str(tmp_path), "ckpt")
    run_distributed(_save, save_world, save_world, stage, bf16, save_dir, 3)
    files = sorted(os.listdir(os.path.join(save_dir, "global_step3")))
    prefix = "bf16_" if bf16 else ""
    expected = [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(save_world)]
    assert files == sorted(["mp_rank_00_model_states.pt", *expected])
    results = run_distributed(_resume, load_world, load_world, stage, bf16, save_dir, 3, 6)
    if bf16:
        # Same world size, bf16: compare against an uninterrupted run of the same engine configuration.
        straight = os.path.join(str(tmp_path), "straight")
        run_distributed(_save, save_world, save_world, stage, bf16, straight, 6)
        expect = run_distributed(_resume, load_world, load_world, stage, bf16, straight, 6, 6)[0]
        for k, v in expect.items():
            assert torch.equal(results[0][k], v), k
        return
    ref = _reference([save_world] * 3 + [load_world] * 3)
    for k, v in ref.items():
        for r in results:
            rel = float((r[k] - v).norm() / v.norm())
            assert rel < 1e-5, f"{k}: relative error {rel:.3g}"
