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
    out["zero2_unsplit_groups"] = _error_of(lambda: _engine(plain, 2, torch.optim.AdamW(plain.parameters(), lr=1e-3)))
    out["facade_partition_count"] = _facade_partition_count()
    return out


def _facade_partition_count() -> list[int]:
    """Upstream's constructor with ``has_moe_layers=True``: MoE groups partition over expert-data-parallel ranks."""
    from deepspeed._core.optim.base import MicroStepKind
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils import groups
    from tests.reference import moe_reference as ref

    model = mm.MoEModel(2, 1, 1.0, 1)
    model.moe.set_deepspeed_parallelism()
    before = [p.detach().clone() for p in mm.local_experts(model).parameters()]
    opt = torch.optim.AdamW(
        split_params_into_different_moe_groups_for_optimizer({"params": model.parameters()}), lr=1e-2
    )
    zero = DeepSpeedZeroOptimizer(
        opt,
        None,
        None,
        None,
        has_moe_layers=True,
        partition_grads=True,
        communication_data_type=torch.float32,
        expert_parallel_group=groups._get_expert_parallel_group_dict(),
        expert_data_parallel_group=groups._get_expert_data_parallel_group_dict(),
    )
    zero.prepare_backward(MicroStepKind.REDUCE)
    zero.backward(model(*ref.batch(0, 0)))
    zero.finish_backward()
    assert zero.step()
    after = list(mm.local_experts(model).parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    counts = zero.partition_count
    zero.destroy()
    return counts


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
        assert rank_result["facade_partition_count"] == [4, 2]  # shared over 4 ranks, experts over 2
