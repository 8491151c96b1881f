"""Bucketed gradient reduction for ZeRO-1/2, with the gradient buffers' lifetime as a policy.

[Note: gradient lifetime] (user report 1). Autograd hands each parameter's gradient to a
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
  parameter at the simulated N=8 step peak on the H200, where upstream's ZeRO-1 only stages buckets
  (``benchmarks/results/diag/call3``, git history at f28fd62).
- ``STAGE1_AUTOGRAD`` (upstream behaviour, for A/B): gradients accumulate in ``.grad`` and are reduced from
  there at the boundary.

Buckets are fixed at construction, ordered like backward produces gradients, and launched strictly in that
order once complete, so every rank issues the same collectives in the same sequence even when parameters
receive gradients in different orders or not at all ([Note: launch order]).
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed import comm as dist
from deepspeed._core.grads.scaling import ReduceScaling
from deepspeed._core.optim.base import MicroStepKind
from deepspeed._core.comm.host_transfer import Fold, HostTransfers, slot_bytes_for
from deepspeed._core.layout.shards import GroupLayout, Range, plan_buckets


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


class ReduceMode(enum.Enum):
    """``reduce_scatter: true`` reduces each slice to its owner; otherwise every rank gets the full sum."""

    TO_OWNERS = "to_owners"
    ALL_REDUCE = "all_reduce"


@dataclass
class GroupGrads:
    """The gradient-side state of one flat parameter group on this rank."""

    layout: GroupLayout
    params: list[torch.nn.Parameter]
    rank: int
    accum_dtype: torch.dtype
    partition_grad: torch.Tensor | None = None  # accum dtype, this rank's partition (stage 2, stage-1 A/B path)
    accumulator: torch.Tensor | None = None  # full padded group, accum dtype (lean stage 1)
    # Offloaded: the host partition gradient's storage outlives its step and is zeroed for the next one
    # instead of being page-faulted in afresh ([Note: kept host chunks]).
    keep_storage: bool = False
    _kept: torch.Tensor | None = None

    @property
    def partition(self) -> Range:
        """This rank's range of the flat group."""
        return self.layout.partition(self.rank)

    def ensure_partition_grad(self, device: torch.device) -> torch.Tensor:
        """The partition gradient (``grad_accum_dtype``), allocated (zeroed) on first use in a step."""
        if self.partition_grad is None:
            kept, self._kept = self._kept, None
            if kept is not None and kept.device == device:
                self.partition_grad = kept.zero_()
            else:
                self.partition_grad = torch.zeros(self.layout.partition_numel, dtype=self.accum_dtype, device=device)
        return self.partition_grad

    def ensure_accumulator(self, device: torch.device) -> torch.Tensor:
        """The full-size accumulator (lean stage 1), allocated (zeroed) on first use in a step."""
        if self.accumulator is None:
            self.accumulator = torch.zeros(self.layout.padded_numel, dtype=self.accum_dtype, device=device)
        return self.accumulator

    def release(self) -> None:
        """Drop this step's gradient buffers (a kept host partition gradient only turns stale)."""
        if self.keep_storage and self.partition_grad is not None:
            self._kept = self.partition_grad
        self.partition_grad = None
        self.accumulator = None


@dataclass
class _Bucket:
    index: int
    group: int
    slots: tuple[int, ...]
    range: Range
    pending: int = 0
    ready: set[int] = field(default_factory=set)
    data: torch.Tensor | None = None
    handles: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class ReducerConfig:
    """Static settings of a :class:`GradReducer`."""

    path: GradPath
    mode: ReduceMode
    bucket_numel: int
    comm_dtype: torch.dtype
    scaling: ReduceScaling
    device: torch.device
    grad_device: torch.device  # where partition gradients live: the master's device (host when offloading)
    # Bucket buffers alive at once, counting the one being filled: 2 with overlap_comm (double buffering:
    # one reducing while the next fills), 1 without (each bucket reduced before the next is staged).
    max_in_flight: int = 1


