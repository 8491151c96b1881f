"""Bad MoE set-ups fail with a clear error on every rank, before any collective could leave one waiting."""
from __future__ import annotations

import torch

from tests._harness import run_distributed
from tests.dist import _moe_model as mm

_OPT = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}


def _error_of(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _engine(model: torch.nn.Module, stage: int, optimizer: object = None) -> None:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
    if optimizer is None:
        config["optimizer"] = _OPT
    deepspeed.initialize(model=model, optimizer=optimizer, config=config)


def _bad_setups() -> dict[str, str]:
    from deepspeed.moe.layer import MoE

    out = {"experts_not_divisible": _error_of(lambda: MoE(8, torch.nn.Linear(8, 8), num_experts=6, ep_size=4))}
    odd = torch.nn.Sequential(MoE(8, torch.nn.Linear(8, 8), num_experts=3, ep_size=3))
    out["ep_not_dividing_world"] = _error_of(lambda: _engine(odd, 0))
    out["zero3"] = _error_of(lambda: _engine(mm.MoEModel(2, 1, 1.0, 1), 3))
    plain = mm.MoEModel(2, 1, 1.0, 1)
    out["zero2_unsplit_groups"] = _error_of(
        lambda: _engine(plain, 2, torch.optim.AdamW(plain.parameters(), lr=1e-3)))
    return out


def test_bad_moe_setups_raise_on_every_rank() -> None:
    results = run_distributed(_bad_setups, 4, timeout=120.0)
    for rank_result in results:
        assert "ValueError" in rank_result["experts_not_divisible"]
        assert "num_experts=6, ep_size=4" in rank_result["experts_not_divisible"]
        assert "ValueError" in rank_result["ep_not_dividing_world"]
        assert "ep_size=3 must divide the world size 4" in rank_result["ep_not_dividing_world"]
        assert "NotImplementedError" in rank_result["zero3"] and "stage=3" in rank_result["zero3"]
        assert "marked 'moe'" in rank_result["zero2_unsplit_groups"]
        assert "split_params_into_different_moe_groups_for_optimizer" in rank_result["zero2_unsplit_groups"]
