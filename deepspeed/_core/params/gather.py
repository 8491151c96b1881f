"""Fetch units: the parameters of one module, gathered and released together.

Two objects live here. :class:`Gatherer` owns the mechanics shared by every caller (module hooks, prefetch,
``GatheredParameters``, ``param.all_gather()``): partitioning a parameter, split-phase gathers
(:meth:`Gatherer.start_gather` / :meth:`Gatherer.finish_gather`) and releasing gathered storage in one
of two :class:`ReleaseMode` s. :class:`FetchUnit` is one module's parameters with a use count, driven by the
manager through ``unshard`` / ``wait_for_unshard`` / ``reshard``.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepspeed._core.comm.codec import IDENTITY_CODEC, ShardCodec
from deepspeed._core.comm.collectives import (
    AllGatherResult,
    finish_all_gather,
    start_all_gather,
)
from deepspeed._core.comm.streams import (
    DeferredFreeQueue,
    Handoff,
    StreamRole,
    StreamSet,
)
from deepspeed._core.layout.flat_buffer import alloc_storage, free_storage
from deepspeed._core.layout.shards import Stage3ParamLayout
from deepspeed._core.params.param import (
    FullStorage,
    ShardedState,
    ShardGroup,
    ZeroParam,
    attach_ds_view,
    placeholder,
    zero_state,
)
from deepspeed._core.params.placement import ShardPlacement, allocate_shard
from deepspeed._core.params.swap import ParamSwapper

_DS_IDS = itertools.count()


def next_ds_id() -> int:
    """A new parameter id; ranks that build the same model in the same order draw the same ids."""
    return next(_DS_IDS)


@dataclass(frozen=True)
class ParamTarget:
    """Where and in which dtype a parameter built outside ``zero.Init`` is computed once partitioned.

    ``None`` keeps the parameter's own device / dtype. Only floating-point parameters change dtype. Partitioning
    copies (and casts) the local slice straight from wherever the full values lie into the shard, so a model
    built on the host reaches the device shard by shard, never whole ([Note: zero3-init]).
    """

    device: torch.device | None = None
    dtype: torch.dtype | None = None

    def device_of(self, data: torch.Tensor) -> torch.device:
        """The compute device for ``data``."""
        return data.device if self.device is None else self.device

    def dtype_of(self, data: torch.Tensor) -> torch.dtype:
        """The working dtype for ``data``."""
        return data.dtype if self.dtype is None or not data.is_floating_point() else self.dtype


class ReleaseMode(enum.Enum):
    """How gathered storage goes back to the allocator ([Note: streams-release]).

    ``STREAM_ORDERED``: gathered storage is allocated and freed on the compute stream at the point of last use
    (lean mechanism 3). ``DEFERRED``: allocated on the all-gather stream and freed only once an event recorded at
    release time has completed -- the effect of upstream's cross-stream recording; kept as the A/B baseline.
    """

    STREAM_ORDERED = "stream_ordered"
    DEFERRED = "deferred"


class PendingGather:
    """One issued collective and the states it will fill."""

    def __init__(self, result: AllGatherResult, states: list[ZeroParam]) -> None:
        """Pair ``result`` with ``states`` (already marked GATHERING by the caller)."""
        self.result: AllGatherResult | None = result
        self.states = states


def _group_key(state: ZeroParam) -> tuple:
    # The working dtype, not the shard's: fp32 master-view shards and 16-bit shards travel in one collective
    # ([Note: zero3-master]).
    return (state.full.dtype, state.shard.device, state.full.device, state.group)


class Gatherer:
    """Partition, gather and release parameters; implements :class:`~deepspeed._core.params.param.ParamGatherer`."""

    def __init__(
        self,
        streams: StreamSet,
        codec: ShardCodec = IDENTITY_CODEC,
        release_mode: ReleaseMode = ReleaseMode.STREAM_ORDERED,
        placement: ShardPlacement | None = None,
        single_rank: FullStorage = FullStorage.SHARD,
    ) -> None:
        """Use ``streams`` for collectives and copies, ``codec`` for the wire format, ``placement`` for shards;
        ``single_rank`` says whether one-rank parameters gather into their shard (``SHARD``, where it can hold)."""
        self.streams = streams
        self.codec = codec
        self.release_mode = release_mode
        self.single_rank = single_rank
        self.placement = placement if placement is not None else ShardPlacement()
        self.deferred = DeferredFreeQueue()
        # Lean release takes flat all-gather buffers from the compute stream's pool and frees each right after
        # its copy-out; the A/B baseline allocates them on the all-gather stream and keeps one until the next.
        self._flat_role = StreamRole.COMPUTE if release_mode is ReleaseMode.STREAM_ORDERED else StreamRole.ALL_GATHER
        self._flat: Handoff | None = None
        self._last_copy_in: Any = None
        # offload_param.device nvme: the partitions live in swap files ([Note: nvme params] in swap.py); set by
        # the manager before it partitions anything.
        self.swapper: ParamSwapper | None = None

    # ---------------------------------------------------------------- partitioning
    def shard_request(
        self, param: nn.Parameter, group: ShardGroup, target: ParamTarget = ParamTarget()
    ) -> tuple[int, torch.dtype, torch.device]:
        """``(numel, dtype, device)`` of the shard :meth:`partition` would allocate for ``param``."""
        data = param.data
        numel = Stage3ParamLayout(data.numel(), group.world_size).partition_numel
        return numel, target.dtype_of(data), self.placement.shard_device(target.device_of(data))

    def partition(
        self,
        param: nn.Parameter,
        group: ShardGroup,
        ds_id: int | None = None,
        target: ParamTarget = ParamTarget(),
        shard: torch.Tensor | None = None,
    ) -> ZeroParam:
        """Turn ``param`` into a partitioned parameter (no-op for one that already is); frees its full data.

        ``target`` names the compute device and working dtype; the full values may lie anywhere (host memory
        included): only this rank's slice is copied, cast on the way, into the new shard. ``shard`` is a zeroed
        tensor matching :meth:`shard_request` to use instead of a fresh one ([Note: shard arena]).
        """
        existing = zero_state(param)
        if existing is not None:
            return existing
        data = param.data
        device, dtype = target.device_of(data), target.dtype_of(data)
        layout = Stage3ParamLayout(data.numel(), group.world_size)
        if shard is None:
            shard = allocate_shard(layout.partition_numel, dtype, device, self.placement)
        elif (shard.numel(), shard.dtype, shard.device) != self.shard_request(param, group, target):
            raise ValueError(f"a preallocated shard {tuple(shard.shape)} {shard.dtype} does not fit this parameter")
        shard.ds_numel = layout.partition_numel  # type: ignore[attr-defined]  # upstream readers: ds_tensor.ds_numel
        # One rank, lean release, plain codec: the gathered tensor can be the shard itself (ZeroParam checks
        # the rest: shard on the compute device, no padding). The upstream-like A/B mode keeps separate copies.
        storage = (
            self.single_rank
            if (
                self.release_mode is ReleaseMode.STREAM_ORDERED
                and self.codec is IDENTITY_CODEC
                and self.swapper is None  # a swapped shard is not in memory to be gathered into
            )
            else FullStorage.SEPARATE
        )
        state = ZeroParam(
            param, next_ds_id() if ds_id is None else ds_id, group, shard, data.shape, device, self, storage
        )
        state.write_shard_from(data)
        attach_ds_view(param, state)
        param.data = placeholder(state.full)
        if self.swapper is not None:
            self.swapper.adopt(state)
        return state

    # ---------------------------------------------------------------- split-phase gather
    def start_gather(self, states: Sequence[ZeroParam]) -> None:
        """Issue all-gathers for the ``SHARDED`` states (one collective per dtype/device/group)."""
        batches: dict[tuple, list[ZeroParam]] = {}
        seen: set[int] = set()
        for state in states:
            state.restore_values()  # a gradient parked in the shard moves out first ([Note: parked grads])
            if state.state is ShardedState.SHARDED and state.ds_id not in seen:
                seen.add(state.ds_id)
                batches.setdefault(_group_key(state), []).append(state)
        for batch in batches.values():
            for piece in self._pieces(batch):
                self._start_piece(piece)

    def _pieces(self, batch: list[ZeroParam]) -> list[list[ZeroParam]]:
        """``batch`` split so that no piece needs more swap buffers than there are ([Note: nvme params]); the
        split depends only on which partitions are swapped, the same on every rank."""
        if self.swapper is None:
            return [batch]
        pieces: list[list[ZeroParam]] = [[]]
        swapped = 0
        for state in batch:
            if state.swapped and swapped == self.swapper.capacity:
                pieces.append([])
                swapped = 0
            pieces[-1].append(state)
            swapped += state.swapped
        return pieces

    def _swap_in(self, batch: list[ZeroParam]) -> list[ZeroParam]:
        swapped = [s for s in batch if s.swapped]
        if swapped:
            assert self.swapper is not None
            self.swapper.swap_in(swapped)
        return swapped

    def _start_piece(self, batch: list[ZeroParam]) -> None:
        self._swap_in(batch)
        result = self._issue(batch)
        self._last_copy_in = result.event
        pending = PendingGather(result, batch)
        for state in batch:
            state.mark_gathering(pending)

    def finish_gather(self, states: Sequence[ZeroParam]) -> None:
        """Complete every collective that a ``GATHERING`` state in ``states`` waits on."""
        seen: set[int] = set()
        for state in states:
            pending = state.pending
            if state.state is ShardedState.GATHERING and id(pending) not in seen:
                seen.add(id(pending))
                self._copy_out(pending)

    def _issue(self, batch: Sequence[ZeroParam]) -> AllGatherResult:
        """Start one all-gather of ``batch``'s shards (one dtype, device and group)."""
        self._retire_flat()
        return start_all_gather(
            [s.shard for s in batch],
            [s.numel for s in batch],
            batch[0].group,
            self.streams,
            self.codec,
            batch[0].full.device,
            self._flat_role,
            dtype=batch[0].full.dtype,
        )

    @property
    def _copy_role(self) -> StreamRole:
        return StreamRole.COMPUTE if self.release_mode is ReleaseMode.STREAM_ORDERED else StreamRole.ALL_GATHER

    def _finish(self, result: AllGatherResult, outputs: Sequence[torch.Tensor]) -> Any:
        """Copy ``result`` out into ``outputs`` and hand its flat buffer back in stream order; returns the event
        after the copy-out."""
        done = finish_all_gather(result, outputs, self.streams, self._copy_role, self.codec)
        if self._flat_role is StreamRole.ALL_GATHER:
            self._retire_flat()
            self._flat = Handoff(result.flat, done, StreamRole.ALL_GATHER)
        # STREAM_ORDERED: the flat buffer came from the compute pool and the copy-out that last read it is
        # queued on the compute stream, so dropping it here is already stream-ordered ([Note: streams-flat]).
        result.flat = None
        return done

    def _copy_out(self, pending: PendingGather) -> None:
        with self.streams.use(self._copy_role):
            for state in pending.states:
                # DEFERRED: a cancelled free may have left the storage allocated; reuse it as is.
                if not state.holds_memory and not state.aliases_shard:
                    alloc_storage(state.full)
        result = pending.result
        assert result is not None, "pending gather finished twice"
        done = self._finish(result, [s.full for s in pending.states])
        pending.result = None
        self._swap_release(pending.states, done)
        for state in pending.states:
            state.mark_full()

    def _swap_release(self, states: Sequence[ZeroParam], done: Any) -> None:
        if self.swapper is not None:
            swapped = [s for s in states if s.swapped]
            if swapped:
                self.swapper.release(swapped, done)

    def refresh(self, states: Sequence[ZeroParam]) -> None:
        """Rewrite every ``FULL`` state's gathered values from its shard, in the storage it holds (after the
        optimizer rewrote the shards of persistent parameters): one all-gather per batch straight into the
        gathered tensors, no release and re-allocation of each. Other states are gathered as usual."""
        batches: dict[tuple, list[ZeroParam]] = {}
        rest: list[ZeroParam] = []
        seen: set[int] = set()
        for state in states:
            if state.ds_id in seen:
                continue
            seen.add(state.ds_id)
            state.restore_values()
            if state.state is not ShardedState.FULL:
                rest.append(state)
            elif not state.aliases_shard:  # a gathered tensor that is the shard holds the new values already
                batches.setdefault(_group_key(state), []).append(state)
        for batch in batches.values():
            for piece in self._pieces(batch):
                swapped = self._swap_in(piece)
                done = self._finish(self._issue(piece), [s.full for s in piece])
                self._swap_release(swapped, done)
        if rest:
            self.gather(rest)

    def _retire_flat(self) -> None:
        # [Note: streams-flat]: the previous flat buffer is dropped once the all-gather stream is ordered after
        # the copy-out that read it, so the allocator reuses it only for later work on that stream.
        if self._flat is not None:
            self._flat.release(self.streams)
            self._flat = None

    def gather(self, states: Sequence[ZeroParam]) -> None:
        """Bring every state to ``FULL`` now (``ParamGatherer``)."""
        self.cancel_pending_frees(states)
        self.start_gather(states)
        self.finish_gather(states)

    def cancel_pending_frees(self, states: Sequence[ZeroParam]) -> None:
        """DEFERRED mode: keep storage whose free has not run yet, since it is about to be refilled."""
        if len(self.deferred):
            for state in states:
                if state.state is ShardedState.SHARDED:
                    self.deferred.cancel(state.ds_id)

    # ---------------------------------------------------------------- release
    def release(self, states: Sequence[ZeroParam]) -> None:
        """Release every ``FULL`` state that no module or context uses and that is not persistent."""
        for state in states:
            if state.state is ShardedState.FULL and not state.in_use and not state.is_persistent:
                self.free(state)

    def free(self, state: ZeroParam) -> None:
        """FULL -> SHARDED and give the gathered storage back according to :attr:`release_mode`."""
        state.mark_sharded()  # a gradient waiting for this release moves into the shard ([Note: parked grads])
        if state.aliases_shard:
            return  # the gathered tensor is the shard: nothing to give back
        if self.release_mode is ReleaseMode.STREAM_ORDERED:
            # [Note: streams-release]: the storage was allocated on the compute stream and its last use is
            # queued there, so freeing it now lets the allocator reuse it in stream order.
            free_storage(state.full)
            return
        event = self.streams.record(StreamRole.COMPUTE)
        full = state.full
        self.deferred.push(state.ds_id, event, lambda: free_storage(full))

    def commit(self, states: Sequence[ZeroParam]) -> None:
        """Write each ``FULL`` state's gathered values into its shard (``partition(has_been_updated=True)``)."""
        for state in states:
            if state.state is ShardedState.FULL:
                state.write_shard_from(state.full_view())

    def sync_shard_reads(self) -> None:
        """Block the host until every issued copy-in has read its shard (before a host write to offloaded shards).

        The only host wait of the parameter side; see [Note: zero3-offload].
        """
        if self._last_copy_in is not None:
            self._last_copy_in.synchronize()
            self._last_copy_in = None

    def drain(self) -> None:
        """Run the deferred frees whose events have completed (DEFERRED mode; cheap no-op otherwise)."""
        if len(self.deferred):
            self.deferred.drain()

    def shutdown(self) -> None:
        """Drop the retained flat buffer and run every deferred free (teardown); close the swap files."""
        self._retire_flat()
        self.deferred.flush()
        if self.swapper is not None:
            self.swapper.close()


