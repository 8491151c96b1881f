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
the heads dim 2. Heads must be divisible by the group size here (upstream also spreads uneven head counts; that
is refused with an error naming the counts).
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.sequence.exchange import dim_zero_all_to_all
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


def seq_all_to_all(x: torch.Tensor, group: Any, scatter_idx: int, batch_dim_idx: int) -> torch.Tensor:
    """One exchange (no autograd of its own): see the module docstring for the layout."""
    if x.dim() != 4:
        raise ValueError(f"sequence all-to-all expects a 4-D [.., .., heads, dim] tensor; got shape {tuple(x.shape)}")
    seq_dim = _seq_dim(batch_dim_idx)
    size = dist.get_world_size(group=group)
    if scatter_idx < 2:
        sent, gather_dim = _split(x, seq_dim, size, "tokens"), HEAD_DIM
    else:
        sent, gather_dim = _split(x, HEAD_DIM, size, "attention heads"), seq_dim
    received = dim_zero_all_to_all(group, sent)  # received[r]: rank r's block
    return torch.cat(received.unbind(0), dim=gather_dim)


class SeqAllToAll(torch.autograd.Function):
    """Differentiable sequence/heads exchange, with upstream's ``_SeqAllToAll.apply`` arguments.

    ``stream``, ``handle``, ``type`` and ``is_fwd`` are upstream's communication-overlap plumbing; the exchange
    here always completes before it returns (same values), so they are accepted and not used.
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
        ctx.group, ctx.scatter_idx, ctx.gather_idx, ctx.batch_dim_idx = group, scatter_idx, gather_idx, batch_dim_idx
        return seq_all_to_all(input, group, scatter_idx, batch_dim_idx)

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple:
        # The adjoint of an exchange is the opposite exchange: scatter what was gathered, gather what was scattered.
        grad = SeqAllToAll.apply(ctx.group, grad_output[0], ctx.gather_idx, ctx.scatter_idx, ctx.batch_dim_idx)
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


def _check_heads(query: torch.Tensor, key: torch.Tensor, size: int) -> None:
    """Refuse head counts the exchange cannot split, before any exchange (local: every rank raises alike)."""
    heads, kv_heads = query.shape[HEAD_DIM], key.shape[HEAD_DIM]
    if heads % size or kv_heads % size:
        raise ValueError(
            f"DistributedAttention splits heads over the sequence parallel size ({size}): the query heads "
            f"({heads}) and key/value heads ({kv_heads}) must both be divisible by it (with fewer key/value heads, "
            "repeat them to a multiple of the size before the call)"
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
        if self.scatter_idx >= 2:
            _check_heads(query, key, dist.get_world_size(group=self.spg))
        q, k, v = (
            SeqAllToAll.apply(self.spg, t, self.scatter_idx, self.gather_idx, batch_dim_idx)
            for t in (query, key, value)
        )
        if rotary_pos_emb is not None:
            # The frequencies come with dims 0 and 1 the other way round from the exchanged q and k.
            cos, sin = (f.permute(1, 0, 2, 3) for f in rotary_pos_emb[:2])
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return SeqAllToAll.apply(self.spg, context, self.gather_idx, self.scatter_idx, batch_dim_idx)
