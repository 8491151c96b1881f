"""Routed gradients ([Note: routed grads]): a tied table's uses are reduced as they are produced, and a plain
embedding's backward runs without gathering its table. World size 1 with separate gathered storage, so a
gather really allocates and the boundary samples see it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.config.plan import LeanPolicy, Stage3Policy
from deepspeed._core.params.grad_route import backward_reads_no_params, routed_keys
from deepspeed._core.params.manager import ParamStorage, ZeroParamManager
from deepspeed._core.params.param import FullStorage

WORLD1 = ShardGroup(None, 0, 1)
VOCAB, HIDDEN = 11, 6


class TiedLM(nn.Module):
    """Embedding -> two linears -> output projection sharing the embedding's table."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.mid2 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid2(torch.tanh(self.mid(self.embed(ids))))).square().mean()


def _manager(model: nn.Module, lean: LeanPolicy | None = None) -> ZeroParamManager:
    return ZeroParamManager(
        model,
        WORLD1,
        Stage3Policy(param_persistence_threshold=0),
        lean or LeanPolicy(),
        storage=ParamStorage(single_rank=FullStorage.SEPARATE),
    )


def _subscribe(manager: ZeroParamManager, names: dict[int, str]) -> list[tuple[str, torch.Tensor]]:
    arrivals: list[tuple[str, torch.Tensor]] = []

    def take(param: nn.Parameter, state: object, grad: torch.Tensor) -> None:
        arrivals.append((names[id(param)], grad.clone()))
        param.grad = None  # as the ZeRO-3 optimizer does

    manager.on_grad_ready(take)
    return arrivals


def _reference_grads(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model(ids).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _summed(arrivals: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    total: dict[str, torch.Tensor] = {}
    for name, grad in arrivals:
        total[name] = grad if name not in total else total[name] + grad
    return total


def _one_backward(tied: bool = True, lean: LeanPolicy | None = None, subscribe: bool = True) -> tuple:
    """Build a (tied) model under a manager, run one backward next to a plain copy's; returns the model, the
    manager, the arrivals seen by a subscriber (``None`` without one) and the reference gradients."""
    torch.manual_seed(0)
    model = TiedLM(tied)
    reference = copy.deepcopy(model)
    manager = _manager(model, lean)
    manager.boundary_samples = []
    arrivals = _subscribe(manager, {id(p): n for n, p in model.named_parameters()}) if subscribe else None
    ids = torch.randint(0, VOCAB, (3, 4))
    want = _reference_grads(reference, ids)
    model(ids).backward()
    return model, manager, arrivals, want


def _gathered_at(manager: ZeroParamManager, event: str, module: str) -> int:
    samples = [s for s in manager.boundary_samples if s.event == event and s.module == module]
    assert samples, f"no {event} sample for {module}"
    return samples[-1].params_alive


def test_routed_keys_pick_tied_parameters_and_plain_embeddings() -> None:
    tied, untied = TiedLM(), TiedLM(tied=False)
    every = lambda p: True  # noqa: E731
    assert routed_keys(tied.modules(), every) == {id(tied.embed): {"weight"}, id(tied.head): {"weight"}}
    assert routed_keys(untied.modules(), every) == {id(untied.embed): {"weight"}}  # quiet backward only
    assert routed_keys(untied.modules(), lambda p: p is not untied.embed.weight) == {}

    class Scaled(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * self.weight.mean()  # reads the table in backward

    class Renamed(nn.Embedding):
        pass

    assert backward_reads_no_params(nn.Embedding(3, 2))
    assert backward_reads_no_params(Renamed(3, 2))
    assert not backward_reads_no_params(Scaled(3, 2))
    assert not backward_reads_no_params(nn.Embedding(3, 2, max_norm=1.0))  # forward rewrites the table
    assert not backward_reads_no_params(nn.Embedding(3, 2, sparse=True))
    assert not backward_reads_no_params(nn.Linear(3, 2))


@pytest.mark.parametrize("tied", [True, False])
def test_uses_are_reduced_when_produced_and_the_embedding_backward_gathers_nothing(tied: bool) -> None:
    model, manager, arrivals, want = _one_backward(tied)
    order = [name for name, _ in arrivals]
    if tied:
        # One arrival per use: the projection's as soon as it is produced (before the layers below it), the
        # embedding's at the end. Autograd alone would deliver their sum once, after everything else.
        assert order.count("embed.weight") == 2, order
        assert order.index("embed.weight") < order.index("mid.weight"), order
        assert order[-1] == "embed.weight", order
    else:
        assert order.count("embed.weight") == 1 and order[-1] == "embed.weight", order
    got = _summed(arrivals)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, msg=name)
    assert model.embed.weight.grad is None, "a routed gradient must not reach param.grad"
    # The embedding's backward reads only the indices: nothing is gathered for it.
    assert _gathered_at(manager, "pre_backward", "embed") == 0
    assert manager.count_gathered().params_alive == 0
    manager.destroy()


def test_lean_off_keeps_autograd_accumulation_and_the_gather() -> None:
    _, manager, arrivals, want = _one_backward(lean=LeanPolicy(eager_grad_release=False))
    order = [name for name, _ in arrivals]
    assert order.count("embed.weight") == 1 and order[-1] == "embed.weight", order
    torch.testing.assert_close(_summed(arrivals)["embed.weight"], want["embed.weight"])
    assert _gathered_at(manager, "pre_backward", "embed") == 1
    manager.destroy()


def test_the_parameter_is_what_everyone_outside_forward_sees() -> None:
    model = TiedLM()
    manager = _manager(model)
    seen: list[torch.Tensor] = []
    model.head.register_forward_hook(lambda m, a, o: seen.append(m.weight))  # after forward: the parameter
    _subscribe(manager, {id(p): n for n, p in model.named_parameters()})
    assert model.head.weight is model.embed.weight
    assert isinstance(model.head.weight, nn.Parameter)
    model(torch.randint(0, VOCAB, (2, 3))).backward()
    assert seen and seen[0] is model.embed.weight
    assert [n for n, _ in model.named_parameters()] == [
        "embed.weight",
        "mid.weight",
        "mid.bias",
        "mid2.weight",
        "mid2.bias",
    ]
    assert set(model.state_dict()) == {
        "embed.weight",
        "mid.weight",
        "mid.bias",
        "mid2.weight",
        "mid2.bias",
        "head.weight",
    }
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (2, 3)))  # eval: plain parameters, nothing to route
    assert manager.count_gathered().params_alive == 0
    manager.destroy()


def test_without_a_subscriber_gradients_stay_with_autograd() -> None:
    """Routing bypasses param.grad, so it is on only while the optimizer (or anyone) receives gradients."""
    model, manager, _, want = _one_backward(subscribe=False)
    torch.testing.assert_close(model.embed.weight.grad, want["embed.weight"])
    handle = manager.on_grad_ready(lambda p, s, g: None)
    assert manager.hooks.routing
    handle.remove()
    assert not manager.hooks.routing
    manager.destroy()
