"""Tiled compute along the sequence: run a function on row tiles so its large intermediate never exists in full.

[Note: tiled recompute] Each of the three functions here runs its forward tile by tile without a graph and keeps
only its inputs. Backward recomputes one tile at a time with grad enabled and backpropagates it with the tile's
share of the incoming gradient, so at most one tile's intermediate (an MLP's ``[rows, intermediate]`` activations,
or a head's ``[rows, vocab]`` logits and their softmax) is alive at any moment.

:class:`TiledFusedLogitsLoss` follows the same rule although the loss is usually the last node of the graph. A
forward that backpropagated each tile at once would save one head matmul, but its weight gradients would be
computed against an implied incoming gradient of 1: scaling the returned loss (loss scaling, division by the
accumulation steps) would scale the input gradient and not the weights', and under ZeRO-3 the weight gradient
would arrive before the backward the engine reduces in has started, which loses the share of a head tied to the
input embedding. Recomputing in backward makes every gradient follow the incoming one and arrive inside the
backward.

[Note: ds_grad_is_ready] The ZeRO protocol of tiled functions: while tile ``i`` is backpropagated, every parameter in
``compute_params`` carries ``ds_grad_is_ready = (i == last tile)``. The post-accumulate-grad hooks of ZeRO-0/1/2/3
leave a gradient alone while the attribute is ``False``, so the tiles add up in ``param.grad`` and the parameter is
reduced once, with its whole gradient.

Tile counts: ``shards`` rows per tile is ``ceil(rows / shards)``; the last tile may be shorter and there may be
fewer tiles than ``shards`` (as ``torch.chunk``). ``shards="auto"`` sizes tiles from a byte budget (see
:func:`auto_shards`) and agrees on the largest count over all ranks, since under ZeRO-3 every tile gathers the
function's parameters and all ranks must gather the same number of times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import max_over
from deepspeed.accelerator import get_accelerator

AUTO = "auto"
REDUCTIONS = (None, "mean", "sum")
# A tile's working set is held to this share of the device memory free when the count is chosen: the rest is for
# the model states and the other activations, which are resident around the tiled call.
AUTO_FREE_MEMORY_FRACTION = 1 / 16
_MIN_AUTO_BUDGET = 1 << 24  # 16 MiB: below this a tile is too small to use the device well
_budget_override: int | None = None


# ---------------------------------------------------------------------- tile counts
def set_auto_tile_budget(nbytes: int | None) -> None:
    """Fix the per-tile byte budget ``shards="auto"`` uses (``None``: a share of free device memory)."""
    global _budget_override
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0):
        raise ValueError(f"auto tile budget must be a positive number of bytes or None, got {nbytes!r}")
    _budget_override = nbytes


def auto_tile_budget() -> int:
    """Bytes one tile's working set may take: the fixed budget, else a share of the free device memory."""
    if _budget_override is not None:
        return _budget_override
    free = int(get_accelerator().available_memory())
    return max(_MIN_AUTO_BUDGET, int(free * AUTO_FREE_MEMORY_FRACTION))


def auto_shards(rows: int, bytes_per_row: int) -> int:
    """Tiles needed to keep ``rows`` rows of ``bytes_per_row`` working bytes each within the budget.

    The count is the maximum over all ranks (one small all-reduce when a process group is up), so every rank runs
    the same number of tiles even when free memory or local lengths differ.
    """
    budget = auto_tile_budget()
    count = max(1, min(rows, math.ceil(rows * bytes_per_row / budget)))
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = get_accelerator().current_device_name()
        agreed = torch.tensor([count], dtype=torch.int64, device=device)
        max_over(agreed, None)
        count = int(agreed.item())
    return count


