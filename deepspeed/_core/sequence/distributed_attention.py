"""Ulysses attention for models that call attention on ``[seq, batch, heads, dim]`` or ``[batch, seq, heads, dim]``.

This is the layer-level form of the exchange in :mod:`deepspeed._core.sequence.ulysses` (which hooks Hugging Face
attention): a model whose ranks each hold ``S / P`` consecutive tokens wraps its attention kernel in
:class:`DistributedAttention`, which

1. turns q, k and v from "my tokens, all heads" into "all tokens, my ``H / P`` heads" (heads scattered, sequence
   gathered; rank ``r``'s tokens land at block ``r`` of the sequence),
2. optionally applies rotary position embeddings to q and k (now that every token is present),
3. runs the local attention on whole sequences for its heads,
4. turns the result back into "my tokens, all heads" (sequence scattered, heads gathered).

:class:`SeqAllToAll` is one such exchange as an autograd function; its backward is the opposite exchange.
``scatter_idx`` < 2 means "scatter the sequence, gather the heads", otherwise "scatter the heads, gather the
sequence"; ``batch_dim_idx`` (0 or 1) says where the batch is, the sequence being the other of dims 0 and 1 and
the heads dim 2.

Uneven heads: when the group size ``P`` does not divide the head count ``H``, rank ``r`` holds a consecutive block
of ``ceil(H / P)`` heads if ``r < H % P`` and ``floor(H / P)`` otherwise (the first ranks take the extra heads), as
upstream does; this needs ``H > P``. With fewer key/value heads ``K`` than query heads (grouped-query attention,
``H`` a multiple of ``K``), :class:`DistributedAttention` splits the ``K`` key/value heads that way and gives each
rank the ``H / K`` query heads of each of its key/value heads, so every query head stays with the key/value head
it reads; this needs ``K >= P`` (otherwise repeat the key/value heads first). Head counts ``P`` divides take the
even exchange, unchanged. A standalone :class:`SeqAllToAll` that gathers heads first agrees with the other ranks
on how many heads each holds (one small all-gather), since those counts may differ.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import gather_list
from deepspeed._core.sequence.exchange import blocks_all_to_all, dim_zero_all_to_all
from deepspeed._foundation.logging import logger

HEAD_DIM = 2


def _seq_dim(batch_dim_idx: int) -> int:
    if batch_dim_idx not in (0, 1):
        raise ValueError(
            f"batch_dim_idx must be 0 ([batch, seq, heads, dim]) or 1 ([seq, batch, heads, dim]); got {batch_dim_idx}"
        )
    return 1 - batch_dim_idx


def _split(x: torch.Tensor, dim: int, parts: int, what: str) -> torch.Tensor:
    """``x`` cut into ``parts`` equal blocks along ``dim``, stacked on a new dim 0 (block ``j`` goes to rank ``j``)."""
    if x.shape[dim] % parts:
        raise ValueError(
            f"the number of {what} ({x.shape[dim]}) must be divisible by the sequence parallel size ({parts})"
        )
    return torch.stack(x.chunk(parts, dim=dim))


def head_split(heads: int, size: int, kv_heads: int | None = None) -> tuple[int, ...]:
    """How many of ``heads`` heads each of ``size`` ranks holds, in rank order (each a consecutive block).

    The ``kv_heads`` groups (default: every head its own group) are dealt out ``floor`` or ``ceil`` of
    ``groups / size`` per rank, the first ``groups % size`` ranks taking one more; a rank holds all
    ``heads / kv_heads`` heads of each of its groups.
    """
    groups = heads if kv_heads is None else kv_heads
    per_group = heads // groups
    return tuple((groups // size + (rank < groups % size)) * per_group for rank in range(size))


def _shape_with_heads(shape: torch.Size, heads: int) -> torch.Size:
    return torch.Size((*shape[:HEAD_DIM], heads, *shape[HEAD_DIM + 1 :]))


def _uneven_all_to_all(x: torch.Tensor, group: Any, scatter_idx: int, seq_dim: int, split: tuple) -> torch.Tensor:
    """The exchange when ranks hold different numbers of heads: rank ``r`` holds ``split[r]`` of them."""
    size, rank = len(split), dist.get_rank(group=group)
    if scatter_idx < 2:
        if x.shape[HEAD_DIM] != split[rank]:
            raise ValueError(f"rank {rank} holds {x.shape[HEAD_DIM]} attention heads; the head split is {split}")
        blocks = list(_split(x, seq_dim, size, "tokens").unbind(0))
        shapes = [_shape_with_heads(blocks[0].shape, heads) for heads in split]
        return torch.cat(blocks_all_to_all(group, blocks, shapes), dim=HEAD_DIM)
    if x.shape[HEAD_DIM] != sum(split):
        raise ValueError(f"{x.shape[HEAD_DIM]} attention heads cannot be split as {split}")
    blocks = list(x.split(list(split), dim=HEAD_DIM))
    shapes = [_shape_with_heads(x.shape, split[rank])] * size
    return torch.cat(blocks_all_to_all(group, blocks, shapes), dim=seq_dim)


def seq_all_to_all(
    x: torch.Tensor, group: Any, scatter_idx: int, batch_dim_idx: int, split: tuple | None = None
) -> torch.Tensor:
    """One exchange (no autograd of its own): see the module docstring for the layout.

    ``split`` gives the heads each rank holds on the heads-scattered side when they differ; ``None`` means
    every rank holds the same number.
    """
    if x.dim() != 4:
        raise ValueError(f"sequence all-to-all expects a 4-D [.., .., heads, dim] tensor; got shape {tuple(x.shape)}")
    seq_dim = _seq_dim(batch_dim_idx)
    if split is not None and len(set(split)) > 1:
        return _uneven_all_to_all(x, group, scatter_idx, seq_dim, split)
    size = dist.get_world_size(group=group)
    if scatter_idx < 2:
        sent, gather_dim = _split(x, seq_dim, size, "tokens"), HEAD_DIM
    else:
        sent, gather_dim = _split(x, HEAD_DIM, size, "attention heads"), seq_dim
    received = dim_zero_all_to_all(group, sent)  # received[r]: rank r's block
    return torch.cat(received.unbind(0), dim=gather_dim)


def _plain_split(heads: int, size: int) -> tuple | None:
    """The split of ``heads`` scattered over ``size`` ranks (``None``: even), refusing fewer heads than ranks."""
    if heads % size == 0:
        return None
    if heads < size:
        raise ValueError(
            f"the number of attention heads ({heads}) must be divisible by the sequence parallel size ({size}) "
            "or larger than it"
        )
    return head_split(heads, size)


def _agreed_split(x: torch.Tensor, group: Any) -> tuple | None:
    """The heads every rank holds before heads are gathered, from one all-gather of the counts (``None``: even)."""
    size = dist.get_world_size(group=group)
    mine = torch.tensor([x.shape[HEAD_DIM]], dtype=torch.int64, device=x.device)
    counts = [torch.empty_like(mine) for _ in range(size)]
    gather_list(counts, mine, group)
    split = tuple(int(c.item()) for c in counts)
    return None if len(set(split)) == 1 else split


def _standalone_split(x: torch.Tensor, group: Any, scatter_idx: int) -> tuple | None:
    """The head split of an exchange called on its own: worked out from ``x`` when heads are scattered, agreed on
    with the other ranks when they are gathered (each rank's count is all it knows then)."""
    if x.dim() != 4:
        raise ValueError(f"sequence all-to-all expects a 4-D [.., .., heads, dim] tensor; got shape {tuple(x.shape)}")
    if scatter_idx < 2:
        return _agreed_split(x, group)
    return _plain_split(x.shape[HEAD_DIM], dist.get_world_size(group=group))


def single_all_to_all(
    input: torch.Tensor,
    scatter_idx: int,
    gather_idx: int,
    batch_dim_idx: int,
    group: Any,
    async_op: bool = False,
    handle: Any = None,
    type: Any = None,
) -> torch.Tensor:
    """One exchange without autograd, upstream's signature; uneven head counts are spread as in the module docstring.

    ``handle`` and ``type`` belong to upstream's overlapped exchange and are not used; ``async_op=True`` (that
    overlap) is refused, since the exchange here always completes before it returns.
    """
    if async_op:
        raise ValueError("single_all_to_all: async_op=True is not supported; the exchange completes before returning")
    split = _standalone_split(input, group, scatter_idx)
    return seq_all_to_all(input, group, scatter_idx, batch_dim_idx, split)


def uneven_heads_all2all(
    input: torch.Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int, group: Any
) -> torch.Tensor:
    """Upstream's exchange for head counts the group size does not divide: :func:`single_all_to_all` handles
    those (and even ones) alike."""
    return single_all_to_all(input, scatter_idx, gather_idx, batch_dim_idx, group)


class SplitAllToAll(torch.autograd.Function):
    """:func:`seq_all_to_all` with a known head ``split`` as an autograd function (backward: the opposite one)."""

    @staticmethod
    def forward(
        ctx: Any, group: Any, x: torch.Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int, split: Any
    ) -> torch.Tensor:
        ctx.args = (group, gather_idx, scatter_idx, batch_dim_idx, split)
        return seq_all_to_all(x, group, scatter_idx, batch_dim_idx, split)

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple:
        # The adjoint of an exchange is the opposite exchange: scatter what was gathered, gather what was scattered.
        group, scatter_idx, gather_idx, batch_dim_idx, split = ctx.args
        grad = SplitAllToAll.apply(group, grad_output[0], scatter_idx, gather_idx, batch_dim_idx, split)
        return (None, grad, None, None, None, None)


class SeqAllToAll(torch.autograd.Function):
    """Differentiable sequence/heads exchange, with upstream's ``_SeqAllToAll.apply`` arguments.

    Heads the group size does not divide are spread unevenly (see the module docstring). ``stream``, ``handle``,
    ``type`` and ``is_fwd`` are upstream's communication-overlap plumbing; the exchange here always completes
    before it returns (same values), so they are accepted and not used.
    """

    @staticmethod
    def forward(
        ctx: Any,
        group: Any,
        input: torch.Tensor,
        scatter_idx: int,
        gather_idx: int,
        batch_dim_idx: int,
        stream: Any = None,
        handle: Any = None,
        type: Any = None,
        is_fwd: bool = True,
    ) -> torch.Tensor:
        split = _standalone_split(input, group, scatter_idx)
        ctx.args = (group, gather_idx, scatter_idx, batch_dim_idx, split)
        return seq_all_to_all(input, group, scatter_idx, batch_dim_idx, split)

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple:
        group, scatter_idx, gather_idx, batch_dim_idx, split = ctx.args
        grad = SplitAllToAll.apply(group, grad_output[0], scatter_idx, gather_idx, batch_dim_idx, split)
        return (None, grad, None, None, None, None, None, None, None)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on the first ``freqs_cos.shape[-1]`` features of ``t``; the rest pass through."""
    rot = freqs_cos.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    rotated = head * freqs_cos + _rotate_half(head) * freqs_sin
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


def _attention_splits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, size: int) -> tuple:
    """The query and key/value head splits (``None``: even), refused before any exchange when the heads cannot be
    spread (local checks: every rank raises alike)."""
    heads, kv_heads = query.shape[HEAD_DIM], key.shape[HEAD_DIM]
    if heads % size == 0 and kv_heads % size == 0:
        return None, None
    if value.shape[HEAD_DIM] != kv_heads:
        problem = f"the value heads ({value.shape[HEAD_DIM]}) must equal the key heads"
    elif heads % kv_heads:
        problem = "the query heads must be a multiple of the key/value heads"
    elif kv_heads < size:
        problem = "the key/value heads must be at least as many as the ranks (repeat them to a multiple of it first)"
    else:
        return head_split(heads, size, kv_heads), head_split(kv_heads, size)
    raise ValueError(
        f"DistributedAttention splits heads over the sequence parallel size ({size}): with query heads ({heads}) "
        f"and key/value heads ({kv_heads}) not both divisible by it, {problem}"
    )


class DistributedAttention(torch.nn.Module):
    """Sequence-parallel wrapper of a local attention over ``sequence_process_group`` (upstream's signature).

    Args:
        local_attention: called as ``local_attention(q, k, v, *args, **kwargs)`` on whole sequences and this
            rank's heads, in the layout given by ``batch_dim_idx``.
        sequence_process_group: the ranks holding the shards of the same sequences.
        scatter_idx, gather_idx: the exchange applied to q/k/v (defaults: scatter heads, gather the sequence);
            the output goes through the opposite one.
        sp_stream: upstream overlaps the exchanges with compute on this stream; here they run in order (same
            values) and passing one logs a note once.
    """

    _warned_stream = False

    def __init__(
        self,
        local_attention: Any,
        sequence_process_group: Any,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
    ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.sp_stream = sp_stream
        self.sp_overlap_comm = False
        self.overlap_handles = None
        if sp_stream is not None and not DistributedAttention._warned_stream:
            DistributedAttention._warned_stream = True
            logger.warning("DistributedAttention: sp_stream is accepted, but the exchanges are not overlapped")

    def layer_sync(self, layer: Any) -> None:
        """Upstream waits here for an overlapped exchange; the exchanges here are complete when they return."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch_dim_idx: int,
        rotary_pos_emb: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention of this rank's tokens against the whole sequence; output in the inputs' layout."""
        q_split = kv_split = None
        if self.scatter_idx >= 2:
            q_split, kv_split = _attention_splits(query, key, value, dist.get_world_size(group=self.spg))
        q, k, v = (
            self._exchange(t, self.scatter_idx, self.gather_idx, batch_dim_idx, split)
            for t, split in ((query, q_split), (key, kv_split), (value, kv_split))
        )
        if rotary_pos_emb is not None:
            # The frequencies come with dims 0 and 1 the other way round from the exchanged q and k.
            cos, sin = (f.permute(1, 0, 2, 3) for f in rotary_pos_emb[:2])
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return self._exchange(context, self.gather_idx, self.scatter_idx, batch_dim_idx, q_split)

    def _exchange(self, t: torch.Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int, split: Any) -> Any:
        if self.scatter_idx < 2:
            # Inputs already split by heads: each exchange works its head counts out itself.
            return SeqAllToAll.apply(self.spg, t, scatter_idx, gather_idx, batch_dim_idx)
        return SplitAllToAll.apply(self.spg, t, scatter_idx, gather_idx, batch_dim_idx, split)
