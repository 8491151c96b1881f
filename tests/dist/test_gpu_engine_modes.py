"""Every ZeRO mode trains on a real GPU over NCCL, one rank, against plain PyTorch AdamW on the same device.

The CPU suite runs over gloo, which takes host tensors in every collective; NCCL takes device tensors only. A host
tensor reaching an NCCL collective (as ZenFlow's column norms once did) only fails here. Each mode runs in a fresh
rank with ``DS_ACCELERATOR=cuda`` and the NCCL backend.
"""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch

pytestmark = pytest.mark.gpu

STEPS, LR, BETAS, EPS, WD = 3, 1e-2, (0.9, 0.999), 1e-8, 0.01


def _config(zero: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": list(BETAS), "eps": EPS}},
        "zero_optimization": zero,
    }


MODES = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "zero3_offload": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "zero3_offload_params": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
    },
}
ZENFLOW = {
    "stage": 2,
    "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "zenflow": {"topk_ratio": 0.3, "select_strategy": "step", "select_interval": 2, "update_interval": 2},
}


def _train(zero: dict, park_states: bool = False) -> dict:
    """``park_states``: ``offload_states`` / ``reload_states`` (page-locked copies, non-blocking) after each step."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(zero))
    for step in range(STEPS):
        tokens, labels = (t.to(engine.device) for t in micro_batch(step, 0))
        engine.backward(engine(tokens, labels))
        engine.step()
        if park_states:
            engine.offload_states(pin_memory=True, non_blocking=True)
            engine.reload_states(non_blocking=True)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=zero["stage"] == 3):
        weights = {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
    zen = getattr(engine.optimizer, "zenflow", None)
    engine.destroy()
    return {"weights": weights, "host_updates": zen.host_updates if zen is not None else 0, "device": engine.device.type}


def _reference() -> dict[str, torch.Tensor]:
    model = make_model(0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(STEPS):
        tokens, labels = (t.cuda() for t in micro_batch(step, 0))
        model(tokens, labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def _on_gpu(zero: dict, park_states: bool = False) -> dict:
    (out,) = run_distributed(_train, 1, zero, park_states, backend="nccl", env={"DS_ACCELERATOR": "cuda"})
    assert out["device"] == "cuda"
    return out


@pytest.mark.parametrize(("mode", "park_states"), [(m, False) for m in sorted(MODES)] + [("zero3", True)])
def test_mode_matches_pytorch_adamw_on_the_gpu(mode: str, park_states: bool) -> None:
    got = _on_gpu(MODES[mode], park_states)["weights"]
    expected = _reference()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{mode} {k}: {m}")


@pytest.mark.parametrize("stage", [1, 2])
def test_zenflow_steps_over_nccl(stage: int) -> None:
    # At stage 1 the window's gradients are accumulated beside the working weights, not on the host.
    out = _on_gpu({**ZENFLOW, "stage": stage})
    assert out["host_updates"] >= 1
    assert all(torch.isfinite(v).all() for v in out["weights"].values())
