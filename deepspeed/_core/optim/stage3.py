"""ZeRO stage 3 optimizer: reduce-scatter gradients into fp32 shards, step on shards, write shards back.

Parameters are partitioned and fetched by :class:`~deepspeed._core.params.manager.ZeroParamManager`. This
module subscribes to its "gradient ready" seam: each full gradient (available while its parameter is
still gathered) is added to the shared gradient reducer, ``param.grad`` is dropped at once (lean) and,
when the bucket is full, one reduce-scatter of rank-major rows hands every rank the sum of its own slices
([Note: zero3-grads] in ``deepspeed/_core/grads/shard_rows.py``). Reduced slices are added into an accumulator
per optimizer group, kept in ``grad_accum_dtype`` (``data_types.grad_accum_dtype``; the working dtype by
default, the ``bg`` of the memory floors), in chunks allocated as reductions reach them
([Note: lazy grad shard]). The step reads one chunk at a time: in place when it matches the master's dtype and
device, else through one converted copy ([Note: chunked step]).

With ``offload_optimizer`` the master, the optimizer state and the accumulator live in pageable host
memory; reduced slices reach the host through a bounded pinned ring ([Note: pinned ring]), and updated
weights go back to the shards one chunk at a time, so host memory is the master, the moments and the
accumulator plus a few fixed-size staging buffers. Where no global decision is needed, the update of a chunk whose
parameters' gradients are all final starts during the boundary backward ([Note: final gradient count]).
Without offloading (``lean_gather_from_master``) a partitioned
parameter's shard is its slice of the device master, so the step itself updates it ([Note: zero3-master]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.comm.host_transfer import Fold, HostTransfers, Staging, slot_bytes_for
from deepspeed._core.comm.pinned_pool import Pinning
from deepspeed._core.comm.streams import record_current
from deepspeed._core.config.plan import OffloadDevice, RunPlan
from deepspeed._core.grads.accumulator import ChunkedGradShard, ChunkStorage
from deepspeed._core.grads.convert import Coef
from deepspeed._core.grads.parked import ParkedGrads, ParkedWindow
from deepspeed._core.grads.reducer import GradReducer, ReduceMode, ReducerConfig
from deepspeed._core.grads.scaling import ReduceScaling
from deepspeed._core.grads.shard_rows import FoldOrder, GradRelease, RowEntry, ShardRows
from deepspeed._core.layout.shards import Range
from deepspeed._core.optim import stage3_state as stage3_checkpoint
from deepspeed._core.optim.base import MicroStepKind
from deepspeed._core.optim.chunked_step import ChunkStepper, step_chunk_numel, step_in_chunks
from deepspeed._core.optim.clipping import local_sq_norm
from deepspeed._core.optim.early_step import (
    ArrivalRecord,
    ChunkKey,
    EarlyUpdate,
    FixedChunkGrads,
    RegionSpan,
    needs_no_norm,
)
from deepspeed._core.optim.host_step import GroupStep, Handoff, OverlappedHostStep, pinning_of, pool_for_step
from deepspeed._core.optim.master import MasterShard, send_through_host, writer_into
from deepspeed._core.optim.sharded import INIT_OPTIMIZER_TIMER, OPTIMIZER_STEP_TIMER, ShardedOptimizer
from deepspeed._core.optim.stage3_access import Region, ShardIndex, Stage3ParamAccess
from deepspeed._core.params.manager import ZeroParamManager
from deepspeed._core.params.param import ShardedState, ZeroParam, zero_state
from deepspeed.accelerator import get_accelerator


@dataclass
class Stage3Group:
    """One inner-optimizer group: its parameters' states, fp32 master shard and gradient accumulator."""

    states: list[ZeroParam]
    offsets: list[int]  # start of each state's shard inside the group's flat shard
    master: MasterShard  # written back by a scatter into the parameters' shards
    chunk_numel: int
    accum_dtype: torch.dtype = torch.float32
    keep_storage: bool = False  # offloaded: the host shard's storage outlives its window ([Note: kept host chunks])
    pin_memory: bool = False  # offloaded with pin_memory: chunks are page-locked
    # A region's first fold of a window may be copied straight into its chunk (page-locked host chunks).
    direct_first_fold: bool = False
    accumulator: ChunkedGradShard | None = None

    def ensure_accumulator(self) -> ChunkedGradShard:
        """The gradient shard in ``accum_dtype`` beside the master; its chunks appear as gradients reach them."""
        if self.accumulator is None:
            self.accumulator = ChunkedGradShard(
                self.master.numel(),
                self.chunk_numel,
                self.accum_dtype,
                self.master.device,
                ChunkStorage(kept=self.keep_storage, pinned=self.pin_memory),
            )
        return self.accumulator

    def window_grad(self) -> ChunkedGradShard | None:
        """The gradient shard if this window has written to it, else ``None``."""
        acc = self.accumulator
        return acc if acc is not None and acc.allocated_numel else None

    def end_window(self) -> None:
        """Drop the window's gradient: the shard frees its chunks, or with ``keep_storage`` turns them stale."""
        if self.accumulator is not None:
            self.accumulator.reset()


