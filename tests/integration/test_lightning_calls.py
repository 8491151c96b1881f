"""The DeepSpeed calls Lightning's ``DeepSpeedStrategy`` makes, replayed on 2 gloo ranks (Lightning itself needs
CUDA for this strategy; ``benchmarks/clients/lightning_gpu.py`` runs the real Trainer on a GPU).

The sequence: the process group exists before DeepSpeed sees it; ``zero.Init(enabled=, remote_device=,
config_dict_or_path=)`` around model construction; ``checkpointing.configure(mpu_=None, ...)``;
``initialize(args=Namespace(device_rank=...), dist_init_required=False, ...)`` with a client optimizer and
scheduler; ``save_checkpoint(path, client_state=, tag="checkpoint")``; ``load_checkpoint(..., load_module_strict=,
load_lr_scheduler_states=False)``; then ``zero_to_fp32`` to collapse the checkpoint. Every weight is compared with a
plain single-process PyTorch run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

import deepspeed
from deepspeed import comm as dist
from deepspeed.utils import safe_get_full_fp32_param
from tests.reference.models import TinyMLP

MICRO, LR = 2, 0.1


def _config(stage: int) -> dict:
    # Lightning writes this dict itself from the strategy's arguments.
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "activation_checkpointing": {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
            "profile": False,
        },
    }


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, 37, (2 * MICRO, 5), generator=gen), torch.randint(0, 37, (2 * MICRO, 5), generator=gen)


def _strategy_setup(stage: int) -> deepspeed.DeepSpeedEngine:
    """What ``DeepSpeedStrategy._setup_model`` / ``_initialize_deepspeed_train`` do, in order."""
    config = _config(stage)
    torch.manual_seed(0)
    with deepspeed.zero.Init(enabled=stage == 3, remote_device=None, config_dict_or_path=config):
        model = TinyMLP()
    ac = config["activation_checkpointing"]
    deepspeed.checkpointing.configure(
        mpu_=None,
        partition_activations=ac["partition_activations"],
        contiguous_checkpointing=ac["contiguous_memory_optimization"],
        checkpoint_in_cpu=ac["cpu_checkpointing"],
        profile=ac["profile"],
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine, _, _, _ = deepspeed.initialize(
        args=argparse.Namespace(device_rank=None),
        config=config,
        model=model,
        model_parameters=model.parameters(),
        optimizer=optimizer,
        lr_scheduler=scheduler,
        dist_init_required=False,
    )
    return engine


def _step(engine: deepspeed.DeepSpeedEngine, step: int) -> None:
    tokens, labels = _batch(step)
    mine = slice(dist.get_rank() * MICRO, (dist.get_rank() + 1) * MICRO)
    engine.backward(engine(tokens[mine], labels[mine]))
    engine.step()


def _reference(steps: int) -> TinyMLP:
    torch.manual_seed(0)
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(steps):
        optimizer.zero_grad()
        model(*_batch(step)).backward()
        optimizer.step()
        scheduler.step()
    return model


def _assert_matches(engine: deepspeed.DeepSpeedEngine, reference: torch.nn.Module) -> None:
    for param, want in zip(engine.module.parameters(), reference.parameters(), strict=True):
        got = safe_get_full_fp32_param(param).reshape(want.shape)
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_strategy_calls(stage: int, tmp_path: Path) -> None:
    deepspeed.init_distributed("gloo", distributed_port=int(os.environ["MASTER_PORT"]))  # adopts the group
    engine = _strategy_setup(stage)
    _step(engine, 0)
    _assert_matches(engine, _reference(1))
    ckpt = str(tmp_path / f"stage{stage}.ckpt")
    engine.save_checkpoint(ckpt, client_state={"epoch": 4, "global_step": 1}, tag="checkpoint")

    resumed = _strategy_setup(stage)
    path, client_state = resumed.load_checkpoint(
        ckpt, load_optimizer_states=True, load_lr_scheduler_states=False, load_module_strict=True
    )
    assert Path(path) == Path(ckpt, "checkpoint") or path.endswith("checkpoint"), path
    assert client_state["epoch"] == 4 and client_state["global_step"] == 1
    _assert_matches(resumed, _reference(1))

    from deepspeed.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
        get_model_state_file,
        get_optim_files,
    )

    tag_dir = os.path.join(ckpt, "checkpoint")
    assert len(get_optim_files(tag_dir)) == 2
    assert os.path.basename(get_model_state_file(tag_dir, stage)).endswith("mp_rank_00_model_states.pt")
    if dist.get_rank() == 0:
        state = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="checkpoint")
        for name, want in _reference(1).state_dict().items():
            torch.testing.assert_close(state[name].float(), want, rtol=1e-6, atol=1e-7, msg=name)
    dist.barrier()
    for e in (engine, resumed):
        e.destroy()
