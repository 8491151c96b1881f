"""ZeRO-1/2 gradients: from autograd into each rank's partition gradient, with the buffers' lifetime as a policy.

[Note: gradient lifetime]. Autograd hands each parameter's gradient to a
post-accumulate-grad hook. What happens next is the :class:`GradPath`:

- ``STAGE2_FREE`` (lean ZeRO-2): the gradient is copied into its bucket's communication buffer and
  ``param.grad`` is dropped at once; the bucket is reduced to the owning ranks as soon as it is complete and
  its buffer freed after the owner has folded its slice into the fp32 partition gradient. No full-size
  gradient outlives its bucket, whatever ``gradient_accumulation_steps`` is.
- ``STAGE2_RETAIN`` (upstream behaviour, for A/B): same reduction, but autograd's ``.grad`` buffers are
  kept (zeroed) until the step ends.
- ``STAGE1_ACCUMULATE`` (lean ZeRO-1): gradients are folded into one persistent full-size accumulator and
  dropped at once; the accumulator is reduced bucket by bucket during the boundary backward. A window of one
  micro-step (``gradient_accumulation_steps`` 1) has nothing to accumulate, so its backward takes the
  ``STAGE2_FREE`` route into the partition gradient instead: a full-size accumulator there cost 2 bytes per
  parameter at the simulated N=8 step peak (docs/benchmarks.md), where upstream's ZeRO-1 only stages
  buckets.
- ``STAGE1_AUTOGRAD`` (upstream behaviour, for A/B): gradients accumulate in ``.grad`` and are reduced from
  there at the boundary.

Buckets are planned once per run and scheduled by the shared
:class:`~deepspeed._core.grads.reducer.GradReducer` ([Note: launch order]); this module is its
:class:`~deepspeed._core.grads.reducer.BucketIO` for flat, partitioned groups.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed._core.comm.host_transfer import Fold, HostTransfers, slot_bytes_for
from deepspeed._core.grads.accumulator import FREED_CHUNKS, KEPT_CHUNKS, ChunkedGradShard
from deepspeed._core.grads.reducer import (
    Bucket,
    GradReducer,
    MicroStepKind,
    ReducePhase,
    ReducerConfig,
    plan_static,
)
from deepspeed._core.layout.shards import GroupLayout, Range


class GradPath(enum.Enum):
    """Where gradients go between autograd and the partition gradient (see module docstring)."""

    STAGE2_FREE = "stage2_free"
    STAGE2_RETAIN = "stage2_retain"
    STAGE1_ACCUMULATE = "stage1_accumulate"
    STAGE1_AUTOGRAD = "stage1_autograd"

    @staticmethod
    def select(stage: int, eager_release: bool) -> GradPath:
        """The path for a ZeRO stage (1 or 2) and the ``lean_eager_grad_release`` switch."""
        if stage >= 2:
            return GradPath.STAGE2_FREE if eager_release else GradPath.STAGE2_RETAIN
        return GradPath.STAGE1_ACCUMULATE if eager_release else GradPath.STAGE1_AUTOGRAD

    @property
    def reduces_every_micro_step(self) -> bool:
        """Stage 2 reduces each micro-batch's gradients; stage 1 only at the boundary."""
        return self in (GradPath.STAGE2_FREE, GradPath.STAGE2_RETAIN)


