"""ZeRO stages 1 and 2: flat bit16 groups, partitioned fp32 optimizer state, bucketed gradient reduction.

Set-up, per optimizer parameter group: the trainable parameters are flattened on their own device
(lean: in place, chunk by chunk, [Note: layout]; A/B: via host memory as upstream did), this rank's
partition is copied to an fp32 master that replaces the group's parameters in the inner optimizer, and
gradient hooks are installed ([Note: gradient lifetime] in ``deepspeed/_core/grads/partitions.py``). A step
checks overflow and the global norm with one scalar all-reduce, unscales and clips the fp32 partition gradient in
place, steps the inner optimizer, writes the masters back and all-gathers the bit16 partitions.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.config.plan import RunPlan
from deepspeed._core.grads.convert import Coef, scales
from deepspeed._core.grads.partitions import GradPath, GroupGrads, PartitionConfig, PartitionGrads
from deepspeed._core.grads.reducer import ReduceMode, ReducerConfig
from deepspeed._core.grads.scaling import ReduceScaling
from deepspeed._core.layout.flat_buffer import FlatBuffer
from deepspeed._core.layout.inplace_flatten import FlattenPath, flatten_params
from deepspeed._core.layout.shards import Range, plan_group
from deepspeed._core.moe.params import ExpertGroup, is_moe_param_group
from deepspeed._core.optim import stage12_state as stage12_checkpoint
from deepspeed._core.optim.base import MicroStepKind
from deepspeed._core.optim.chunked_step import ChunkStepper, step_chunk_numel, step_in_chunks
from deepspeed._core.optim.clipping import counts_in_norm, local_sq_norm
from deepspeed._core.optim.early_step import EarlyUpdate, GroupSpan, LandingPlan, LazyPartitionGrad, needs_no_norm
from deepspeed._core.optim.host_step import GroupStep, Handoff, OverlappedHostStep, pinning_of, pool_for_step
from deepspeed._core.optim.hp_mapping import attach_hp_mapping, detach_hp_mapping
from deepspeed._core.optim.master import GatherWriteBack, MasterPlacement, MasterShard
from deepspeed._core.optim.sharded import (
    OPTIMIZER_ALLGATHER_TIMER,
    OPTIMIZER_GRADIENTS_TIMER,
    OPTIMIZER_STEP_TIMER,
    OPTIMIZER_TIMERS,
    ShardedOptimizer,
)
from deepspeed._core.optim.zenflow import ZenFlowUpdate
from deepspeed.accelerator import get_accelerator


@dataclass
class ZeroGroup:
    """One flat group: its parameters (slot order), working flat buffer, master partition and gradients."""

    params: list[torch.nn.Parameter]
    names: list[str]
    flat: FlatBuffer
    master: MasterShard  # written back by an all-gather of the flat buffer's partitions
    grads: GroupGrads
    # The ranks this group is partitioned and reduced over: the data-parallel group, or for an MoE
    # parameter group the expert-data-parallel group of its expert group (its own world size and rank).
    process_group: Any = None
    rank: int = 0
    member_ranks: list[int] = field(default_factory=list)

    @property
    def partition(self) -> Range:
        """This rank's range of the flat group."""
        return self.flat.layout.partition(self.rank)