class GradReducer:
    """Reduces gradients of every ZeRO-1/2 group, bucket by bucket, in one global launch order.

    Args:
        groups: per-group gradient state (layouts and parameters in slot order).
        config: path, reduction mode, bucket size, dtypes and scaling.
        group: the data-parallel process group.
        observer: optional callback ``(event, bucket_index)`` for tests and memory accounting.
        process_groups: per entry of ``groups``, the process group it is partitioned and reduced over when it
            is not ``group`` (MoE expert groups reduce over their expert-data-parallel group); ``None`` = all
            over ``group``. A bucket never spans two groups, so each bucket has exactly one.
    """

    def __init__(
        self,
        groups: Sequence[GroupGrads],
        config: ReducerConfig,
        group: Any = None,
        observer: Callable[[str, int], None] | None = None,
        process_groups: Sequence[Any] | None = None,
    ) -> None:
        self.groups = list(groups)
        self.config = config
        self.group = group
        self.process_groups = list(process_groups) if process_groups is not None else [group] * len(self.groups)
        self.observer = observer or (lambda event, index: None)
        self.buckets = self._plan()
        # parameter id -> (bucket index, group index, slot index)
        self._where: dict[int, tuple[int, int, int]] = {}
        for bucket in self.buckets:
            for s in bucket.slots:
                self._where[id(self.groups[bucket.group].params[s])] = (bucket.index, bucket.group, s)
        self._next_launch = 0
        self._reducing = False
        self._in_flight: list[_Bucket] = []
        self._path = config.path  # this backward's route; begin() may pick STAGE2_FREE for lean ZeRO-1
        self._direct = self._folds_directly(self._path)
        comm_bytes = torch.empty((), dtype=config.comm_dtype).element_size()
        self.host = HostTransfers(slot_bytes_for(config.bucket_numel * comm_bytes))
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad) for grads in self.groups for p in grads.params
        ]

    def _folds_directly(self, path: GradPath) -> bool:
        # Lean ZeRO-2 on one rank: the reduction is the identity, so gradients fold straight into the
        # partition gradient; staging buckets would only add their bytes to the peak (benchmarks S1, N=1).
        return path is GradPath.STAGE2_FREE and all(g.layout.world_size == 1 for g in self.groups)

    def _plan(self) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        for g in reversed(range(len(self.groups))):
            layout = self.groups[g].layout
            for planned in plan_buckets(layout.slots, max(1, self.config.bucket_numel)):
                slots = [layout.slots[i] for i in planned.slot_indices]
                span = Range(min(s.offset for s in slots), max(s.range.end for s in slots))
                buckets.append(_Bucket(len(buckets), g, planned.slot_indices, span))
        return buckets

    # --- micro-step protocol ------------------------------------------------------------------------
    def begin(self, kind: MicroStepKind) -> None:
        """Prepare for a backward; ``REDUCE`` marks the last micro-step of an accumulation window."""
        self._path = self.config.path
        if (self._path is GradPath.STAGE1_ACCUMULATE and kind is MicroStepKind.REDUCE
                and all(g.accumulator is None for g in self.groups)):
            self._path = GradPath.STAGE2_FREE  # a one-micro-step window: nothing to accumulate
        self._direct = self._folds_directly(self._path)
        self._reducing = kind is MicroStepKind.REDUCE or self._path.reduces_every_micro_step
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.slots)
            bucket.ready.clear()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        bucket_index, g, s = self._where[id(param)]
        bucket, grads = self.buckets[bucket_index], self.groups[g]
        path = self._path
        if path is GradPath.STAGE1_ACCUMULATE:
            acc = grads.ensure_accumulator(self.config.device)
            acc[grads.layout.slots[s].range.as_slice()].add_(param.grad.reshape(-1))
            param.grad = None
        elif self._direct:
            self._fold_direct(grads, s, param.grad)
            param.grad = None
        elif path in (GradPath.STAGE2_FREE, GradPath.STAGE2_RETAIN):
            self._stage(bucket, s, param.grad)
            if path is GradPath.STAGE2_FREE:
                param.grad = None
            else:
                param.grad.zero_()
        if self._reducing and s not in bucket.ready:
            bucket.ready.add(s)
            bucket.pending -= 1
            self._launch_ready_prefix()

    def _stage(self, bucket: _Bucket, slot_index: int, grad: torch.Tensor) -> None:
        if bucket.data is None:
            bucket.data = torch.zeros(bucket.range.size, dtype=self.config.comm_dtype, device=self.config.device)
            self.observer("staging_alloc", bucket.index)
        slot = self.groups[bucket.group].layout.slots[slot_index]
        local = slot.range.shift(-bucket.range.start)
        bucket.data[local.as_slice()].add_(grad.reshape(-1))

    def _launch_ready_prefix(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
            self._drain(self.config.max_in_flight - 1)  # leave room for the bucket that fills next

    def _drain(self, keep: int) -> None:
        """Finish the oldest launched buckets until at most ``keep`` remain in flight (bounds staging memory)."""
        while len(self._in_flight) > keep:
            self._finish_bucket(self._in_flight.pop(0))

    # --- one bucket ---------------------------------------------------------------------------------
    def _bucket_data(self, bucket: _Bucket) -> torch.Tensor:
        path, grads = self._path, self.groups[bucket.group]
        if path is GradPath.STAGE1_ACCUMULATE:
            acc = grads.ensure_accumulator(self.config.device)[bucket.range.as_slice()]
            return acc if acc.dtype == self.config.comm_dtype else acc.to(self.config.comm_dtype)
        if path is GradPath.STAGE1_AUTOGRAD:
            pieces = []
            for s in sorted(bucket.slots):
                p = grads.params[s]
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                pieces.append(g.reshape(-1).to(self.config.comm_dtype))
            return torch.cat(pieces)
        if bucket.data is None:  # no parameter of the bucket got a gradient on this rank
            return torch.zeros(bucket.range.size, dtype=self.config.comm_dtype, device=self.config.device)
        return bucket.data

    def _fold_direct(self, grads: GroupGrads, slot_index: int, grad: torch.Tensor) -> None:
        """One rank, lean ZeRO-2: add ``grad`` (scaled as a reduction would) into the partition gradient."""
        piece = grad.reshape(-1).to(self.config.comm_dtype)
        scale = self.config.scaling.pre * self.config.scaling.post
        if scale != 1.0:
            piece = piece * scale
        owned = grads.layout.slots[slot_index].range
        self._sink(grads, owned, piece)

    def _launch(self, bucket: _Bucket) -> None:
        if self._direct:  # every gradient of the bucket is already in the partition gradient
            self.observer("launched", bucket.index)
            self.observer("reduced", bucket.index)
            return
        data = self._bucket_data(bucket)
        bucket.data = data
        if self.config.scaling.pre != 1.0:
            data.mul_(self.config.scaling.pre)
        layout = self.groups[bucket.group].layout
        pg = self.process_groups[bucket.group]
        if self.config.mode is ReduceMode.ALL_REDUCE:
            bucket.handles = [dist.all_reduce(data, group=pg, async_op=True)]
        else:
            bucket.handles = []
            for r in range(layout.world_size):
                piece = bucket.range.intersect(layout.partition(r))
                if piece.is_empty:
                    continue
                dst = dist.get_global_rank(pg, r) if pg is not None else r
                view = data[piece.shift(-bucket.range.start).as_slice()]
                bucket.handles.append(dist.reduce(view, dst=dst, group=pg, async_op=True))
        self._in_flight.append(bucket)
        self.observer("launched", bucket.index)

    def _finish_bucket(self, bucket: _Bucket) -> None:
        for handle in bucket.handles:
            handle.wait()
        grads = self.groups[bucket.group]
        owned = bucket.range.intersect(grads.partition)
        if not owned.is_empty:
            piece = bucket.data[owned.shift(-bucket.range.start).as_slice()]
            if self.config.scaling.post != 1.0:
                piece.mul_(self.config.scaling.post)
            self._sink(grads, owned, piece)
        bucket.data, bucket.handles = None, []
        self.observer("reduced", bucket.index)

    def _sink(self, grads: GroupGrads, owned: Range, piece: torch.Tensor) -> None:
        path = self._path
        if path is GradPath.STAGE1_ACCUMULATE:
            acc = grads.ensure_accumulator(self.config.device)
            target = acc[owned.as_slice()]
            if target.data_ptr() != piece.data_ptr():
                target.copy_(piece)
            return
        local = owned.shift(-grads.partition.start)
        target = grads.ensure_partition_grad(self.config.grad_device)[local.as_slice()]
        if target.device != piece.device:
            # Optimizer offload: an event-ordered copy to pinned memory, folded at the end of backward.
            fold = Fold.COPY if path is GradPath.STAGE1_AUTOGRAD else Fold.ADD
            self.host.submit(target, piece, fold)
            return
        if path is GradPath.STAGE1_AUTOGRAD:
            target.copy_(piece)
        else:
            target.add_(piece)

    def finish(self) -> None:
        """End of a backward: launch what is left (if reducing), wait for everything, fold into partitions."""
        if not self._reducing:
            return
        for bucket in self.buckets[self._next_launch :]:
            self._launch(bucket)
            self._drain(self.config.max_in_flight)
        self._next_launch = len(self.buckets)
        self._drain(0)
        self.host.drain()
        self._reducing = False

    def discard(self) -> None:
        """Drop every in-flight buffer without folding (used after an overflow or by destroy)."""
        for bucket in self.buckets:
            for handle in bucket.handles:
                handle.wait()
            bucket.data, bucket.handles = None, []
        self._in_flight.clear()
        self.host.discard()
        self._reducing = False

    def remove_hooks(self) -> None:
        """Detach the post-accumulate-grad hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.host.release()