@dataclass
class GroupGrads:
    """The gradient-side record of one flat parameter group on this rank: layout, parameters, rank, and the
    group's gradient buffers as :class:`~deepspeed._core.grads.accumulator.ChunkedGradShard` s of one chunk each
    (so the step is handed each buffer's tensor itself, and the keep-storage policy is the shard's).
    """

    layout: GroupLayout
    params: list[torch.nn.Parameter]
    rank: int
    accum_dtype: torch.dtype
    # Offloaded: the host partition gradient's storage outlives its step and is zeroed for the next one
    # instead of being page-faulted in afresh ([Note: kept host chunks]).
    keep_storage: bool = False
    _partition: ChunkedGradShard | None = field(default=None, repr=False)  # this rank's partition
    _accumulator: ChunkedGradShard | None = field(default=None, repr=False)  # full padded group (lean stage 1)

    @property
    def partition(self) -> Range:
        """This rank's range of the flat group."""
        return self.layout.partition(self.rank)

    @property
    def partition_grad(self) -> torch.Tensor | None:
        """This step's partition gradient (``grad_accum_dtype``; stage 2 and the stage-1 A/B path), or ``None``."""
        return None if self._partition is None else self._partition.whole_or_none()

    @property
    def accumulator(self) -> torch.Tensor | None:
        """This window's full-size accumulator (padded group, ``grad_accum_dtype``; lean stage 1), or ``None``."""
        return None if self._accumulator is None else self._accumulator.whole_or_none()

    def ensure_partition_grad(self, device: torch.device) -> torch.Tensor:
        """The partition gradient (``grad_accum_dtype``), allocated (zeroed) on first use in a step."""
        self._partition = self._shard_on(self._partition, self.layout.partition_numel, device, self.keep_storage)
        return self._partition.whole()

    def ensure_accumulator(self, device: torch.device) -> torch.Tensor:
        """The full-size accumulator (lean stage 1), allocated (zeroed) on first use in a step."""
        # Never kept: it lives on the working device, where the step peak is what its freeing buys.
        self._accumulator = self._shard_on(self._accumulator, self.layout.padded_numel, device, False)
        return self._accumulator.whole()

    def _shard_on(
        self, shard: ChunkedGradShard | None, numel: int, device: torch.device, keep_storage: bool
    ) -> ChunkedGradShard:
        """``shard``, or a new one-chunk shard when there is none or it lives elsewhere and holds nothing."""
        if shard is not None and (shard.device == device or shard.allocated()):
            return shard
        storage = KEPT_CHUNKS if keep_storage else FREED_CHUNKS
        return ChunkedGradShard(numel, max(1, numel), self.accum_dtype, device, storage)

    def host_bytes(self) -> int:
        """Bytes of this group's gradient buffers held in host memory (stale kept storage included)."""
        shards = (self._partition, self._accumulator)
        return sum(s.storage_numel * s.dtype.itemsize for s in shards if s is not None and s.device.type == "cpu")

    def release(self) -> None:
        """Drop this step's gradient buffers (a kept host partition gradient only turns stale)."""
        for shard in (self._partition, self._accumulator):
            if shard is not None:
                shard.reset()


@dataclass(frozen=True)
class PartitionConfig:
    """Where a ZeRO-1/2 gradient pipeline keeps its buffers.

    ``device``: the working parameters' device (buckets, lean ZeRO-1 accumulator); ``grad_device``: where
    partition gradients live, the master's device (the host when the optimizer is offloaded).
    """

    path: GradPath
    device: torch.device
    grad_device: torch.device


