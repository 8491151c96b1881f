"""The sequence-parallel exchange: a differentiable all-to-all along dimension 0.

``dim_zero_all_to_all(group, x)`` with ``x.shape[0] == group size`` sends slice ``x[j]`` to rank ``j`` and returns
the slices received, ``out[j]`` coming from rank ``j``. The exchange is its own adjoint (what rank ``i`` sent to rank
``j`` comes back from ``j`` to ``i``), so its backward is the same exchange applied to the incoming gradient.

It is a torch custom op (``torch.ops.deepspeed.dim_zero_all_to_all``) taking the group by name, so compiled graphs
can hold it; :func:`register_all_to_all_group` makes a group known under its name first.

:func:`blocks_all_to_all` is the plain (not differentiable) exchange of blocks whose sizes differ by rank, for
head counts the group size does not divide.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import exchange, exchange_split

_GROUPS: dict[str, Any] = {}


def register_all_to_all_group(group: Any) -> str:
    """Make ``group`` usable by the exchange op; returns the name the op refers to it by."""
    name = str(group.group_name)
    _GROUPS[name] = group
    return name


def _group_named(name: str) -> Any:
    if name not in _GROUPS:
        raise KeyError(f"process group {name!r} was not registered with register_all_to_all_group")
    return _GROUPS[name]


@torch.library.custom_op("deepspeed::dim_zero_all_to_all", mutates_args=())
def _dim_zero_all_to_all_op(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    group = _group_named(group_name)
    size = dist.get_world_size(group=group)
    if tensor.shape[0] != size:
        raise ValueError(f"dim_zero_all_to_all: dimension 0 ({tensor.shape[0]}) must equal the group size ({size})")
    source = tensor.contiguous()
    out = torch.empty_like(source)
    exchange(out, source, group)
    return out


@_dim_zero_all_to_all_op.register_fake
def _(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.group_name = inputs[1]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return _dim_zero_all_to_all_op(grad, ctx.group_name), None


_dim_zero_all_to_all_op.register_autograd(_backward, setup_context=_setup_context)


def dim_zero_all_to_all(group: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Differentiable all-to-all of ``tensor``'s dimension-0 slices over ``group`` (registered on first use)."""
    name = str(group.group_name)
    if name not in _GROUPS:
        register_all_to_all_group(group)
    return _dim_zero_all_to_all_op(tensor, name)


def blocks_all_to_all(group: Any, blocks: list[torch.Tensor], shapes: list[torch.Size]) -> list[torch.Tensor]:
    """All-to-all of blocks that may differ in size from rank to rank (no autograd of its own).

    ``blocks[j]`` goes to rank ``j``; the result's ``r``-th tensor, of shape ``shapes[r]``, is what rank ``r`` sent
    here. Every block travels once, packed back to back, so nothing is padded to the largest block.
    """
    sent = torch.cat([b.reshape(-1) for b in blocks])
    received_sizes = [shape.numel() for shape in shapes]
    received = sent.new_empty(sum(received_sizes))
    exchange_split(received, sent, received_sizes, [b.numel() for b in blocks], group)
    return [piece.view(shape) for piece, shape in zip(received.split(received_sizes), shapes, strict=True)]
