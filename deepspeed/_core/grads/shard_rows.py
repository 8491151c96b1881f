"""ZeRO-3 gradient buckets: full gradients in, rank-major rows reduce-scattered, each rank's shards out.

The parameter manager hands over each full gradient while its parameter is still gathered; the optimizer
adds it to the shared :class:`~deepspeed._core.grads.reducer.GradReducer` in arrival order
([Note: launch order]) and, under lean release, drops ``param.grad`` at once, so the bucket holds the only
reference until its staging copy. This module is the reducer's
:class:`~deepspeed._core.grads.reducer.BucketIO` for that case.

[Note: zero3-grads] A bucket of parameters p_1..p_k with per-rank shard sizes s_i is a ``(world, S)``
staging tensor, ``S = sum(s_i)``; row ``r`` holds, for each p_i, the ``r``-th ``s_i`` slice of its
zero-padded flattened gradient. ``reduce_scatter_tensor`` over the rows leaves rank ``r`` with row ``r``
summed over ranks: exactly its shards of every p_i, back to back.

With ``FoldOrder.CONTIGUOUS`` (``lean_unit_grad_reduce``) the columns follow the order of the shards in the group's
flat shard rather than arrival order (a backward hands a unit's gradients over roughly in reverse): a unit's
parameters sit next to each other there, so their reduced pieces form one contiguous run, folded with one call
(one add kernel per accumulator chunk it touches) instead of one per parameter.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deepspeed._core.grads.reducer import Bucket
from deepspeed._core.grads.scaling import ReduceScaling
from deepspeed._core.layout.shards import Range
from deepspeed._core.params.param import ZeroParam

_CHUNK_CAT = getattr(torch, "_chunk_cat", None)  # torch >= 2.4; older releases copy parameter by parameter


class GradRelease(enum.Enum):
    """What happens to a full gradient once it is staged: ``EAGER`` (lean, ``lean_eager_grad_release``): the
    bucket owned the last reference and it goes; ``ZEROED`` (upstream behaviour, for A/B): the buffer stays
    allocated, zeroed, until the step ends."""

    EAGER = "eager"
    ZEROED = "zeroed"


class FoldOrder(enum.Enum):
    """How a bucket's rows are laid out and folded: ``PER_ENTRY`` in bucket order, each gradient's piece folded on
    its own; ``CONTIGUOUS`` in shard order, adjacent shards folded as one piece ([Note: zero3-grads]), only for a
    ``fold`` that adds wherever it is given (not the per-region offload and parking paths)."""

    PER_ENTRY = "per_entry"
    CONTIGUOUS = "contiguous"


@dataclass
class RowEntry:
    """One gradient waiting in a bucket: the tensor, its parameter and where its shard sits in the group."""

    grad: torch.Tensor
    state: ZeroParam
    group: int
    offset: int  # start of the state's shard inside the group's flat shard
    borrowed: bool  # a routed use's gradient, which autograd may share with another consumer


FoldInto = Callable[[int, int, torch.Tensor], None]
"""``fold(group index, offset in the group shard, reduced piece)``: where a reduced shard goes."""


class ShardRows:
    """Builds the ``(world, S)`` rows of a bucket and folds the reduced row into the group accumulators.

    Args:
        world_size: ranks the parameters are partitioned over.
        comm_dtype: wire dtype.
        scaling: pre/post factors (the one-rank fold applies both itself).
        release: what happens to a staged full gradient.
        fold: where each reduced piece goes.
        group: the data-parallel process group.
        order: how the rows are laid out and folded (:class:`FoldOrder`).
    """

    def __init__(
        self,
        world_size: int,
        comm_dtype: torch.dtype,
        scaling: ReduceScaling,
        release: GradRelease,
        fold: FoldInto,
        group: Any,
        order: FoldOrder = FoldOrder.PER_ENTRY,
    ) -> None:
        self.world_size = world_size
        self.comm_dtype = comm_dtype
        self.scaling = scaling
        self.release = release
        self.fold = fold
        self.group = group
        self.contiguous_folds = order is FoldOrder.CONTIGUOUS

    def wire(self, bucket: Bucket) -> torch.Tensor | None:
        """The bucket as ``(world, S)`` rows (``None`` with one rank: each gradient folded unreduced)."""
        if self.world_size == 1:
            self._fold_unreduced(bucket)
            return None
        entries: list[RowEntry] = bucket.entries
        width = sum(e.state.layout.partition_numel for e in entries)
        rows = self._single_entry_rows(bucket)
        if rows is not None:  # the gradient already is the (world, width) layout
            bucket.targets.append((entries[0].group, entries[0].offset, 0, width))
            entries.clear()
            return rows
        if self.contiguous_folds:
            entries.sort(key=lambda e: (e.group, e.offset))
        rows = torch.empty(self.world_size, width, dtype=self.comm_dtype, device=entries[0].grad.device)
        if _CHUNK_CAT is not None:
            # One kernel for the whole bucket: each flattened gradient is cut into ``world`` zero-padded chunks
            # of ceil(numel / world) elements (exactly the shard layout) and chunk r of every one lands in row r,
            # converted to the wire dtype (FSDP2's reduce-scatter copy-in).
            _CHUNK_CAT([e.grad.reshape(-1) for e in entries], 0, self.world_size, out=rows)
        col = 0
        for e in entries:
            size = e.state.layout.partition_numel
            if _CHUNK_CAT is None:
                flat = e.grad.reshape(-1).to(self.comm_dtype)
                flat = F.pad(flat, (0, e.state.layout.padded_numel - flat.numel())) if e.state.layout.padding else flat
                rows[:, col : col + size].copy_(flat.view(self.world_size, size))
            if self.release is GradRelease.ZEROED:
                e.grad.zero_()  # upstream-behaviour A/B: the buffer stays allocated until the step ends
            last = bucket.targets[-1] if bucket.targets else None
            if self.contiguous_folds and last is not None and last[0] == e.group and last[1] + last[3] == e.offset:
                bucket.targets[-1] = (e.group, last[1], last[2], last[3] + size)  # continues the previous run
            else:
                bucket.targets.append((e.group, e.offset, col, size))
            col += size
        entries.clear()  # drops the last references to the full gradients
        return rows

    def _single_entry_rows(self, bucket: Bucket) -> torch.Tensor | None:
        """The bucket's one gradient viewed as the ``(world, S)`` staging rows, when no copy is needed.

        A parameter larger than the bucket (a tied embedding) travels alone; with no padding and the wire dtype
        its flattened gradient's row ``r`` is already rank ``r``'s shard, and a staging copy would hold its
        bytes twice. Only under eager release, where the bucket owns an accumulated gradient; a routed one is
        only read (the reduce-scatter leaves its input alone: NCCL's contract, gloo's checked by
        ``tests/dist/test_comm.py``), so it qualifies unless pre-division would scale it in place.
        """
        if len(bucket.entries) != 1 or self.release is not GradRelease.EAGER:
            return None
        entry: RowEntry = bucket.entries[0]
        if entry.borrowed and self.scaling.pre != 1.0:
            return None  # pre-division scales in place; a routed gradient is not ours to change
        grad, layout = entry.grad, entry.state.layout
        if grad.dtype != self.comm_dtype or not grad.is_contiguous() or layout.padding:
            return None
        return grad.view(self.world_size, layout.partition_numel)

    def _fold_unreduced(self, bucket: Bucket) -> None:
        """One rank: the reduction is the identity, so each gradient folds straight into its accumulator.

        A staging row and an output would cost the bucket's bytes twice more; for the largest parameter
        (a tied embedding) that was most of ZeRO-3's excess over FSDP2 at world size 1 on the H200.
        """
        scale = self.scaling.pre * self.scaling.post
        for e in bucket.entries:
            piece = e.grad.reshape(-1).to(self.comm_dtype)
            if scale != 1.0:
                piece = piece * scale
            self.fold(e.group, e.offset, piece)
            if self.release is GradRelease.ZEROED:
                e.grad.zero_()
        bucket.entries.clear()

    def owners(self, bucket: Bucket) -> list[tuple[int, Range]]:
        """Not used: ZeRO-3 buckets are reduce-scattered."""
        raise NotImplementedError("ZeRO-3 buckets are reduce-scattered")

    def process_group(self, bucket: Bucket) -> Any:
        """The data-parallel group."""
        return self.group

    def kept(self, bucket: Bucket, reduced: torch.Tensor) -> torch.Tensor:
        """The whole reduced row is this rank's."""
        return reduced

    def deliver(self, bucket: Bucket, kept: torch.Tensor) -> None:
        """Fold each parameter's reduced shard into its group's accumulator."""
        for g, off, col, size in bucket.targets:
            self.fold(g, off, kept[col : col + size])