def _trainable_unique(group_params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Trainable parameters of a group, each once (tied weights appear once)."""
    seen: set[int] = set()
    out = []
    for p in group_params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class ZeroOptimizer(ShardedOptimizer):
    """The ZeRO-1/2 wrapped optimizer (public façade: ``DeepSpeedZeroOptimizer``).

    Args:
        optimizer: inner optimizer built over the model's working parameters.
        plan: run plan (stage, buckets, lean switches, precision, gradient policy).
        loss_scaler: fp16 loss scaler or ``None``.
        dp_group: data-parallel process group (``None`` = world).
        param_names: optional ``{param: name}`` used for checkpoint ``param_shapes``.
        expert_groups: process groups of each expert group by name; a parameter group marked ``moe`` is
            partitioned and reduced over the expert-data-parallel group of its ``name``.
    """

    checkpoint_format = stage12_checkpoint

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        plan: RunPlan,
        loss_scaler: Any,
        dp_group: Any,
        param_names: dict[torch.nn.Parameter, str] | None = None,
        expert_groups: Mapping[str, ExpertGroup] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.expert_groups = dict(expert_groups or {})
        self.plan = plan
        self.loss_scaler = loss_scaler
        self.dp_group = dp_group
        self.world_size = dist.get_world_size(group=dp_group)
        self.rank = dist.get_rank(group=dp_group)
        self.path = GradPath.select(plan.zero.stage, plan.zero.lean.eager_grad_release)
        self.groups = [self._build_group(g, param_names or {}) for g in optimizer.param_groups]
        devices = PartitionConfig(self.path, self.groups[0].flat.device, self.groups[0].master.param.device)
        self.grad_pipeline = PartitionGrads(
            [g.grads for g in self.groups], devices, self._reducer_config(), [g.process_group for g in self.groups]
        )
        self.reducer = self.grad_pipeline.reducer
        precision = plan.precision
        self.check_overflow = precision.fp16 or (precision.bf16 and precision.check_grad_overflow)
        self._cleared_after_step = True
        # A step chunk is a fixed fraction of the largest master partition on the device, the minimum chunk for
        # one on the host ([Note: chunked step]; a host step is bound by its arithmetic).
        largest = 0 if plan.zero.offload_optimizer.enabled else max(g.master.param.numel() for g in self.groups)
        self._step_chunk_numel = step_chunk_numel(precision.master_dtype, largest)
        # [Note: overlapped host step]: an offloaded update is stepped on a host worker, published chunk by chunk.
        self.pinned = pool_for_step(self._step_chunk_numel, pinning_of(plan))
        overlap = plan.zero.offload_optimizer.enabled and plan.zero.lean.overlap_offload_step
        handoff = Handoff.SHORT_SWITCH if plan.zero.lean.short_switch_interval else Handoff.DEFAULT
        self.host_step = OverlappedHostStep(self.pinned, handoff) if overlap else None
        self._plan_early_step()
        self.zenflow = self._build_zenflow()
        attach_hp_mapping(self)  # lets safe_get_full_fp32_param & co. find a parameter's partition

    # --- set-up ---------------------------------------------------------------------------------------
    def _build_zenflow(self) -> ZenFlowUpdate | None:
        """[Note: zenflow]: the split update when ``zero_optimization.zenflow`` is given."""
        policy = self.plan.zero.zenflow
        if policy is None:
            return None
        if any(g.process_group is not self.dp_group for g in self.groups):
            raise ValueError("zero_optimization.zenflow with MoE expert parameter groups is not implemented")
        layouts = [
            (g.partition.start, g.master.numel(), [(slot.offset, slot.shape) for slot in g.grads.layout.slots])
            for g in self.groups
        ]
        writer = self.groups[0].master.writer if self.groups else None
        device = writer.flat.device if isinstance(writer, GatherWriteBack) else None
        zenflow = ZenFlowUpdate(self.optimizer, policy, layouts, self.dp_group, device=device)
        if zenflow.gather is not None:  # [Note: zenflow columns]: the columns' gradient gathered as it lands
            self.grad_pipeline.sunk = zenflow.gather_piece
        return zenflow

    def _plan_early_step(self) -> None:
        """[Note: early host step]: which step chunks wait on which buckets; armed per boundary in
        prepare_backward."""
        spans = [GroupSpan(i, g.partition, g.master.numel()) for i, g in enumerate(self.groups)]
        self._landing = LandingPlan(spans, self.reducer.buckets, self._step_chunk_numel)
        self._early = EarlyUpdate(self.host_step, self._early_groups) if self.host_step is not None else None

    @property
    def early_chunks(self) -> int:
        """For tests: chunks handed to the host worker before the backward ended ([Note: early host step])."""
        return 0 if self._early is None else self._early.chunks

    def _build_group(self, param_group: dict, names: dict[torch.nn.Parameter, str]) -> ZeroGroup:
        params = _trainable_unique(param_group["params"])
        if not params:
            raise ValueError("a ZeRO optimizer parameter group has no trainable parameters")
        device = params[0].device
        pg, world, rank = self._process_group_of(param_group)
        layout = plan_group([tuple(p.shape) for p in params], world)
        lean = self.plan.zero.lean
        flat = flatten_params(
            params,
            layout,
            device,
            chunk_numel=self.plan.zero.buckets.allgather_bucket_size,
            path=FlattenPath.IN_PLACE if lean.inplace_flatten else FlattenPath.VIA_HOST,
            trim_cache=get_accelerator().empty_cache if device.type != "cpu" else None,
        )
        offload = self.plan.zero.offload_optimizer
        placement = MasterPlacement.DEVICE
        if offload.enabled:
            placement = MasterPlacement.PINNED_HOST if offload.pin_memory else MasterPlacement.HOST
        # The post-step all-gather goes allgather_bucket_size elements at a time, split over the ranks.
        window = max(1, self.plan.zero.buckets.allgather_bucket_size // max(1, self.world_size))
        master = MasterShard.of_flat(
            flat, rank, self.plan.precision.master_dtype, placement, group=pg, window_numel=window
        )
        param_group["params"] = [master.param]
        grads = GroupGrads(layout, params, rank, self.plan.precision.grad_accum_dtype, keep_storage=offload.enabled)
        members = [dist.get_global_rank(pg, r) if pg is not None else r for r in range(world)]
        return ZeroGroup(
            params, [names.get(p, f"param_{i}") for i, p in enumerate(params)], flat, master, grads, pg, rank, members
        )

    def _process_group_of(self, param_group: dict) -> tuple[Any, int, int]:
        """``(process group, its size, this rank's index)`` a parameter group is partitioned over."""
        if not is_moe_param_group(param_group):
            return self.dp_group, self.world_size, self.rank
        name = param_group.get("name")
        if name not in self.expert_groups:
            raise ValueError(
                f"optimizer parameter group marked 'moe' has name {name!r}, which is not an expert group of the "
                f"model (known: {sorted(self.expert_groups)}); build the groups with "
                "split_params_into_different_moe_groups_for_optimizer"
            )
        pg = self.expert_groups[name].edp_group
        return pg, dist.get_world_size(group=pg), dist.get_rank(group=pg)

    def _reducer_config(self) -> ReducerConfig:
        buckets = self.plan.zero.buckets
        return ReducerConfig(
            mode=ReduceMode.TO_OWNERS if buckets.reduce_scatter else ReduceMode.ALL_REDUCE,
            bucket_numel=buckets.reduce_bucket_size,
            comm_dtype=self.plan.precision.comm_dtype,
            scaling=ReduceScaling.from_policy(self.plan.grads, self.world_size),
            max_in_flight=2 if buckets.overlap_comm else 1,
        )

    # --- micro-step protocol ----------------------------------------------------------------------------
    def prepare_backward(self, kind: MicroStepKind) -> None:
        """Arm the reducer (stage 2 reduces every micro-step; stage 1 only at the boundary)."""
        window_starts, self._cleared_after_step = self._cleared_after_step, False
        if self.zenflow is not None:  # [Note: zenflow deferred accumulation]: the last step's gradients are free
            self.zenflow.finish_accumulating()
            if window_starts:
                self.zenflow.open_window()
        self._arm_early(kind is MicroStepKind.REDUCE and self.steps_during_backward())
        self.grad_pipeline.begin(kind)

    def steps_during_backward(self) -> bool:
        """Whether an offloaded update may start while the boundary backward runs ([Note: early host step]): the
        overlapped host step is on and nothing needs the global gradient norm before a chunk may change (no
        ``gradient_clipping``, no fp16 loss scale, no bf16 overflow check)."""
        return (
            self.host_step is not None
            and self.plan.zero.zenflow is None
            and needs_no_norm(self.plan, self.loss_scaler, self.check_overflow)
        )

    def _arm_early(self, armed: bool) -> None:
        """Listen for landed buckets during this backward (the boundary's), or stop listening."""
        if self._early is not None:
            self._early.arm(armed)
        if armed:
            self._landing.reset()
        self.grad_pipeline.landed = self._on_landed if armed else None

    def _on_landed(self, bucket: Any) -> None:
        """A bucket is in the partition gradients: hand every chunk it completed to the host worker."""
        ready = self._landing.land(bucket.index)
        if not ready:
            return
        self.grad_pipeline.host.drain()  # the chunk's host copies must have been folded before it is read
        assert self._early is not None
        self._early.submit(ready)

    def _early_groups(self) -> list[GroupStep]:
        """Every group's share of an update started early; its gradients are read when each chunk steps."""
        steps = []
        for index, group in enumerate(self.groups):
            grad = LazyPartitionGrad(functools.partial(self._grad_partition, group), group.master.dtype)
            stepper = ChunkStepper(self.optimizer, index, self._step_chunk_numel)
            steps.append(GroupStep(stepper, grad, group.master.writer.publish, group.flat.dtype))
        return steps

    def finish_backward(self) -> None:
        """Flush this backward's buckets into the partition gradients."""
        self.grad_pipeline.finish()

    def _grad_partition(self, group: ZeroGroup) -> torch.Tensor | None:
        """This rank's partition gradient, as accumulated (``grad_accum_dtype``; not copied)."""
        grads = group.grads
        if grads.accumulator is not None:  # lean ZeRO-1 after a window of several micro-steps
            return grads.accumulator[group.partition.as_slice()]
        return grads.partition_grad

    def step(self, closure: Any = None) -> bool:
        """Overflow check + global norm (one all-reduce), unscale and clip, inner step, write back, all-gather."""
        try:
            return self._timed_step()
        finally:
            self.log_timers(OPTIMIZER_TIMERS)

    def _timed_step(self) -> bool:
        with self.timed(OPTIMIZER_GRADIENTS_TIMER):
            parts = [self._grad_partition(g) for g in self.groups]
            # The scalar travels on the communication device even when the partitions live on the host.
            counted = [p for p in parts if p is not None]
            if any(not counts_in_norm(p) for g in self.groups for p in g.params):  # pipeline tied-weight copies
                counted = self._norm_pieces(parts)
            sq = local_sq_norm(counted).to(self.groups[0].flat.device)
            del counted
            # ZenFlow decides on the host: an overflow must also keep its gradients out of the accumulator.
            devices = {g.master.device for g in self.groups}
            on_device = None if self.zenflow is not None else self._device_step(sq, devices)
            decision = self._decide_step(sq) if on_device is None else None
        if on_device is not None:  # [Note: device step]
            return self._run_device_step(on_device, lambda coef: self._update(parts, coef))
        assert decision is not None
        self.overflow = decision.overflow
        if decision.overflow:
            return self._skip_step()
        self._global_grad_norm = decision.norm
        self._update(parts, decision.coef)
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        return True

    def _update(self, parts: list[torch.Tensor | None], coef: Coef) -> None:
        """Step every group on its partition gradient scaled by ``coef``, drop the gradients, publish the weights.

        Takes ``parts`` over: the list is emptied, so no reference to views of the accumulators outlives the step.
        """
        if self.zenflow is not None:  # [Note: zenflow]
            # ZenFlow reads every element on the host (its accumulator is there); lean ZeRO-1 accumulates the
            # window's gradients beside the working weights, so they come down first.
            parts[:] = [p.to("cpu") if p is not None and p.device.type != "cpu" else p for p in parts]
            self.zenflow.step(parts, coef)
            parts.clear()
            self._clear_grads()
            self._publish_zenflow(self.zenflow)
            # [Note: zenflow in-place host update]: it may write the master once the publish has read it.
            self.zenflow.start_host_update()
            return
        if self.host_step is not None:
            self._overlapped_update(parts, coef)
            return
        with self.timed(OPTIMIZER_STEP_TIMER):
            for index in range(len(self.groups)):
                self._step_group(index, self.groups[index], parts[index], coef)
        parts.clear()
        # Gradients go before the all-gather, so its staging never coexists with them (the N=8 step peak).
        self._clear_grads()
        with self.timed(OPTIMIZER_ALLGATHER_TIMER):
            self.publish_weights()

    def _overlapped_update(self, parts: list[torch.Tensor | None], coef: Coef) -> None:
        """:meth:`_update` with the host step overlapped with the write-back ([Note: overlapped host step])."""
        assert self.host_step is not None
        if self._early is not None and self._early.armed:  # [Note: early host step]: some chunks may be stepped
            run = self._early.take(coef)
            self.grad_pipeline.landed = None
            parts.clear()
            with self.timed(OPTIMIZER_STEP_TIMER):  # the write-back overlaps the step: both count here
                run.submit_rest()
                run.publish()
            del run
        else:  # [Note: update after the decision]
            steps = []
            for index, group in enumerate(self.groups):
                part = parts[index]
                grad = torch.zeros_like(group.master.param) if part is None else part
                stepper = ChunkStepper(self.optimizer, index, self._step_chunk_numel)
                steps.append(GroupStep(stepper, grad, group.master.writer.publish, group.flat.dtype))
            parts.clear()
            with self.timed(OPTIMIZER_STEP_TIMER):
                self.host_step.run(steps, coef)
            steps.clear()
        self._clear_grads()
        with self.timed(OPTIMIZER_ALLGATHER_TIMER):
            for group in self.groups:
                group.master.writer.after_publish()

    def _norm_pieces(self, parts: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """The partition gradients, less the ranges of tied-weight copies another stage counts
        ([Note: pipeline norm])."""
        pieces: list[torch.Tensor] = []
        for group, part in zip(self.groups, parts, strict=False):
            if part is None:
                continue
            own = group.grads.partition
            skip = sorted(
                (
                    group.grads.layout.slots[s].range.intersect(own)
                    for s, p in enumerate(group.params)
                    if not counts_in_norm(p)
                ),
                key=lambda r: r.start,
            )
            start = own.start
            for r in (r for r in skip if not r.is_empty):
                pieces.append(part[start - own.start : r.start - own.start])
                start = max(start, r.end)
            pieces.append(part[start - own.start :])
        return pieces

    def window_grads(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """Views of the window's accumulated gradients (the lean accumulator, else ``.grad``), shaped like
        ``params``."""
        if self.path is not GradPath.STAGE1_ACCUMULATE:
            return super().window_grads(params)
        out = []
        for p in params:
            group, slot = next((g, s) for g in self.groups for s, q in enumerate(g.params) if q is p)
            acc = group.grads.ensure_accumulator(self.grad_pipeline.partition.device)
            out.append(acc[group.grads.layout.slots[slot].range.as_slice()].view(p.shape))
        return out

    def _step_group(self, index: int, group: ZeroGroup, part: torch.Tensor | None, coef: Coef) -> None:
        """Update one group's master; groups step one at a time so no other master holds a gradient."""
        master = group.master.param
        if part is None:
            part = torch.zeros_like(master)
        if part.dtype == master.dtype and part.device == master.device:
            if scales(coef):
                part.mul_(coef)
            master.grad = part  # handed over, no copy
            self.optimizer.step()
            master.grad = None
            return
        # Narrow dtype or host master (offload): convert and scale one chunk at a time ([Note: chunked step]).
        step_in_chunks(self.optimizer, index, part, self._step_chunk_numel, coef)

    @torch.no_grad()
    def _publish_zenflow(self, zenflow: ZenFlowUpdate) -> None:
        """Publish after a ZenFlow step ([Note: zenflow split]). After a step that changed only the every-step
        path's elements, only those go up: converted, sent, and scattered into this rank's partition on the device
        by the same column indices (the other elements' working copies already hold their masters' rounded values).
        Otherwise the host master goes up whole, and the columns stepped on the device ([Note: zenflow columns]),
        whose host copies are stale, are scattered over it from the device: nothing crosses back. Then the
        partitions are all-gathered."""
        partial = all(zenflow.stepped_values(index) is not None for index in range(len(self.groups)))
        for index, group in enumerate(self.groups):
            writer = group.master.writer
            assert isinstance(writer, GatherWriteBack)  # a ZeRO-1/2 master is a partition of a flat buffer
            if partial:
                values = zenflow.stepped_values(index)
            else:
                writer.write_partition(group.master.data)
                values = zenflow.device_values(index)
            if values is not None:
                self._scatter_selected(zenflow, index, writer, values)
            writer.after_publish()
        zenflow.partial_publishes += int(partial)

    def _scatter_selected(
        self, zenflow: ZenFlowUpdate, index: int, writer: GatherWriteBack, values: torch.Tensor
    ) -> None:
        """Write group ``index``'s every-step path ``values`` (packed) into this rank's partition on the device."""
        flat = writer.flat
        packed = values.to(flat.dtype).to(flat.device)
        start = 0
        for piece in flat.pieces(writer.partition):  # one per segment the partition spans
            offset, split = zenflow.split_on(index, flat.device, start, start + piece.numel())
            split.put_(piece, packed[offset : offset + split.counts[0]], True)
            start += piece.numel()

    def publish_weights(self) -> None:
        """Write the fp32 masters into the working flat buffers and all-gather every rank's partition; after a load
        that brought a ZenFlow update in flight, the working partitions it saved instead
        ([Note: zenflow checkpoint])."""
        working = self.zenflow.take_loaded_working() if self.zenflow is not None else None
        for index, group in enumerate(self.groups):
            if working is None:
                group.master.write_back()
            else:
                group.master.writer.write(working[index])

    def host_grad_bytes(self) -> int:
        """Host partition gradients (offloaded optimizer), kept storage included."""
        return sum(g.grads.host_bytes() for g in self.groups)

    def _clear_grads(self) -> None:
        if self.zenflow is not None:
            self.zenflow.close_window()
        for group in self.groups:
            group.master.param.grad = None
            group.grads.release()
            for p in group.params:
                p.grad = None
        self._cleared_after_step = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient buffer of the current window (partition gradients and ``.grad``)."""
        self._arm_early(False)
        self.grad_pipeline.discard()
        self._clear_grads()

    def destroy(self) -> None:
        """Remove hooks and drop gradient buffers."""
        self._arm_early(False)
        self.grad_pipeline.discard()
        self.grad_pipeline.remove_hooks()
        self._clear_grads()
        if self.host_step is not None:
            self.host_step.shutdown()
        if self.zenflow is not None:
            self.zenflow.shutdown()
        self.pinned.clear()
        detach_hp_mapping(self)

    # --- checkpoints (interface: deepspeed._core.checkpoint.save_load.ShardedCheckpointOptimizer) ---------
    def checkpoint_param_groups(self) -> list[list[torch.nn.Parameter]]:
        """Trainable model parameters per flat group, in flat order (checkpoint ``param_shapes``)."""
        return [list(g.params) for g in self.groups]

    def checkpoint_check_shards(self, state_dict_list: list) -> None:
        """Raise if the saved shards cannot be loaded, ZenFlow's state included (before anything changes)."""
        super().checkpoint_check_shards(state_dict_list)
        stage12_checkpoint.check_zenflow_shards(self, state_dict_list)

    def refresh_fp32_params(self) -> None:
        """Rebuild the fp32 masters from the current (e.g. just loaded) working weights (a ZenFlow host update in
        flight is applied first, so that the rebuilt masters are final)."""
        if self.zenflow is not None:
            self.zenflow.settle()
        for g in self.groups:
            g.master.refresh()
        if self.zenflow is not None:
            self.zenflow.drop_columns()  # the masters were just rebuilt ([Note: zenflow columns])

    def before_grad_write(self) -> None:
        """A partition gradient is about to be written on the host (``safe_set_*_grad``): what ZenFlow gathered
        of this window on the device no longer matches it."""
        if self.zenflow is not None:
            self.zenflow.close_window()

    def before_master_access(self, write: bool) -> None:
        """Called before the masters or their optimizer state are read or written from outside a step (the
        ``safe_get_*`` / ``safe_set_*`` helpers): ZenFlow's device columns are written back first, and forgotten
        when the host copies are about to change ([Note: zenflow columns])."""
        if self.zenflow is not None:
            self.zenflow.sync_columns(drop=write)

    # --- introspection for tests, checkpoints and safe_get_* helpers -------------------------------------
    def observe(self, callback: Any) -> None:
        """Register ``callback(event, bucket_index)`` for reducer events ("launched", "reduced", ...)."""
        self.reducer.observer = callback

    def live_grad_buffers(self) -> dict[str, int]:
        """Counts of gradient buffers alive now: autograd ``.grad``, partition grads, accumulators, staging."""
        return {
            "param_grads": sum(p.grad is not None for g in self.groups for p in g.params),
            "partition_grads": sum(g.grads.partition_grad is not None for g in self.groups),
            "accumulators": sum(g.grads.accumulator is not None for g in self.groups),
            "staging": sum(b.data is not None for b in self.reducer.buckets),
        }