class PartitionGrads:
    """ZeRO-1/2 gradient pipeline of every flat group: hooks, :class:`GradPath` routing, one shared reducer.

    Args:
        groups: per-group gradient state (layouts and parameters in slot order).
        partition: path and devices.
        reducer: mode (``ALL_REDUCE`` or ``TO_OWNERS``), bucket size, wire dtype, scaling, in-flight bound.
        process_groups: per entry of ``groups``, the process group it is partitioned and reduced over (MoE
            expert groups reduce over their expert-data-parallel group). A bucket never spans two groups.
        observer: optional callback ``(event, bucket_index)`` ("staging_alloc", "launched", "reduced").
    """

    def __init__(
        self,
        groups: Sequence[GroupGrads],
        partition: PartitionConfig,
        reducer: ReducerConfig,
        process_groups: Sequence[Any],
        observer: Callable[[str, int], None] | None = None,
    ) -> None:
        self.groups = list(groups)
        self.partition = partition
        self.process_groups = list(process_groups)
        buckets = plan_static([g.layout.slots for g in self.groups], reducer.bucket_numel)
        self.reducer = GradReducer(self, reducer, buckets, observer)
        # parameter id -> (bucket index, group index, slot index)
        self._where: dict[int, tuple[int, int, int]] = {}
        for bucket in self.reducer.buckets:
            for s in bucket.slots:
                self._where[id(self.groups[bucket.group].params[s])] = (bucket.index, bucket.group, s)
        self._path = partition.path  # this backward's route; begin() may pick STAGE2_FREE for lean ZeRO-1
        self._direct = self._folds_directly(self._path)
        comm_bytes = torch.empty((), dtype=reducer.comm_dtype).element_size()
        self.host = HostTransfers(slot_bytes_for(reducer.bucket_numel * comm_bytes))
        # Told ``landed(bucket)`` once a bucket's owned values are in this rank's partition gradient (host copies
        # possibly still in flight: :meth:`HostTransfers.drain` settles them); the early host step listens here.
        self.landed: Callable[[Bucket], None] | None = None
        # Sees every piece on its way into a partition gradient: (group index, partition-local range, piece,
        # whether it is added to what the window holds or replaces it, the gradient's dtype). ZenFlow gathers
        # its columns with it.
        self.sunk: Callable[[int, Range, torch.Tensor, bool, torch.dtype], None] | None = None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad) for grads in self.groups for p in grads.params
        ]

    @property
    def buckets(self) -> list[Bucket]:
        """The reducer's bucket plan."""
        return self.reducer.buckets

    def _folds_directly(self, path: GradPath) -> bool:
        # Lean ZeRO-2 on one rank: the reduction is the identity, so gradients fold straight into the
        # partition gradient; staging buckets would only add their bytes to the peak (benchmarks S1, N=1).
        return path is GradPath.STAGE2_FREE and all(g.layout.world_size == 1 for g in self.groups)

    # --- micro-step protocol ------------------------------------------------------------------------
    def begin(self, kind: MicroStepKind) -> None:
        """Prepare for a backward; ``REDUCE`` marks the last micro-step of an accumulation window."""
        self._path = self.partition.path
        if (
            self._path is GradPath.STAGE1_ACCUMULATE
            and kind is MicroStepKind.REDUCE
            and all(g.accumulator is None for g in self.groups)
        ):
            self._path = GradPath.STAGE2_FREE  # a one-micro-step window: nothing to accumulate
        self._direct = self._folds_directly(self._path)
        reducing = kind is MicroStepKind.REDUCE or self._path.reduces_every_micro_step
        self.reducer.begin(ReducePhase.REDUCE if reducing else ReducePhase.SKIP)

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not getattr(param, "ds_grad_is_ready", True):
            return  # a tile of a tiled function: the gradient is still accumulating ([Note: ds_grad_is_ready])
        bucket_index, g, s = self._where[id(param)]
        bucket, grads = self.reducer.buckets[bucket_index], self.groups[g]
        path = self._path
        grad = param.grad
        assert grad is not None  # a post-accumulate-grad hook runs once .grad is set
        if path is GradPath.STAGE1_ACCUMULATE:
            acc = grads.ensure_accumulator(self.partition.device)
            acc[grads.layout.slots[s].range.as_slice()].add_(grad.reshape(-1))
            param.grad = None
        elif self._direct:
            self._fold_direct(grads, s, grad)
            param.grad = None
        elif path in (GradPath.STAGE2_FREE, GradPath.STAGE2_RETAIN):
            self._stage(bucket, s, grad)
            if path is GradPath.STAGE2_FREE:
                param.grad = None
            else:
                grad.zero_()
        self.reducer.mark_ready(bucket_index, s)

    def _stage(self, bucket: Bucket, slot_index: int, grad: torch.Tensor) -> None:
        config = self.reducer.config
        if bucket.data is None:
            bucket.data = torch.zeros(bucket.range.size, dtype=config.comm_dtype, device=self.partition.device)
            self.reducer.observer("staging_alloc", bucket.index)
        slot = self.groups[bucket.group].layout.slots[slot_index]
        local = slot.range.shift(-bucket.range.start)
        bucket.data[local.as_slice()].add_(grad.reshape(-1))

    def _fold_direct(self, grads: GroupGrads, slot_index: int, grad: torch.Tensor) -> None:
        """One rank, lean ZeRO-2: add ``grad`` (scaled as a reduction would) into the partition gradient."""
        config = self.reducer.config
        piece = grad.reshape(-1).to(config.comm_dtype)
        scale = config.scaling.pre * config.scaling.post
        if scale != 1.0:
            piece = piece * scale
        owned = grads.layout.slots[slot_index].range
        self._sink(grads, owned, piece)

    def finish(self) -> None:
        """End of a backward: reduce what is left (if reducing), wait for everything, fold into partitions."""
        if not self.reducer.reducing:
            return
        self.reducer.finish()
        self.host.drain()

    def discard(self) -> None:
        """Drop every in-flight buffer without folding (used after an overflow or by destroy)."""
        self.reducer.discard()
        self.host.discard()

    def remove_hooks(self) -> None:
        """Detach the post-accumulate-grad hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.host.release()

    # --- BucketIO -----------------------------------------------------------------------------------
    def wire(self, bucket: Bucket) -> torch.Tensor | None:
        """The bucket's values in the wire dtype (``None`` on one rank under lean ZeRO-2: already folded)."""
        if self._direct:
            self._notify(bucket)  # its gradients were folded straight into the partition
            return None
        path, grads, config = self._path, self.groups[bucket.group], self.reducer.config
        if path is GradPath.STAGE1_ACCUMULATE:
            acc = grads.ensure_accumulator(self.partition.device)[bucket.range.as_slice()]
            return acc if acc.dtype == config.comm_dtype else acc.to(config.comm_dtype)
        if path is GradPath.STAGE1_AUTOGRAD:
            pieces = []
            for s in sorted(bucket.slots):
                p = grads.params[s]
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                pieces.append(g.reshape(-1).to(config.comm_dtype))
            return torch.cat(pieces)
        if bucket.data is None:  # no parameter of the bucket got a gradient on this rank
            return torch.zeros(bucket.range.size, dtype=config.comm_dtype, device=self.partition.device)
        return bucket.data

    def owners(self, bucket: Bucket) -> list[tuple[int, Range]]:
        """Each rank owning part of the bucket, with that part in bucket coordinates."""
        layout = self.groups[bucket.group].layout
        pieces = []
        for r in range(layout.world_size):
            piece = bucket.range.intersect(layout.partition(r))
            if not piece.is_empty:
                pieces.append((r, piece.shift(-bucket.range.start)))
        return pieces

    def process_group(self, bucket: Bucket) -> Any:
        """The bucket's group's process group."""
        return self.process_groups[bucket.group]

    def kept(self, bucket: Bucket, reduced: torch.Tensor) -> torch.Tensor | None:
        """This rank's partition's part of the bucket."""
        owned = bucket.range.intersect(self.groups[bucket.group].partition)
        return None if owned.is_empty else reduced[owned.shift(-bucket.range.start).as_slice()]

    def deliver(self, bucket: Bucket, kept: torch.Tensor) -> None:
        """Fold the owned part into the partition gradient (or the lean ZeRO-1 accumulator)."""
        grads = self.groups[bucket.group]
        self._sink(grads, bucket.range.intersect(grads.partition), kept)
        self._notify(bucket)

    def _notify(self, bucket: Bucket) -> None:
        if self.landed is not None:
            self.landed(bucket)

    def _sink(self, grads: GroupGrads, owned: Range, piece: torch.Tensor) -> None:
        path = self._path
        if self.sunk is not None:
            index = next(i for i, g in enumerate(self.groups) if g is grads)
            adds = path in (GradPath.STAGE2_FREE, GradPath.STAGE2_RETAIN)
            self.sunk(index, owned.shift(-grads.partition.start), piece, adds, grads.accum_dtype)
        if path is GradPath.STAGE1_ACCUMULATE:
            acc = grads.ensure_accumulator(self.partition.device)
            target = acc[owned.as_slice()]
            if target.data_ptr() != piece.data_ptr():
                target.copy_(piece)
            return
        local = owned.shift(-grads.partition.start)
        target = grads.ensure_partition_grad(self.partition.grad_device)[local.as_slice()]
        if target.device != piece.device:
            # Optimizer offload: an event-ordered copy to pinned memory, folded at the end of backward.
            fold = Fold.COPY if path is GradPath.STAGE1_AUTOGRAD else Fold.ADD
            self.host.submit(target, piece, fold)
            return
        if path is GradPath.STAGE1_AUTOGRAD:
            target.copy_(piece)
        else:
            target.add_(piece)