class UnitState(enum.Enum):
    """Use state of a :class:`FetchUnit`."""

    IDLE = "idle"
    ACTIVE = "active"
    KEPT = "kept"


class FetchUnit:
    """The parameters one module needs, fetched and released together, with a use count.

    The count makes modules called twice, activation-checkpoint recomputation and nested fetches safe: the
    parameters go back to ``SHARDED`` only when the last user is done ([Note: zero3-hooks]).
    """

    def __init__(self, unit_id: int, name: str, gatherer: Gatherer, states_of: Callable[[], list[ZeroParam]]) -> None:
        """``states_of`` lists the unit's states at call time (external params may be registered later)."""
        self.unit_id = unit_id
        self.name = name
        self.gatherer = gatherer
        self._states_of = states_of
        self._states: list[ZeroParam] | None = None
        # Derived from _states at each refresh: the hooks ask for them several times per fetch and release.
        self._managed: list[ZeroParam] = []
        self._numel = 0
        self.refs = 0
        self.state = UnitState.IDLE

    def states(self) -> list[ZeroParam]:
        """The unit's parameter states, in registration order (as of the last :meth:`refresh`)."""
        if self._states is None:
            self.refresh()
        assert self._states is not None
        return self._states

    def refresh(self) -> None:
        """Re-read the unit's parameters (the manager calls this once per fetch: parameters may be added)."""
        states = self._states_of()
        if states is not self._states:  # the manager hands back the same list while nothing changed
            self._states = states
            self._managed = [s for s in states if not s.is_persistent]
            self._numel = sum(s.numel for s in self._managed)

    def managed_states(self) -> list[ZeroParam]:
        """The non-persistent states: what fetch and release actually move (as of the last refresh;
        persistence is decided when the manager is built)."""
        if self._states is None:
            self.refresh()
        return self._managed

    def numel(self) -> int:
        """Elements the unit's non-persistent parameters occupy when gathered."""
        if self._states is None:
            self.refresh()
        return self._numel

    def is_gathered(self) -> bool:
        """True when every non-persistent parameter is ``FULL`` or already on its way."""
        return all(s.state is not ShardedState.SHARDED for s in self.managed_states())

    def acquire(self) -> None:
        """Register one more user; the parameters now count the unit among their active modules."""
        self.refs += 1
        self.state = UnitState.ACTIVE
        for state in self.states():
            state.active_modules.add(self.unit_id)

    def drop(self) -> int:
        """Unregister one user and return how many remain."""
        assert self.refs > 0, f"unit {self.name}: released more often than fetched"
        self.refs -= 1
        if self.refs == 0:
            self.state = UnitState.IDLE
            for state in self.states():
                state.active_modules.discard(self.unit_id)
        return self.refs

    def unshard(self) -> None:
        """Issue the all-gather of the unit's sharded parameters (returns before the data is there)."""
        states = self.managed_states()
        self.gatherer.cancel_pending_frees(states)
        self.gatherer.start_gather(states)

    def wait_for_unshard(self) -> None:
        """Finish the unit's gathers; the parameters are ``FULL`` afterwards."""
        self.gatherer.finish_gather(self.managed_states())

    def keep(self) -> None:
        """Leave an unused unit gathered because it is needed again soon (prefetch budget permitting)."""
        assert self.refs == 0, f"unit {self.name}: kept while in use"
        self.state = UnitState.KEPT

    def reshard(self) -> None:
        """Release the parameters no other unit or context is using."""
        assert self.refs == 0, f"unit {self.name}: resharded while in use"
        self.state = UnitState.IDLE
        states = self.managed_states()
        self.gatherer.finish_gather(states)
        self.gatherer.release(states)
