"""16-bit offloaded state: ``bf16.bf16_master_weights_and_grads`` + ``bf16.bf16_optimizer_states`` with
``offload_optimizer`` (and ``offload_param``) keep a bf16 master and bf16 moments on the host, train like a plain
bf16-state reference, and survive a checkpoint round trip bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index

STEPS, LR = 4, 1e-2


def _config(stage: int, offload_param: bool) -> dict:
    zero: dict = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 30}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 3,
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }


def _weights(engine, stage: int) -> dict:
    import deepspeed

    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _steps(engine, world: int, steps: range) -> None:
    from deepspeed import comm as dist

    for step in steps:
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
        engine.step()


def _train(world: int, stage: int, offload_param: bool, ckpt: str) -> dict:
    import deepspeed

    cfg = _config(stage, offload_param)
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    opt = engine.optimizer
    _steps(engine, world, range(2))
    engine.save_checkpoint(ckpt, tag="mid")
    _steps(engine, world, range(2, STEPS))
    out = {"weights": _weights(engine, stage)}
    out["masters"] = [(g.master.dtype, g.master.device.type) for g in opt.groups]
    out["states"] = sorted(
        {(k, v.dtype, v.device.type) for s in opt.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)}
    )
    out["host_bytes_per_param"] = opt.host_state_bytes() / sum(g.master.numel() for g in opt.groups)
    engine.destroy()
    # Resume from the checkpoint in a fresh engine: the same bits at the end.
    resumed, *_ = deepspeed.initialize(model=make_model(1), config=cfg)
    resumed.load_checkpoint(ckpt, tag="mid")
    _steps(resumed, world, range(2, STEPS))
    out["resumed"] = _weights(resumed, stage)
    resumed.destroy()
    return out


def _reference(world: int) -> dict:
    """Plain PyTorch: bf16 parameters stepped in place by an AdamW that keeps bf16 moments."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    model = make_model(0).to(torch.bfloat16)
    opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=0.01, fp32_optimizer_states=False)
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        for index in range(world):
            (model(*micro_batch(step, index)) / world).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world,stage,offload_param", [(1, 2, False), (2, 2, False), (1, 3, False), (2, 3, True)])
def test_bf16_offloaded_states_train_and_checkpoint(tmp_path, world: int, stage: int, offload_param: bool) -> None:
    ref = _reference(world)
    for r in run_distributed(_train, world, world, stage, offload_param, str(tmp_path / "ckpt")):
        assert set(r["masters"]) == {(torch.bfloat16, "cpu")}
        assert r["states"] == [("exp_avg", torch.bfloat16, "cpu"), ("exp_avg_sq", torch.bfloat16, "cpu")]
        # bf16 master and two bf16 moments; gradients add their dtype's 2 bytes where they wait on the host.
        assert 6.0 <= r["host_bytes_per_param"] <= 8.0 + 1e-9, r["host_bytes_per_param"]
        for k, v in ref.items():
            got = r["weights"][k].float()
            rel = float((got - v.float()).norm() / v.float().norm())
            assert rel < 2e-2, f"{k}: {rel}"
        for k in r["weights"]:
            assert torch.equal(r["weights"][k], r["resumed"][k]), k


def _client_fp32_states() -> str:
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    cfg = _config(2, False)
    cfg.pop("optimizer")
    model = make_model(0)
    client = DeepSpeedCPUAdam(model.parameters(), lr=LR, fp32_optimizer_states=True)
    try:
        deepspeed.initialize(model=model, optimizer=client, config=cfg)
    except ValueError as err:
        return str(err)
    return ""


def test_a_client_optimizer_with_fp32_states_is_refused_under_bf16_optimizer_states() -> None:
    (message,) = run_distributed(_client_fp32_states, 1)
    assert "bf16.bf16_optimizer_states" in message and "fp32_optimizer_states" in message, message