class Stage3Optimizer(Stage3ParamAccess, ShardedOptimizer):
    """The ZeRO-3 wrapped optimizer (public façade: ``DeepSpeedZeroOptimizer_Stage3``).

    Args:
        optimizer: inner optimizer built over the model's (partitioned) parameters.
        plan: run plan.
        loss_scaler: fp16 loss scaler or ``None``.
        dp_group: data-parallel group the parameters are partitioned over.
        manager: the parameter manager that partitioned the model.
    """

    checkpoint_format = stage3_checkpoint
    step_timers = [OPTIMIZER_STEP_TIMER]  # what each step prints with ``wall_clock_breakdown``
    _states_created = False  # whether an update has run (the first one creates the inner optimizer's state)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        plan: RunPlan,
        loss_scaler: Any,
        dp_group: Any,
        manager: ZeroParamManager,
    ) -> None:
        self.optimizer, self.plan, self.loss_scaler = optimizer, plan, loss_scaler
        self.dp_group, self.manager = dp_group, manager
        self.world_size = dist.get_world_size(group=dp_group)
        self.rank = dist.get_rank(group=dp_group)
        bucket_bytes = self._build_groups()
        self.index = ShardIndex(self.groups)
        self.scaling = ReduceScaling.from_policy(plan.grads, self.world_size)
        # The host slots stage one reduced bucket's rows at a time, so they follow the reducer's bucket size.
        self.host = HostTransfers(slot_bytes_for(bucket_bytes))
        # [Note: parked grads]: with the optimizer on the host and one micro-step per window, a reduced gradient
        # waits for the step in its parameter's shard instead of in host chunks.
        self.parked = self._parked_grads()
        self._park, overlap = self._offload_modes(plan)
        if self._park:
            self.parked.hold([s for grp in self.groups for s in grp.states])
        self._window_buffers: list[torch.Tensor] = []  # two step chunks for ParkedWindow, from the pinned pool
        # [Note: overlapped host step]: an offloaded update is stepped on a host worker, published chunk by chunk.
        self.pinned = pool_for_step(self._step_chunk_numel, pinning_of(plan))
        handoff = Handoff.SHORT_SWITCH if plan.zero.lean.short_switch_interval else Handoff.DEFAULT
        self.host_step = OverlappedHostStep(self.pinned, handoff) if overlap else None
        self._folded: set[tuple[int, int]] = set()  # (group, offset) regions folded in this window
        self._plan_early_step()
        self._build_reduction()
        self.check_overflow = plan.precision.fp16 or (plan.precision.bf16 and plan.precision.check_grad_overflow)
        self._subscriptions = [manager.on_grad_ready(self._on_grad), manager.on_backward_end(self.flush)]
        if self.unit_grad_reduce:
            self._subscriptions.append(manager.on_unit_backward_end(self.reducer.close_bucket))
        self.parameter_offload: Any = None  # set by the engine façade (DeepSpeedZeRoOffload view)
        self._register_with_params()

    def _offload_modes(self, plan: RunPlan) -> tuple[bool, bool]:
        """Whether gradients park in the parameters' shards, and whether the offloaded step overlaps its
        write-back ([Note: overlapped host step]). Swapped partitions ([Note: nvme params]) do neither: they
        are not in memory to hold a gradient, and they are written whole after the step, not chunk by chunk."""
        offload = plan.zero.offload_optimizer.enabled and plan.zero.offload_param.device is not OffloadDevice.NVME
        park = offload and plan.zero.lean.grads_in_param_shards and plan.batch.gradient_accumulation_steps == 1
        return park, offload and plan.zero.lean.overlap_offload_step and not self._from_master

    def _register_with_params(self) -> None:
        """Mark every managed parameter with this optimizer (``_z3_optimizer``, upstream's attribute), through which
        ``safe_get_full_*`` find it."""
        for grp in self.groups:
            for state in grp.states:
                if state.param is not None:
                    state.param._z3_optimizer = self

    def _build_groups(self) -> int:
        """Build the per-group masters and gradient shards and the step chunk they are cut in; returns the bytes of
        one reduce bucket on the wire."""
        plan, optimizer = self.plan, self.optimizer
        comm_bytes = torch.empty((), dtype=plan.precision.comm_dtype).element_size()
        bucket_bytes = plan.zero.buckets.reduce_bucket_size * comm_bytes
        # A step chunk is a fixed fraction of the largest master on the device, the minimum chunk for a master on
        # the host ([Note: chunked step]; a host step is bound by its arithmetic, not by per-call overhead); the
        # gradient shard is chunked the same way, so the step reads each of its chunks in place.
        group_states = [self._group_states(g) for g in optimizer.param_groups]
        sizes = [sum(s.layout.partition_numel for s in states) for states in group_states]
        largest = 0 if plan.zero.offload_optimizer.enabled else max(sizes, default=0)
        self._step_chunk_numel = step_chunk_numel(plan.precision.master_dtype, largest)
        # [Note: zero3-master]: with the master on the compute device, the parameters' shards are views of it.
        self._from_master = plan.zero.shards_are_master_views
        self.groups = [
            self._build_group(g, states) for g, states in zip(optimizer.param_groups, group_states, strict=True)
        ]
        if any(grp.master.data.device.type != "cpu" for grp in self.groups):
            # Building the masters freed blocks of many sizes (the 16-bit shards a master view replaced, the
            # conversion temporaries): hand them back once, so that training starts with reserved memory equal
            # to what is allocated ([Note: zero3-init]).
            get_accelerator().empty_cache()
        return bucket_bytes

    def _parked_grads(self) -> ParkedGrads:
        """The parked-gradient store over this optimizer's groups and host transfers ([Note: parked grads])."""
        return ParkedGrads(
            lambda g: self.groups[g].master.data,
            lambda g: self.groups[g].ensure_accumulator(),
            self.host.submit_direct,
            self.host.drain,
            self.plan.precision.grad_accum_dtype,
            restore=self._send_to_shard,
            pinning=pinning_of(self.plan) if get_accelerator().device_name() != "cpu" else Pinning.PAGEABLE,
        )

    def _send_to_shard(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        """Write host master ``values`` into the device ``shard`` through two page-locked buffers, converting one
        step chunk at a time while the previous one is in flight (as the write-back does)."""
        send_through_host(values, shard.dtype, shard.device, self._step_chunk_numel, writer_into(shard))

    def _build_reduction(self) -> None:
        """Decide how full gradients are released and bucketed, and build the reducer: reduce-scatter buckets
        whose rows fold into the group shards."""
        plan, precision = self.plan, self.plan.precision
        self.eager_release = plan.zero.lean.eager_grad_release
        release = GradRelease.EAGER if self.eager_release else GradRelease.ZEROED
        # lean_unit_grad_reduce: one reduce-scatter per fetch unit, closed when the unit's backward is done; its
        # rows in shard order fold as one piece unless the fold is the per-region offload path.
        self.unit_grad_reduce = plan.zero.lean.unit_grad_reduce and self.world_size > 1
        rows = ShardRows(
            self.world_size,
            precision.comm_dtype,
            self.scaling,
            release,
            self._fold,
            self.dp_group,
            FoldOrder.CONTIGUOUS
            if self.unit_grad_reduce and not plan.zero.offload_optimizer.enabled
            else FoldOrder.PER_ENTRY,
        )
        self.reducer = GradReducer(
            rows,
            ReducerConfig(
                ReduceMode.REDUCE_SCATTER,
                plan.zero.buckets.reduce_bucket_size,
                precision.comm_dtype,
                self.scaling,
                max_in_flight=2 if plan.zero.buckets.overlap_comm else 1,
                unit_buckets=self.unit_grad_reduce,
            ),
        )

    @staticmethod
    def _group_states(param_group: dict) -> list[ZeroParam]:
        """The trainable parameters' states of one optimizer group, each once, in group order."""
        states, seen = [], set()
        for p in param_group["params"]:
            state = zero_state(p)
            if state is None:
                raise ValueError("ZeRO-3 needs every optimized parameter partitioned by the parameter manager")
            if p.requires_grad and state.ds_id not in seen:
                seen.add(state.ds_id)
                states.append(state)
        return states

    def _build_group(self, param_group: dict, states: list[ZeroParam]) -> Stage3Group:
        offsets, total = [], 0
        for s in states:
            offsets.append(total)
            total += s.layout.partition_numel
        offload = self.plan.zero.offload_optimizer
        device = torch.device("cpu") if offload.enabled else (states[0].shard.device if states else "cpu")
        # Offloaded masters stay pageable even with pin_memory: the CPU optimizer does not need page-locked
        # memory, and pinning a model-sized tensor costs up to twice its size ([Note: pinned ring]).
        # pin_memory governs the fixed staging slots and the gradient chunks instead: those are power-of-two
        # sized (step_chunk_numel), and a reduced gradient's first fold is copied straight into them.
        pinned = offload.enabled and offload.pin_memory and get_accelerator().device_name() != "cpu"
        master = MasterShard.of_shards(states, self.plan.precision.master_dtype, device, self._step_chunk_numel)
        if self._from_master:
            # [Note: zero3-master]: a partitioned parameter's shard becomes its master slice; the write-back then
            # skips it. Persistent ones stay gathered between uses and keep their own shard (refreshed after
            # each step); so does one gathered right now (a GatheredParameters block around the engine's build).
            for state, off in zip(states, offsets, strict=True):
                if not state.is_persistent and state.state is ShardedState.SHARDED and not state.holds_gradient:
                    state.adopt_master_shard(master.data.narrow(0, off, state.layout.partition_numel))
        param_group["params"] = [master.param]
        return Stage3Group(
            states,
            offsets,
            master,
            self._step_chunk_numel,
            self.plan.precision.grad_accum_dtype,
            keep_storage=offload.enabled,
            pin_memory=pinned,
            direct_first_fold=pinned,
        )

    def _plan_early_step(self) -> None:
        """[Note: final gradient count]: which step chunks hold which parameters' shards; counted and armed per
        boundary in prepare_backward."""
        regions = [
            RegionSpan(s.ds_id, g, Range(off, off + s.layout.partition_numel))
            for g, grp in enumerate(self.groups)
            for s, off in zip(grp.states, grp.offsets, strict=True)
        ]
        self._arrivals = ArrivalRecord(regions, [g.master.numel() for g in self.groups], self._step_chunk_numel)
        self._early = EarlyUpdate(self.host_step, self._early_groups) if self.host_step is not None else None
        self._early_grads: list[FixedChunkGrads] = []
        self._early_refused = False  # a backward contradicted a chunk already submitted: never again
        self.parked.on_stored = self._on_stored
        self.parked.on_move = self._on_parked_move

    @property
    def early_chunks(self) -> int:
        """For tests: chunks handed to the host worker before the backward ended ([Note: early host step])."""
        return 0 if self._early is None else self._early.chunks

    def steps_during_backward(self) -> bool:
        """Whether an offloaded update may start while the boundary backward runs ([Note: early host step]): the
        overlapped host step is on and nothing needs the global gradient norm before a chunk may change (no
        ``gradient_clipping``, no fp16 loss scale, no bf16 overflow check)."""
        return (
            self.host_step is not None
            and not self._early_refused
            and needs_no_norm(self.plan, self.loss_scaler, self.check_overflow)
        )

    # --- gradients ----------------------------------------------------------------------------------
    def prepare_backward(self, kind: MicroStepKind) -> None:
        """ZeRO-3 reduces every micro-step; the boundary backward counts each parameter's gradient arrivals and,
        with a record of them, starts the update of the chunks that are final ([Note: final gradient count])."""
        counting = kind is MicroStepKind.REDUCE and self.steps_during_backward()
        if self._early is not None:
            self._early.arm(counting and self._arrivals.record is not None)
        if counting:
            self._arrivals.begin()

    def _on_grad(self, param: torch.nn.Parameter, state: ZeroParam, grad: torch.Tensor | None) -> None:
        # ``grad`` is param.grad, or one routed use's gradient ([Note: routed grads]); a tied parameter arrives
        # once per use, and its entries fold into the same accumulator region, adding up.
        region = None if state is None else self.index.get(state.ds_id)
        if region is None or grad is None:
            return
        g, off = region.group, region.offset
        borrowed = grad is not param.grad
        if self.eager_release:
            param.grad = None  # the bucket holds the only reference until its staging copy
        self.reducer.add(RowEntry(grad, state, g, off, borrowed), state.layout.padded_numel)

    def _fold(self, group_index: int, offset: int, piece: torch.Tensor) -> None:
        """Add a reduced gradient piece into group ``group_index``'s accumulator at ``offset`` (or park a region's
        first piece in its parameter's shard: [Note: parked grads]); in a counted backward, one arrival of its
        parameter ([Note: final gradient count])."""
        if not self._arrivals.active:
            self._fold_piece(group_index, offset, piece)
            return
        state = self.index.at(group_index, offset).state
        self._refuse_late(state, self._arrivals.late(state.ds_id), "received another gradient")
        self._fold_piece(group_index, offset, piece)
        self._submit_early(self._arrivals.arrive(state.ds_id, landed=not self.parked.waiting(state)))

    def _on_stored(self, state: ZeroParam) -> None:
        """A gradient held until its parameter's release is in place: its chunks may be final now."""
        self._submit_early(self._arrivals.landed(state.ds_id))

    def _on_parked_move(self, state: ZeroParam) -> None:
        """A parked gradient is about to move (a read, or another use gathering the parameter): during the
        backward, a chunk already submitted holding it is refused; after it, the move waits for those chunks."""
        sent = [c for c in self._arrivals.chunks_of.get(state.ds_id, []) if c in self._arrivals.sent]
        if not sent or self._early is None or self._early.run is None:
            return
        if self._arrivals.active:
            self._refuse_late(state, self._arrivals.disturbed(state.ds_id), "was gathered or read again")
        self._early.run.wait()  # the chunk's update has read the parked gradient: it may move now

    def _refuse_late(self, state: ZeroParam, chunks: list[ChunkKey], what: str) -> None:
        """A gradient that a chunk already submitted has read changed: no update can be exact any more."""
        if not chunks:
            return
        self._early_refused = True
        self._arrivals.stop()
        if self._early is not None:
            self._early.arm(False)  # waits for the submitted chunks; step() then takes nothing over
        shape = tuple(state.param.shape) if state.param is not None else "?"
        raise RuntimeError(
            f"ZeRO-3 parameter ds_id={state.ds_id} (shape {shape}) {what} after the update of its step chunks "
            f"{[c[1:] for c in chunks]} (group {chunks[0][0]}) had started during the backward: its gradient "
            "arrivals differ from those recorded in the first step. This rank's optimizer state has taken an "
            "incomplete gradient; restart from a checkpoint with zero_optimization.lean_overlap_offload_step "
            "false, or gradient_clipping > 0, for a model whose parameters are used a varying number of times"
        )

    def _submit_early(self, ready: list[ChunkKey]) -> None:
        """Hand chunks whose gradients are final and landed to the host worker, each with its gradient fixed now
        (the parked shards it holds) and an event for the device-resident ones."""
        if not ready or self._early is None or not self._early.armed:
            return
        self.host.drain()  # the chunks' host copies must have landed before they are read
        self._early.open()
        event = record_current()
        for g, start, end in ready:
            self._early_grads[g].fix(start, self._chunk_grad(g, start, end), event)
        self._early.submit(ready)

    def _early_groups(self) -> list[GroupStep]:
        """Every group's share of an update started early; each chunk reads the gradient fixed at its submission."""
        self._early_grads = [FixedChunkGrads() for _ in self.groups]
        steps = []
        for index, grp in enumerate(self.groups):
            stepper = ChunkStepper(self.optimizer, index, self._step_chunk_numel)
            dtype = grp.states[0].shard.dtype if grp.states else self.plan.precision.param_dtype
            steps.append(GroupStep(stepper, self._early_grads[index], grp.master.writer.publish, dtype))
        return steps

    def _fold_piece(self, group_index: int, offset: int, piece: torch.Tensor) -> None:
        if self._park:
            state = self.index.at(group_index, offset).state
            if self.parked.add_in_place(state, piece):
                return  # a second fold into a region parked in its shard on this device adds there
            self.parked.evict(state)  # any other second fold: the accumulator becomes the region's home
            if (group_index, offset) not in self._folded and self.parked.can_park(state, piece):
                self._folded.add((group_index, offset))
                self.parked.park(state, group_index, offset, piece)
                return
        acc = self.groups[group_index].ensure_accumulator()
        if acc.device == piece.device and self.host.staging is not Staging.ALWAYS:
            acc.add_(offset, piece)
            return
        # Optimizer offload. A region's first fold of the window lands in zeros, so into page-locked chunks it
        # is a plain asynchronous copy; later folds add through the pinned ring (flush() waits for both).
        direct = (
            self.groups[group_index].direct_first_fold
            and piece.dtype == acc.dtype
            and (group_index, offset) not in self._folded
        )
        self._folded.add((group_index, offset))
        for pos, target in acc.pieces(offset, piece.numel()):
            if direct:
                self.host.submit_direct(target, piece[pos : pos + target.numel()])
            else:
                self.host.submit(target, piece[pos : pos + target.numel()], Fold.ADD)

    def read_window_grad(self, region: Region, size: int) -> torch.Tensor | None:
        """The first ``size`` elements of ``region``'s gradient in this window (``None`` outside one)."""
        self.parked.evict(region.state)  # a gradient parked in the parameter's shard moves to the accumulator
        acc = self.groups[region.group].window_grad()
        return None if acc is None else acc.read(region.offset, size)

    def write_window_grad(self, region: Region, values: torch.Tensor) -> None:
        """Overwrite the start of ``region``'s gradient in this window with the 1-D ``values``."""
        if self._early is not None and self._early.run is not None:  # [Note: final gradient count]
            sent = [c for c in self._arrivals.chunks_of.get(region.state.ds_id, []) if c in self._arrivals.sent]
            self._refuse_late(region.state, sent, "had its gradient set")
        self.parked.evict(region.state)
        self.groups[region.group].ensure_accumulator().write(region.offset, values)
        # A later fold of this window must add to the written values, not copy over them.
        self._folded.add((region.group, region.offset))

    def flush(self) -> None:
        """End of backward: reduce the partial bucket and fold every pending result."""
        self.reducer.finish()
        self.parked.settle()
        self.host.drain()
        self._arrivals.end()

    def finish_backward(self) -> None:
        """Nothing left to do: the parameter manager calls :meth:`flush` at the end of each backward."""

    # --- step ---------------------------------------------------------------------------------------
    def step(self, closure: Any = None) -> bool:
        """Overflow check and global norm (one all-reduce), unscale and clip, inner step, shards written back."""
        try:
            return self._timed_step()
        finally:
            self.log_timers(self.step_timers)

    def _timed_step(self) -> bool:
        self.flush()
        accs = [chunk for grp in self.groups if grp.accumulator is not None for chunk in grp.accumulator.allocated()]
        # The scalar is reduced on the compute device, where the gathered parameters live.
        sq = local_sq_norm(accs + self.parked.tensors())
        sq = sq.to(self.groups[0].states[0].full.device)
        on_device = self._device_step(sq, {g.master.device for g in self.groups})
        if on_device is not None:  # [Note: device step]
            applied = self._run_device_step(on_device, self._state_update)
            self._clear_grads()
            return applied
        decision = self._decide_step(sq)
        self.overflow = decision.overflow
        if decision.overflow:
            return self._skip_step()
        self._global_grad_norm = decision.norm
        self._state_update(decision.coef)
        self._clear_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        return True

    def _state_update(self, coef: Coef) -> None:
        """:meth:`_update`; the first one creates the inner optimizer's state, so it is also timed (and printed once,
        with ``wall_clock_breakdown``) as ``init_optimizer_state``, the name upstream gives to creating that state."""
        if self._states_created:
            self._update(coef)
            return
        with self.timed(INIT_OPTIMIZER_TIMER):
            self._update(coef)
        self._states_created = True
        self.log_timers([INIT_OPTIMIZER_TIMER])

    def _update(self, coef: Coef) -> None:
        """Step every group with gradients scaled by ``coef``, then publish the new weights."""
        if self.host_step is not None:
            self._overlapped_update(coef)
            return
        with self.timed(OPTIMIZER_STEP_TIMER):
            for index, grp in enumerate(self.groups):
                self._step_group(index, grp, coef)
        self.write_back()
        self.parked.forget()  # the write-back replaced every parked gradient with the new values

    def _overlapped_update(self, coef: Coef) -> None:
        """:meth:`_update` with the host step overlapped with the write-back ([Note: overlapped host step])."""
        assert self.host_step is not None
        if self.plan.zero.offload_param.enabled:
            self.manager.gatherer.sync_shard_reads()  # as write_back(): a copy-in may still read the host shards
        if self._early is not None and self._early.armed:  # [Note: early host step]: some chunks may be stepped
            run = self._early.take(coef)
            for index, grp in enumerate(self.groups):
                self._early_grads[index].rest = self._group_grad(index, grp)
            try:
                with self.timed(OPTIMIZER_STEP_TIMER):
                    run.submit_rest()
                    run.publish()
            finally:
                self._early_grads = []
                self._release_window_buffers()
        else:
            self._synchronous_order_update(coef)
        self.manager.refresh_persistent()
        self.parked.forget()  # the write-back replaced every parked gradient with the new values

    def _synchronous_order_update(self, coef: Coef) -> None:
        """Every chunk stepped in order on this thread, each published as soon as it is stepped ([Note: update after
        the decision])."""
        assert self.host_step is not None
        steps = []
        for index, grp in enumerate(self.groups):
            stepper = ChunkStepper(self.optimizer, index, self._step_chunk_numel)
            dtype = grp.states[0].shard.dtype if grp.states else self.plan.precision.param_dtype
            steps.append(GroupStep(stepper, self._group_grad(index, grp), grp.master.writer.publish, dtype, True))
        try:
            with self.timed(OPTIMIZER_STEP_TIMER):  # the write-back overlaps the step: both count here
                self.host_step.run(steps, coef)
        finally:
            steps.clear()
            self._release_window_buffers()

    def _group_grad(self, index: int, grp: Stage3Group) -> Any:
        """Group ``index``'s gradient for the step: its accumulator, or with parked regions a window over both."""
        return self._parked_window(grp, self.parked.in_group(index))

    def _chunk_grad(self, index: int, start: int, end: int) -> Any:
        """Group ``index``'s gradient as chunk ``[start, end)`` reads it: the parked regions overlapping it (final,
        so fixed from now on) over the accumulator ([Note: final gradient count])."""
        regions = [r for r in self.parked.in_group(index) if r.offset < end and r.offset + r.grad().numel() > start]
        return self._parked_window(self.groups[index], regions)

    def _parked_window(self, grp: Stage3Group, regions: list) -> Any:
        """The accumulator, or with ``regions`` a :class:`ParkedWindow` over both."""
        acc = grp.ensure_accumulator()
        if not regions:
            return acc
        bufs = self._window_buffers
        if not bufs or bufs[0].dtype != acc.dtype or bufs[0].device != grp.master.device:
            self._release_window_buffers()
            if grp.master.device.type == "cpu":
                # Page-locked from the pool ([Note: pinned pool]): the parked shards are read into them chunk by chunk.
                bufs = [self.pinned.acquire(self._step_chunk_numel, acc.dtype) for _ in range(2)]
            else:
                width, device = self._step_chunk_numel, grp.master.device
                bufs = [torch.empty(width, dtype=acc.dtype, device=device) for _ in range(2)]
            self._window_buffers = bufs
        return ParkedWindow(acc, regions, bufs, self._step_chunk_numel, grp.master.numel())

    def _release_window_buffers(self) -> None:
        """Give the parked-gradient windows back to the pool (the step that needed them is over)."""
        for buf in self._window_buffers:
            self.pinned.release(buf)
        self._window_buffers = []

    def _step_group(self, index: int, grp: Stage3Group, coef: Coef) -> None:
        """Update one group's master, one gradient chunk at a time; groups step one at a time so no other
        master holds a gradient. The shard is dropped after the step, so its chunks are consumed in place."""
        grad = self._group_grad(index, grp)
        try:
            step_in_chunks(self.optimizer, index, grad, self._step_chunk_numel, coef, consume=True)
        finally:
            if index == len(self.groups) - 1:
                self._release_window_buffers()

    def write_back(self) -> None:
        """Copy the fp32 masters into the parameters' shards and re-gather persistent parameters.

        Each master's writer is a :class:`~deepspeed._core.optim.master.ScatterWriteBack`.
        """
        if self.plan.zero.offload_param.enabled:
            # The shards are host memory that a copy-in on the all-gather stream may still be reading
            # ([Note: zero3-offload]); a host write must wait for it, a stream-ordered copy need not.
            self.manager.gatherer.sync_shard_reads()
        for grp in self.groups:
            grp.master.write_back()
        self.manager.refresh_persistent()

    # --- checkpoints (interface: deepspeed._core.checkpoint.save_load.ShardedCheckpointOptimizer) -------
    def checkpoint_param_groups(self) -> list[list[torch.nn.Parameter]]:
        """Trainable parameters per group in flat order (checkpoint ``param_shapes``)."""
        return [[s.param for s in grp.states] for grp in self.groups]

    def checkpoint_event_prologue(self) -> None:
        """Make parameters partitioned and quiescent before a save or load."""
        self.manager.release_all()

    def refresh_fp32_params(self) -> None:
        """Rebuild the masters from the parameters' current shards (after a module-only load); a shard that is a
        master view already is the master."""
        # A persistent parameter stays gathered, and a module load writes its gathered values, not its shard.
        kept = [s for grp in self.groups for s in grp.states if s.is_persistent and s.state is ShardedState.FULL]
        self.manager.gatherer.commit(kept)
        for grp in self.groups:
            grp.master.refresh()

    def rebind_master_views(self) -> None:
        """Point every master-view shard at its group's current master tensor (after the master's ``.data`` moved,
        e.g. ``offload_states``/``reload_states``): the views would otherwise keep the old storage alive."""
        for grp in self.groups:
            for state, off in zip(grp.states, grp.offsets, strict=True):
                if state.shard_is_master:
                    state.adopt_master_shard(grp.master.data.narrow(0, off, state.layout.partition_numel))

    def host_grad_bytes(self) -> int:
        """Host gradient chunks (offloaded optimizer), kept storage included; parked gradients use none."""
        return sum(
            g.accumulator.storage_numel * g.accumulator.dtype.itemsize
            for g in self.groups
            if g.accumulator is not None and g.accumulator.device.type == "cpu"
        )

    def _clear_grads(self) -> None:
        self.parked.restore_all()  # skip or zero_grad: parked shards get their values back (no-op after a step)
        self._folded.clear()
        for grp in self.groups:
            grp.master.param.grad = None
            grp.end_window()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this window's gradient shards and any in-flight bucket (and an update started early that no step
        took over)."""
        if self._early is not None:
            self._early.arm(False)
        self._arrivals.stop()
        self.reducer.discard()
        self.host.discard()
        self._clear_grads()
        for grp in self.groups:
            for state in grp.states:
                p = state.param
                if p is not None:
                    p.grad = None

    def destroy(self) -> None:
        """Unsubscribe from the parameter manager, remove its hooks and drop gradient buffers."""
        for handle in self._subscriptions:
            handle.remove()
        self.zero_grad()  # every parked shard gets its values back first
        self.parked.let_go([s for grp in self.groups for s in grp.states])
        self.host.release()
        if self.host_step is not None:
            self.host_step.shutdown()
        self.pinned.clear()
        for grp in self.groups:
            for state in grp.states:
                if state.param is not None and getattr(state.param, "_z3_optimizer", None) is self:
                    del state.param._z3_optimizer
        self.manager.destroy()

    def live_grad_buffers(self) -> dict[str, int]:
        """Gradient buffers alive now: autograd ``.grad`` of managed params, accumulators, buckets."""
        params = [s.param for grp in self.groups for s in grp.states]
        return {
            "param_grads": sum(p is not None and p.grad is not None for p in params),
            "accumulators": sum(grp.window_grad() is not None for grp in self.groups),
            "bucketed_grads": len(self.reducer.open.entries),
            "in_flight": self.reducer.in_flight,
            "parked": len(self.parked),
        }
