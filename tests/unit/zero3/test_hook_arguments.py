"""The backward hooks see grad-requiring tensors however a module is called: plain arguments (the fast path),
named tuples and keyword arguments (the pytree path), one output or several."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from deepspeed._core.params.hooks import ModuleHooks

Pair = collections.namedtuple("Pair", "x y")


class _Log:
    def __init__(self) -> None:
        self.events: list[str] = []

    def pre_forward(self, module: nn.Module) -> None: ...
    def post_forward(self, module: nn.Module) -> None: ...
    def grad_ready(self, param: nn.Parameter) -> None: ...
    def on_param_access(self, param: nn.Parameter) -> None: ...

    def pre_backward(self, module: nn.Module) -> None:
        self.events.append("pre")

    def post_backward(self, module: nn.Module) -> None:
        self.events.append("post")

    def backward_finished(self) -> None:
        self.events.append("end")


class _Plain(nn.Module):
    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale


class _Named(nn.Module):
    def forward(self, pair: Pair) -> torch.Tensor:
        return pair.x * 2 + pair.y


class _Keyword(nn.Module):
    def forward(self, x: torch.Tensor, *, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * y, x + y


@pytest.mark.parametrize("case", ["plain", "named", "keyword"])
def test_pre_and_post_backward_fire_once_each(case: str) -> None:
    log = _Log()
    x, y = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    module = {"plain": _Plain, "named": _Named, "keyword": _Keyword}[case]()
    hooks = ModuleHooks(log)
    hooks.register_module(module, lambda m: False)
    if case == "plain":
        loss = module(x, 2.0).sum()
    elif case == "named":
        loss = module(Pair(x, y)).sum()
    else:
        a, b = module(x, y=y)
        loss = (a + b).sum()
    loss.backward()
    hooks.remove()
    assert log.events == ["pre", "post", "end"], log.events
    assert x.grad is not None
