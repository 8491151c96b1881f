"""Routed gradients: parameter uses whose gradient goes straight to the ZeRO-3 reducer, not into ``param.grad``.

[Note: routed grads]
Autograd sums every use of a leaf into one input buffer and calls its ``AccumulateGrad`` only when the last use
has been differentiated. For a tied embedding (the input embedding and the output projection share one table)
the output projection's gradient, a full vocabulary-sized tensor, therefore waits from the first backward op to
the last. And the embedding's own backward gathers the table although ``F.embedding``'s backward reads only the
indices and the row count: ``AccumulateGrad`` needs the parameter full-shaped to steal the gradient.

Both land on the ZeRO-3 step's peak, at the end of the backward: the gathered table, the held projection
gradient (the same size) and the embedding backward's fp32 table (twice that) sit on top of the model states
(measured in ``docs/benchmarks.md``, S3 notes).

A routed use reads the parameter through :class:`_RoutedUse`: an identity in forward whose backward hands the
use's gradient to a sink (the manager, then the optimizer's bucket) and returns no gradient to the leaf. So
each use is reduced as soon as it is produced, and a module whose backward reads no parameter values
(:func:`backward_reads_no_params`) need not be gathered for its backward at all. Which uses are routed is decided
once, when the hooks are installed (:func:`routed_keys`); the parameter dictionary returns the routed form only
while its module's forward runs under grad mode, so ``state_dict``, optimizers and attribute reads outside
forward still see the ``nn.Parameter``.

The returned tensor is a view of the parameter, i.e. of the gathered storage: the manager's release frees that
storage by resizing it, so a view saved for backward holds no memory and sees the values of the next gather.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

GradSink = Callable[[nn.Parameter, torch.Tensor], None]
"""Receives ``(param, gradient of one use)``; the gradient has the parameter's full shape."""


class _RoutedUse(torch.autograd.Function):
    """Identity on a parameter whose backward delivers the gradient to a sink instead of the leaf."""

    @staticmethod
    def forward(ctx: Any, sink: GradSink, param: torch.Tensor) -> torch.Tensor:
        ctx.sink = sink
        ctx.param = param
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.sink(ctx.param, grad)
        return None, None


def routed_use(param: nn.Parameter, sink: GradSink) -> torch.Tensor:
    """``param`` as one routed use: same values, its gradient goes to ``sink`` (see [Note: routed grads])."""
    return _RoutedUse.apply(sink, param)


def backward_reads_no_params(module: nn.Module) -> bool:
    """True when ``module``'s backward needs none of its parameters' values.

    Only a plain ``nn.Embedding`` (its class's ``forward`` unchanged) qualifies: dense, without ``max_norm``
    (which rewrites the table in forward), and with no parameter besides ``weight``. Its backward is a
    scatter-add of the output gradient by index.
    """
    if not isinstance(module, nn.Embedding) or type(module).forward is not nn.Embedding.forward:
        return False
    return not module.sparse and module.max_norm is None and list(module._parameters) == ["weight"]


def routed_keys(modules: Iterable[nn.Module], eligible: Callable[[nn.Parameter], bool]) -> dict[int, frozenset[str]]:
    """For each module (by ``id``), the names of its own parameters whose uses are routed.

    A parameter is routed when it is ``eligible`` and either registered in more than one of ``modules`` (tied)
    or owned by a module whose backward reads no parameter values. Modules with nothing routed are omitted.
    """
    modules = list(modules)
    owners: dict[int, int] = {}
    for module in modules:
        for param in {id(p): p for p in dict.values(module._parameters) if p is not None}.values():
            owners[id(param)] = owners.get(id(param), 0) + 1
    keys: dict[int, frozenset[str]] = {}
    for module in modules:
        quiet = backward_reads_no_params(module)
        names = frozenset(
            name
            for name, p in dict.items(module._parameters)
            if p is not None and eligible(p) and (quiet or owners[id(p)] > 1)
        )
        if names:
            keys[id(module)] = names
    return keys


__all__ = ["GradSink", "backward_reads_no_params", "routed_keys", "routed_use"]
