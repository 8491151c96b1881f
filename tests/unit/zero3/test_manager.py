"""ZeroParamManager behaviour at world size 1 (no process group): persistence, leaf modules, trace
invalidation, the TRL hook-removal flow through the ``DeepSpeedZeRoOffload`` façade."""

from __future__ import annotations

import copy

import torch
from torch import nn

from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.config.plan import LeanPolicy, Stage3Policy
from deepspeed._core.params.manager import ZeroParamManager
from deepspeed._core.params.param import ZeroParamStatus
from deepspeed.runtime.zero import GatheredParameters, unregister_external_parameter
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
from deepspeed.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
)

WORLD1 = ShardGroup(None, 0, 1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.b, self.a) if self.swap else (self.a, self.b)
        return second(torch.relu(first(x)))


def _pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    return model, copy.deepcopy(model)


def _grads_after(model: nn.Module, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    loss = model(x).square().mean()
    loss.backward()
    return loss.item(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _collect(manager: ZeroParamManager) -> dict[int, torch.Tensor]:
    grads: dict[int, torch.Tensor] = {}

    def take(param: nn.Parameter, state: object, grad: torch.Tensor) -> None:
        grads[param.ds_id] = grad.clone()
        param.grad = None

    manager.on_grad_ready(take)
    return grads


def test_persistent_params_stay_gathered_within_the_model_budget() -> None:
    model, _ = _pair()
    manager = ZeroParamManager(
        model, WORLD1, Stage3Policy(param_persistence_threshold=16, model_persistence_threshold=40), LeanPolicy()
    )
    persistent = [n for n, p in model.named_parameters() if p.ds_persist]
    assert persistent == ["0.a.bias", "0.b.bias"]  # 16 + 16 <= 40 < 48
    model(torch.randn(2, 16)).sum().backward()
    status = {n: p.ds_status for n, p in model.named_parameters()}
    assert status["0.a.bias"] is ZeroParamStatus.AVAILABLE and status["1.a.bias"] is ZeroParamStatus.NOT_AVAILABLE
    assert status["0.a.weight"] is ZeroParamStatus.NOT_AVAILABLE
    manager.destroy()
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())


def test_leaf_modules_are_one_unit_and_keep_numerics() -> None:
    model, reference = _pair()
    assert [type(m) for m in set_z3_leaf_modules(model, [Block])] == [Block, Block]
    assert len(get_z3_leaf_modules(model)) == 2
    manager = ZeroParamManager(model, WORLD1, Stage3Policy(param_persistence_threshold=0), LeanPolicy())
    assert not model[0].a._forward_pre_hooks, "children of a leaf must not be hooked"
    manager.boundary_samples = []
    grads = _collect(manager)
    x = torch.randn(3, 16)
    ref_loss, ref_grads = _grads_after(reference, x)
    loss = model(x).square().mean()
    loss.backward()
    assert abs(loss.item() - ref_loss) < 1e-6
    for param, want in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(grads[param.ds_id], want)
    assert max(s.params_alive for s in manager.boundary_samples) == 4  # a whole block at once
    manager.destroy()
    unset_z3_leaf_modules(model, ["Block"])
    assert not get_z3_leaf_modules(model)


def test_order_change_invalidates_the_trace_without_changing_results() -> None:
    model, reference = _pair()
    manager = ZeroParamManager(
        model, WORLD1, Stage3Policy(param_persistence_threshold=0, prefetch_bucket_size=272), LeanPolicy()
    )
    grads = _collect(manager)
    x = torch.randn(3, 16)
    for step, swap in enumerate([False, False, True, True, False]):
        model[1].swap = reference[1].swap = swap
        reference.zero_grad()
        ref_loss, ref_grads = _grads_after(reference, x)
        loss = model(x).square().mean()
        loss.backward()
        assert abs(loss.item() - ref_loss) < 1e-6, step
        for param, want in zip(model.parameters(), ref_grads, strict=True):
            torch.testing.assert_close(grads[param.ds_id], want)
    assert manager.trace.invalidations == 2
    manager.destroy()


def test_trl_generation_flow_through_the_facade() -> None:
    model, reference = _pair()
    offload = DeepSpeedZeRoOffload(model, param_persistence_threshold=0, prefetch_bucket_size=0)
    assert offload.module is model and len(offload.forward_hooks) == 2 * len(list(model.modules()))
    # TRL's remove_hooks: clear active sets, remove and forget every hook handle.
    for param in iter_params(offload.module, recurse=True):
        param.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    x = torch.randn(2, 16)
    with GatheredParameters(model.parameters()), torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    offload._register_deepspeed_module(offload.module)  # TRL's add_hooks
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    assert offload.get_param_coordinator().is_record_trace()
    offload.destroy()
    assert not offload.forward_hooks and not offload.backward_hooks


def test_external_parameter_can_be_unregistered() -> None:
    owner, user = nn.Linear(2, 2), nn.Linear(2, 2)
    from deepspeed.runtime.zero import register_external_parameter

    register_external_parameter(user, owner.weight)
    assert len(user.ds_external_parameters()) == 1 and len(list(user.all_parameters())) == 3
    unregister_external_parameter(user, owner.weight)
    assert user.ds_external_parameters() == []


class UsesOther(nn.Module):
    """Reads ``other.weight`` directly; ``other`` itself is never called (upstream's ZeROOrderedDict case)."""

    def __init__(self) -> None:
        super().__init__()
        self.other = nn.Linear(16, 16)
        self.own = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.own(x), self.other.weight)


def test_reading_an_unfetched_parameter_in_forward_gathers_it() -> None:
    torch.manual_seed(0)
    model = UsesOther()
    reference = copy.deepcopy(model)
    original_dict = model.other._parameters
    manager = ZeroParamManager(model, WORLD1, Stage3Policy(param_persistence_threshold=0), LeanPolicy())
    grads = _collect(manager)
    x = torch.randn(3, 16)
    _, ref_grads = _grads_after(reference, x)
    for _ in range(2):
        loss = model(x).square().mean()
        loss.backward()
        assert manager.count_gathered().params_alive == 0
        torch.testing.assert_close(grads[model.other.weight.ds_id], ref_grads[0])
    assert model.other.weight.is_external_param
    assert [p for _, p in model.ds_external_parameters()] == [model.other.weight]
    manager.destroy()
    assert model.other._parameters is original_dict and type(original_dict) is dict
