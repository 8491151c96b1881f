"""The MoE layer on one rank (no process group): shapes, residual MoE, argument checks, param helpers."""

from __future__ import annotations

import pytest
import torch

from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import (
    has_moe_layers,
    is_moe_param,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
)


def _moe(**kw: object) -> MoE:
    torch.manual_seed(0)
    return MoE(8, torch.nn.Linear(8, 8), num_experts=4, min_capacity=1, **kw)


def test_forward_returns_output_l_aux_counts() -> None:
    layer = _moe(k=2, use_rts=False)
    x = torch.randn(2, 5, 8)
    out, l_aux, counts = layer(x)
    assert out.shape == x.shape and l_aux.dim() == 0 and counts.shape == (4,)
    assert int(counts.sum()) == 2 * 10  # two choices per token


def test_output_matches_explicit_expert_mix() -> None:
    layer = _moe(k=1, use_rts=False, capacity_factor=4.0)  # capacity large enough that nothing drops
    x = torch.randn(6, 8)
    out, _, _ = layer(x)
    gates = torch.softmax(x @ layer.deepspeed_moe.gate.wg.weight.T, dim=1)
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    expected = torch.stack([gates[s].max() * experts[int(gates[s].argmax())](x[s]) for s in range(6)])
    torch.testing.assert_close(out, expected)


def test_residual_moe_mixes_dense_branch() -> None:
    layer = _moe(k=1, use_residual=True, use_rts=False)
    assert hasattr(layer, "mlp") and layer.coefficient.out_features == 2
    assert not any(is_moe_param(p) for p in layer.mlp.parameters())
    out, _, _ = layer(torch.randn(3, 8))
    out.sum().backward()
    assert layer.coefficient.weight.grad is not None and layer.mlp.weight.grad is not None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"num_experts": 6, "ep_size": 4}, ValueError, "num_experts"),
        ({"use_tutel": True}, ValueError, "use_tutel"),
        ({"k": 4}, ValueError, "k=4"),
        ({"noisy_gate_policy": "bad"}, ValueError, "noisy_gate_policy"),
        ({"enable_expert_tensor_parallelism": True}, NotImplementedError, "enable_expert_tensor_parallelism"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, error: type, match: str) -> None:
    args = {"num_experts": 4, **kwargs}
    with pytest.raises(error, match=match):
        MoE(8, torch.nn.Linear(8, 8), **args)


def test_ep_size_without_group_raises_clearly() -> None:
    layer = MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2, min_capacity=1)
    with pytest.raises(RuntimeError, match="set_deepspeed_parallelism"):
        layer(torch.randn(4, 8))


def test_param_helpers() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _moe(k=1))
    assert has_moe_layers(model) == (True, 4)
    assert has_moe_layers(torch.nn.Linear(2, 2)) == (False, 0)
    expert_params = [p for p in model.parameters() if is_moe_param(p)]
    assert len(expert_params) == 8 and all(p.group_name == "ep_size_1" for p in expert_params)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "lr": 0.1})
    assert [(len(g["params"]), g.get("moe", False), g.get("name")) for g in groups] == [
        (3, False, None),
        (8, True, "ep_size_1"),
    ]
    assert all(g["lr"] == 0.1 for g in groups)
    small = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters())}], max_group_size=64
    )
    assert all(sum(p.numel() for p in g["params"]) <= 72 for g in small if g.get("moe"))
    assert len([g for g in small if g.get("moe")]) > 1
    out, _, _ = model[1](model[0](torch.randn(4, 8)))
    out.sum().backward()
    shared, expert = split_params_grads_into_shared_and_expert_params(list(model.parameters()))
    assert len(shared) == 3 and len(expert) == 8
    with pytest.raises(ValueError, match="param_groups"):
        split_params_into_different_moe_groups_for_optimizer(42)