def resolve_shards(shards: Any, rows: int, bytes_per_row: Callable[[], int] | None, what: str) -> int:
    """A positive tile count from ``shards`` (an int or ``"auto"``); ``bytes_per_row`` prices ``"auto"``."""
    if shards == AUTO:
        if bytes_per_row is None:
            raise ValueError(f"{what}: shards='auto' is not supported here; pass a positive integer")
        return auto_shards(rows, bytes_per_row())
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"{what}: shards must be a positive integer or 'auto', got {shards!r}")
    return shards


def tile_bounds(length: int, shards: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each tile of ``length`` rows cut into ``shards`` pieces of ``ceil(length / shards)``."""
    if length == 0:
        return [(0, 0)]
    step = math.ceil(length / shards)
    return [(start, min(start + step, length)) for start in range(0, length, step)]


def trainable(compute_params: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
    """The grad-requiring parameters of ``compute_params`` (a list, a generator or ``None``)."""
    return [p for p in (compute_params or ()) if p.requires_grad]


def announce_tile(params: Sequence[torch.Tensor], index: int, count: int) -> None:
    """Set ``ds_grad_is_ready`` for tile ``index`` of ``count`` ([Note: ds_grad_is_ready])."""
    ready = index == count - 1
    for param in params:
        param.ds_grad_is_ready = ready  # type: ignore[attr-defined]  # ZeRO's per-parameter attribute


def _leaf(tensor: torch.Tensor, grad_wanted: bool) -> torch.Tensor:
    """A detached alias of ``tensor`` that collects its own gradient when ``grad_wanted``."""
    leaf = tensor.detach()
    leaf.requires_grad_(grad_wanted)
    return leaf


# ---------------------------------------------------------------------- generic tiled compute
class SequenceTiledCompute(torch.autograd.Function):
    """Call ``fn`` on sequence tiles of some keyword tensors (dimension 1) and join the outputs.

    Forward runs without a graph; backward recomputes tile by tile ([Note: tiled recompute]). Only the tensor named
    ``grad_requiring_tensor_key`` receives a gradient; parameters ``fn`` uses accumulate theirs as usual.
    """

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[..., Any],
        seqlen: int,
        shards: int,
        keys_to_shard: list[str],
        keys_to_pass: list[str],
        grad_requiring_tensor_key: str,
        compute_params: Iterable[torch.Tensor] | None,
        output_unshard_dimension: int,
        output_reduction: str | None,
        *args: Any,
    ) -> torch.Tensor:
        """See :func:`sequence_tiled_compute`."""
        if output_reduction not in REDUCTIONS:
            raise ValueError(f"output_reduction={output_reduction!r}: valid values are None, 'mean', 'sum'")
        names = list(keys_to_shard) + list(keys_to_pass)
        if grad_requiring_tensor_key not in names:
            raise ValueError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not one of {names}")
        count = resolve_shards(shards, seqlen, None, "sequence_tiled_compute")
        values = dict(zip(names, args, strict=True))
        tiles = tile_bounds(seqlen, count)
        with torch.no_grad():
            outputs = [fn(**_tile_kwargs(values, keys_to_shard, keys_to_pass, t)) for t in tiles]
        joined = _join(outputs, output_unshard_dimension)
        ctx.fn, ctx.tiles, ctx.names = fn, tiles, names
        ctx.keys = (list(keys_to_shard), list(keys_to_pass), grad_requiring_tensor_key)
        ctx.params = trainable(compute_params)
        ctx.dim, ctx.reduction, ctx.joined_shape = output_unshard_dimension, output_reduction, joined.shape
        ctx.sizes = [1 if output_unshard_dimension == 0 else o.shape[output_unshard_dimension] for o in outputs]
        tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.tensor_positions = tensor_positions
        ctx.save_for_backward(*(args[i] for i in tensor_positions))
        ctx.constants = [None if torch.is_tensor(a) else a for a in args]
        if output_reduction == "mean":
            return joined.mean()
        return joined.sum() if output_reduction == "sum" else joined

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        """Recompute each tile and backpropagate its share of ``grad`` into the grad-requiring tensor."""
        args = list(ctx.constants)
        for position, tensor in zip(ctx.tensor_positions, ctx.saved_tensors, strict=True):
            args[position] = tensor
        values = dict(zip(ctx.names, args, strict=True))
        keys_to_shard, keys_to_pass, key = ctx.keys
        target = values[key]
        wanted = ctx.needs_input_grad[9 + ctx.names.index(key)]
        full = _joined_grad(ctx, grad)
        target_grad = torch.zeros_like(target) if wanted else None
        offset = 0
        for index, (tile, size) in enumerate(zip(ctx.tiles, ctx.sizes, strict=True)):
            announce_tile(ctx.params, index, len(ctx.tiles))
            kwargs = _tile_kwargs(values, keys_to_shard, keys_to_pass, tile)
            sharded = key in keys_to_shard
            leaf = _leaf(kwargs[key] if sharded else target, wanted)
            kwargs[key] = leaf
            with torch.enable_grad():
                out = ctx.fn(**kwargs)
            piece = full[index] if ctx.dim == 0 else full.narrow(ctx.dim, offset, size)
            offset += size
            if out.requires_grad:
                torch.autograd.backward(out, piece.to(out.dtype))
            if target_grad is not None and leaf.grad is not None:
                (target_grad[:, tile[0] : tile[1]] if sharded else target_grad).add_(leaf.grad)
        grads: list[Any] = [None] * len(args)
        grads[ctx.names.index(key)] = target_grad
        return (None,) * 9 + tuple(grads)


def _tile_kwargs(
    values: dict[str, Any], keys_to_shard: Sequence[str], keys_to_pass: Sequence[str], tile: tuple[int, int]
) -> dict[str, Any]:
    kwargs = {k: values[k][:, tile[0] : tile[1]] for k in keys_to_shard}
    kwargs.update({k: values[k] for k in keys_to_pass})
    return kwargs


def _join(outputs: list[torch.Tensor], dim: int) -> torch.Tensor:
    # Dimension 0 means one scalar per tile (a loss): they are stacked, as the tiles have no batch dimension.
    if dim == 0:
        return torch.stack([o.reshape(()) for o in outputs])
    return torch.cat(outputs, dim=dim)


def _joined_grad(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of the joined (unreduced) output, from the gradient of what forward returned."""
    if ctx.reduction is None:
        return grad
    scale = 1.0 / math.prod(ctx.joined_shape) if ctx.reduction == "mean" else 1.0
    return (grad * scale).expand(ctx.joined_shape)


def sequence_tiled_compute(
    fn: Callable[..., Any],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, Any],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Iterable[torch.Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """Run ``fn(**tile_of(kwargs_to_shard), **kwargs_to_pass)`` over ``shards`` sequence tiles.

    Tensors in ``kwargs_to_shard`` are ``[batch, seqlen, ...]`` and are cut on dimension 1; outputs are joined on
    ``output_unshard_dimension`` (``0``: ``fn`` returns a scalar per tile, which are stacked) and reduced with
    ``output_reduction`` (``None``, ``"mean"`` or ``"sum"``). Only ``grad_requiring_tensor_key`` gets a gradient;
    ``compute_params`` are the parameters ``fn`` uses, for ZeRO ([Note: ds_grad_is_ready]).
    """
    keys_to_shard, keys_to_pass = list(kwargs_to_shard), list(kwargs_to_pass)
    return SequenceTiledCompute.apply(
        fn,
        seqlen,
        shards,
        keys_to_shard,
        keys_to_pass,
        grad_requiring_tensor_key,
        compute_params,
        output_unshard_dimension,
        output_reduction,
        *kwargs_to_shard.values(),
        *kwargs_to_pass.values(),
    )


# ---------------------------------------------------------------------- tiled MLP
def _mlp_row_bytes(module: Any, x: torch.Tensor) -> int:
    """Working bytes per row of an MLP: gate, up and their product at the intermediate width."""
    width = getattr(module, "intermediate_size", None) or 4 * x.shape[-1]
    return 3 * int(width) * x.element_size()


class TiledMLP(torch.autograd.Function):
    """``fn(self, x)`` over row tiles of ``x`` (dimension -2): the intermediate exists one tile at a time.

    ``apply(fn, self, x, shards, compute_params)``; ``shards`` may be ``"auto"`` (sized from ``self``'s
    ``intermediate_size`` and the tile budget). Only ``x`` receives a gradient from the function itself.
    """

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[[Any, torch.Tensor], torch.Tensor],
        self: Any,
        x: torch.Tensor,
        shards: int | str,
        compute_params: Iterable[torch.Tensor] | None,
    ) -> torch.Tensor:
        """Run ``fn`` on each tile without a graph and concatenate the results on dimension -2."""
        if x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be at least 2-D [..., seqlen, hidden], got shape {tuple(x.shape)}")
        rows = x.shape[-2]
        count = resolve_shards(shards, rows, lambda: _mlp_row_bytes(self, x), "TiledMLP")
        ctx.fn, ctx.module, ctx.count, ctx.params = fn, self, count, trainable(compute_params)
        ctx.save_for_backward(x)
        with torch.no_grad():
            pieces = [fn(self, x[..., a:b, :]) for a, b in tile_bounds(rows, count)]
        return torch.cat(pieces, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        """Recompute and backpropagate tile by tile over the flattened ``[rows, hidden]`` view."""
        (x,) = ctx.saved_tensors
        wanted = ctx.needs_input_grad[2]
        flat = x.detach().reshape(-1, x.shape[-1])
        grad_rows = grad.reshape(-1, grad.shape[-1])
        x_grad = torch.empty_like(flat) if wanted else None
        tiles = tile_bounds(flat.shape[0], ctx.count)
        for index, (a, b) in enumerate(tiles):
            announce_tile(ctx.params, index, len(tiles))
            leaf = _leaf(flat[a:b], wanted)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, leaf)
            if out.requires_grad:
                torch.autograd.backward(out, grad_rows[a:b])
            if x_grad is not None:
                x_grad[a:b].copy_(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
        return None, None, None if x_grad is None else x_grad.view_as(x), None, None


class AutogradComputeMLP(torch.autograd.Function):
    """``fn(self, x)`` run without a graph in forward and recomputed whole in backward (the untiled form)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[Any, torch.Tensor], torch.Tensor], self: Any, x: torch.Tensor) -> Any:
        """Run ``fn`` without keeping its activations."""
        ctx.fn, ctx.module = fn, self
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(self, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        """Recompute ``fn`` and backpropagate ``grad``."""
        (x,) = ctx.saved_tensors
        leaf = _leaf(x, ctx.needs_input_grad[2])
        with torch.enable_grad():
            out = ctx.fn(ctx.module, leaf)
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        return None, None, leaf.grad


# ---------------------------------------------------------------------- tiled logits + loss
def _check_loss_inputs(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, reduction: Any) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"TiledFusedLogitsLoss: output_reduction={reduction!r}: valid values are 'mean', 'sum'")
    if x.dim() < 2 or y.dim() < 2:
        raise ValueError(
            f"TiledFusedLogitsLoss: x and y must be at least 2-D [batch, seqlen, ...], got x {tuple(x.shape)}, "
            f"y {tuple(y.shape)}"
        )
    if x.shape[:2] != y.shape[:2]:
        raise ValueError(
            f"TiledFusedLogitsLoss: x and y must agree on [batch, seqlen]: {tuple(x.shape[:2])} != {tuple(y.shape[:2])}"
        )
    if mask is not None and (mask.dim() != 2 or mask.shape != x.shape[:2]):
        raise ValueError(
            f"TiledFusedLogitsLoss: mask must be 2-D {tuple(x.shape[:2])} like x's [batch, seqlen], got "
            f"{tuple(mask.shape)}"
        )


def _logits_row_bytes(self: Any, params: Sequence[torch.Tensor], x: torch.Tensor) -> int:
    """Working bytes per row of a head + loss: fp32 logits, their softmax and its gradient at vocabulary width."""
    config = getattr(self, "config", None)
    vocab = getattr(config, "vocab_size", None) or max((p.shape[0] for p in params if p.dim() == 2), default=0)
    if not vocab:
        raise ValueError(
            "TiledFusedLogitsLoss: shards='auto' needs the vocabulary size: give self a config.vocab_size or list "
            "the output weight in compute_params, or pass an integer shard count"
        )
    return 3 * int(vocab) * 4


class TiledFusedLogitsLoss(torch.autograd.Function):
    """``fn(self, x_tile, y_tile[, mask_tile])`` over row tiles of ``[batch, seqlen]``, reduced to one loss.

    ``apply(fn, self, x, y, mask, shards, compute_params, output_reduction)``: the loss is the mean or the sum of
    the tiles' outputs (with a mask or uneven tiles, ``"sum"`` of per-tile sums gives the exact token total). The
    logits exist one tile at a time, in forward and in backward ([Note: tiled recompute]); every gradient, the
    weights' included, is scaled by the gradient the returned loss receives.
    """

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        self: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int | str,
        compute_params: Iterable[torch.Tensor] | None,
        output_reduction: str,
    ) -> torch.Tensor:
        """Compute the tiles' losses without a graph and reduce them."""
        _check_loss_inputs(x, y, mask, output_reduction)
        params = trainable(compute_params)
        rows = x.shape[0] * x.shape[1]
        count = resolve_shards(shards, rows, lambda: _logits_row_bytes(self, params, x), "TiledFusedLogitsLoss")
        tiles = tile_bounds(rows, count)
        ctx.fn, ctx.module, ctx.params, ctx.tiles, ctx.reduction = fn, self, params, tiles, output_reduction
        ctx.has_mask = mask is not None
        ctx.save_for_backward(x, y, *(() if mask is None else (mask,)))
        with torch.no_grad():
            losses = [fn(self, *_loss_tile(x, y, mask, t)) for t in tiles]
        joined = torch.stack([loss.reshape(()) for loss in losses])
        return joined.mean() if output_reduction == "mean" else joined.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        """Recompute each tile and backpropagate its share of ``grad`` into ``x`` and the weights."""
        x, y, *rest = ctx.saved_tensors
        mask = rest[0] if ctx.has_mask else None
        wanted = ctx.needs_input_grad[2]
        share = grad / len(ctx.tiles) if ctx.reduction == "mean" else grad
        rows = x.shape[0] * x.shape[1]
        x_grad = torch.empty((rows, *x.shape[2:]), dtype=x.dtype, device=x.device) if wanted else None
        for index, tile in enumerate(ctx.tiles):
            announce_tile(ctx.params, index, len(ctx.tiles))
            x_tile, y_tile, *mask_tile = _loss_tile(x.detach(), y, mask, tile)
            leaf = _leaf(x_tile, wanted)
            with torch.enable_grad():
                loss = ctx.fn(ctx.module, leaf, y_tile, *mask_tile)
            if loss.requires_grad:
                torch.autograd.backward(loss, share.to(loss.dtype).reshape(loss.shape))
            if x_grad is not None:
                x_grad[tile[0] : tile[1]].copy_(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
        x_out = None if x_grad is None else x_grad.view(x.shape)
        return None, None, x_out, None, None, None, None, None


def _loss_tile(
    x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, tile: tuple[int, int]
) -> tuple[torch.Tensor, ...]:
    # Rows of the flattened [batch * seqlen] view: a tile may span samples, as the loss does not care.
    a, b = tile
    pieces = [x.reshape(-1, *x.shape[2:])[a:b], y.reshape(-1, *y.shape[2:])[a:b]]
    if mask is not None:
        pieces.append(mask.reshape(-1)[a:b])
    return tuple(pieces)
