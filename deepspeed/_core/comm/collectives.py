"""Batched collectives with typed split-phase results: parameter all-gathers and gradient reductions.

The parameter, gradient and optimizer rooms never call ``dist.*`` collectives themselves. A gather calls
:func:`start_all_gather` (issue, keep the handle) and later :func:`finish_all_gather` (wait, copy out). Gradient
buckets are reduced the same way: one of
:func:`start_all_reduce`, :func:`start_reduce_to_owners` or :func:`start_reduce_scatter` issues the asynchronous
collective and returns a :class:`ReduceResult`; :func:`finish_reduce` waits for it. The blocking ones (a squared
norm's sum, the post-step all-gather of partitions, an agreed flag, a tied weight's broadcast, the MoE exchange)
are :func:`sum_over`, :func:`gather_rows`, :func:`max_over`, :func:`broadcast_tensor`, :func:`exchange` and
:func:`exchange_split` (the same with a different amount to and from each rank).
Point-to-point transfers live with the pipeline's transport (``pipe/p2p.py``) and object collectives with the
control-plane checks that agree on Python values. The flat buffer's lifetime rules are in [Note: streams-flat]
(``docs/design/streams.md``): it comes from the pool of the stream that frees it, and is dropped only once that
stream is ordered behind the copy-out that last read it (the compute stream under lean release).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.comm.codec import IDENTITY_CODEC, ShardCodec
from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.comm.streams import StreamRole, StreamSet
from deepspeed._core.layout.shards import Range, Stage3GroupLayout, plan_stage3_group
from deepspeed.accelerator import get_accelerator


@dataclass
class AllGatherResult:
    """An issued all-gather: its flat buffer, the per-rank layout, and what to wait on.

    Attributes:
        flat: ``[world_size * layout.rank_numel]`` wire-dtype buffer; rank ``r``'s shards sit back to back in
            row ``r`` of ``flat.view(world_size, rank_numel)``.
        layout: where each parameter's shard sits inside a row.
        event: recorded on the all-gather stream right after the collective was queued.
        work: the asynchronous collective handle (``None`` for a single-rank group).
    """

    flat: torch.Tensor | None
    layout: Stage3GroupLayout
    event: Any
    work: Any
    world_size: int
    sources: list[torch.Tensor] | None = None  # single-rank groups: the shards themselves, no flat buffer

    def rows(self) -> torch.Tensor:
        """``flat`` as ``[world_size, rank_numel]``."""
        assert self.flat is not None, "a single-rank gather has no flat buffer"
        return self.flat.view(self.world_size, self.layout.rank_numel)


@functools.lru_cache(maxsize=4096)
def _gather_layout(numels: tuple[int, ...], world_size: int) -> Stage3GroupLayout:
    """The per-rank layout of one gather (pure data, frozen): a unit gathers the same parameters every time, so
    it is planned once, not at every call."""
    return plan_stage3_group([(n,) for n in numels], world_size)


def start_all_gather(
    shards: Sequence[torch.Tensor],
    numels: Sequence[int],
    group: ShardGroup,
    streams: StreamSet,
    codec: ShardCodec,
    device: torch.device,
    alloc_role: StreamRole = StreamRole.ALL_GATHER,
    dtype: torch.dtype | None = None,
) -> AllGatherResult:
    """Copy the local ``shards`` into one buffer on ``device`` and issue one all-gather of it on the all-gather
    stream.

    ``numels`` are the full element counts of the parameters the shards belong to (same order). All shards must
    share one device; host shards (offloaded) are copied in asynchronously. ``dtype`` is the parameters' working
    dtype (default: the first shard's); a shard in a wider dtype (a view of the fp32 master) is converted on its
    way into the buffer, so the collective never carries more than the working dtype. ``alloc_role`` names the
    stream whose allocator pool the flat buffer comes from ([Note: streams-flat]).
    """
    layout = _gather_layout(tuple(numels), group.world_size)
    wire = codec.wire_dtype(shards[0].dtype if dtype is None else dtype)
    if group.world_size == 1 and codec is IDENTITY_CODEC and all(s.device == device for s in shards):
        # One rank: each shard already holds its whole (padded) parameter, so the copy-out reads the shards
        # directly; a flat buffer would cost the unit's bytes once more (the S3 N=1 peak on the H200). The
        # copy-out converts a master-view shard to the output's working dtype.
        return AllGatherResult(None, layout, streams.record(StreamRole.COMPUTE), None, 1, sources=list(shards))
    with streams.use(alloc_role):
        flat = torch.empty(group.world_size * layout.rank_numel, dtype=wire, device=device)
    # Recorded after the allocation: the shards may just have been written on the compute stream (optimizer
    # step), and a block taken from the compute pool may still be read by compute work queued before now.
    ready = streams.record(StreamRole.COMPUTE)
    with streams.use(StreamRole.ALL_GATHER):
        streams.wait(StreamRole.ALL_GATHER, ready)
        local = flat.narrow(0, group.rank * layout.rank_numel, layout.rank_numel)
        for slot, shard in zip(layout.slots, shards, strict=False):
            if layout.rank_range(slot).size != shard.numel():
                raise ValueError(
                    f"shard {slot.index} has {shard.numel()} elements, layout expects {layout.rank_range(slot).size}"
                )
        codec.encode(shards, local)  # the windows tile the row in slot order
        work = None
        if group.world_size > 1:
            work = dist.all_gather_into_tensor(flat, local, group=group.handle, async_op=True)
        event = streams.record(StreamRole.ALL_GATHER)
    return AllGatherResult(flat, layout, event, work, group.world_size)


def finish_all_gather(
    result: AllGatherResult,
    outputs: Sequence[torch.Tensor],
    streams: StreamSet,
    copy_role: StreamRole,
    codec: ShardCodec,
) -> Any:
    """Wait for ``result`` and copy each parameter into its 1-D ``padded_numel`` output on ``copy_role``'s stream.

    Returns the event recorded on ``copy_role``'s stream after the copy-out: the flat buffer may be reused by
    the all-gather stream once that stream has waited on it. The compute stream is ordered after the copy-out.
    """
    with streams.use(copy_role):
        streams.wait(copy_role, result.event)
        if result.work is not None:
            result.work.wait()
        if result.sources is not None:
            _copy_sources(result.sources, outputs)
            done = streams.record(copy_role)
            if copy_role is not StreamRole.COMPUTE:
                streams.wait(StreamRole.COMPUTE, done)
            return done
        ws, layout = result.world_size, result.layout
        codec.decode(
            result.rows(),
            [out.view(ws, layout.rank_range(slot).size) for slot, out in zip(layout.slots, outputs, strict=False)],
        )
        done = streams.record(copy_role)
    if copy_role is not StreamRole.COMPUTE:
        streams.wait(StreamRole.COMPUTE, done)
    return done


def _copy_sources(sources: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """One-rank copy-out: one multi-tensor copy per source dtype, converting on the way (an fp32 master view
    into its 16-bit output), as FSDP2's foreach copies do; a gathered tensor that is its shard needs no copy."""
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for src, out in zip(sources, outputs, strict=False):
        if src.data_ptr() != out.data_ptr():
            srcs, outs = by_dtype.setdefault(src.dtype, ([], []))
            srcs.append(src.view(-1))
            outs.append(out.view(-1))
    for srcs, outs in by_dtype.values():
        if len(srcs) == 1:
            outs[0].copy_(srcs[0])
        else:
            torch._foreach_copy_(outs, srcs)


def broadcast_from(tensor: torch.Tensor, group: ShardGroup, src_group_rank: int) -> None:
    """Overwrite ``tensor`` on every rank of ``group`` with member ``src_group_rank``'s values (in place)."""
    if group.world_size == 1:
        return
    if tensor.is_contiguous():
        dist.broadcast(tensor, src=group.global_rank(src_group_rank), group=group.handle)
        return
    staging = tensor.contiguous()
    dist.broadcast(staging, src=group.global_rank(src_group_rank), group=group.handle)
    tensor.copy_(staging)


@dataclass
class ReduceResult:
    """An issued gradient reduction.

    Attributes:
        reduced: where the reduced values land: the input itself (all-reduce, reduce to owners: each owner's
            slice of it) or a new row-sized output (reduce-scatter).
        works: the asynchronous collective handles, waited for in order by :func:`finish_reduce`.
    """

    reduced: torch.Tensor
    works: list[Any]


def start_all_reduce(data: torch.Tensor, group: Any) -> ReduceResult:
    """Issue an asynchronous sum of ``data`` over ``group`` (in place: every rank gets the full sum)."""
    return ReduceResult(data, [dist.all_reduce(data, group=group, async_op=True)])


def start_reduce_to_owners(data: torch.Tensor, pieces: Sequence[tuple[int, Range]], group: Any) -> ReduceResult:
    """Issue one asynchronous reduce per ``(group rank, range of data)`` piece: the owner gets that range's sum."""
    works = []
    for owner, local in pieces:
        dst = dist.get_global_rank(group, owner) if group is not None else owner
        works.append(dist.reduce(data[local.as_slice()], dst=dst, group=group, async_op=True))
    return ReduceResult(data, works)


def start_reduce_scatter(rows: torch.Tensor, group: Any) -> ReduceResult:
    """Issue an asynchronous reduce-scatter of the ``(world, width)`` ``rows``: rank ``r`` gets row ``r`` summed
    over ranks, in a new ``width``-element output. ``rows`` is only read (a routed gradient may be its storage)."""
    output = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
    work = dist.reduce_scatter_tensor(output, rows.view(-1), group=group, async_op=True)
    return ReduceResult(output, [work])


_HOST_BACKENDS = frozenset({"gloo", "mpi", "fake"})
"""Backends that reduce host tensors; a composite one (``"cpu:gloo,cuda:nccl"``) names its host part."""


def carries_host_tensors(backend: str) -> bool:
    """Whether a process group of ``backend`` takes host (CPU) tensors; NCCL and its kin take device ones only."""
    return backend in _HOST_BACKENDS or "cpu:" in backend


def _on_wire(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` itself where ``group``'s backend takes it, else a copy on the accelerator.

    A host-resident statistic (ZenFlow's column norms of an offloaded gradient, say) must still be summed over an
    NCCL group: it travels through the device and comes back, the only cost a small copy each way."""
    if tensor.device.type != "cpu" or carries_host_tensors(dist.get_backend(group)):
        return tensor
    return tensor.to(get_accelerator().current_device_name(), copy=True)


def _blocking(tensor: torch.Tensor, group: Any, collective: Callable[[torch.Tensor], Any]) -> None:
    wire = _on_wire(tensor, group)
    collective(wire)
    if wire is not tensor:
        tensor.copy_(wire)


def sum_over(tensor: torch.Tensor, group: Any) -> None:
    """Blocking in-place sum of ``tensor`` over ``group`` (``None``: the default group), e.g. a squared norm."""
    _blocking(tensor, group, lambda wire: dist.all_reduce(wire, group=group))


def max_over(tensor: torch.Tensor, group: Any) -> None:
    """Blocking in-place maximum of ``tensor`` over ``group`` (an agreed flag or capacity)."""
    _blocking(tensor, group, lambda wire: dist.all_reduce(wire, op=dist.ReduceOp.MAX, group=group))


def broadcast_tensor(tensor: torch.Tensor, src: int, group: Any) -> None:
    """Blocking: ``tensor`` on every rank of ``group`` becomes global rank ``src``'s (in place)."""
    _blocking(tensor, group, lambda wire: dist.broadcast(wire, src=src, group=group))


def exchange(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """Blocking equal-split all-to-all along dim 0: chunk ``r`` of ``input`` goes to rank ``r``, and ``output``'s
    chunk ``r`` comes from rank ``r``."""
    dist.all_to_all_single(output, input, group=group)


def exchange_split(
    output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any
) -> None:
    """Blocking all-to-all along dim 0 with per-rank amounts: the ``input_splits[r]`` rows after the first ``r``
    pieces of ``input`` go to rank ``r``, and ``output``'s ``r``-th piece (``output_splits[r]`` rows) comes from it."""
    dist.all_to_all_single(output, input, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group)


def gather_rows(gathered: torch.Tensor, mine: torch.Tensor, group: Any) -> None:
    """Blocking all-gather: rank ``r``'s ``mine`` lands in row ``r`` of ``gathered`` (``world * mine.numel()``)."""
    dist.all_gather_into_tensor(gathered, mine, group=group)


def gather_list(parts: list[torch.Tensor], mine: torch.Tensor, group: Any) -> None:
    """Blocking all-gather into a list: ``parts[r]`` becomes rank ``r``'s ``mine`` (shapes may differ by rank)."""
    dist.all_gather(parts, mine, group=group)


def finish_reduce(result: ReduceResult) -> torch.Tensor:
    """Wait for every handle of ``result``; returns :attr:`ReduceResult.reduced`."""
    for work in result.works:
        work.wait()
    return result.reduced
