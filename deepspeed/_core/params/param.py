"""One ZeRO-3 parameter: its shard, its gathered storage and its explicit state machine.

A :class:`ZeroParam` is the single source of truth for a partitioned ``nn.Parameter``. Its life is a transition
table ([Note: zero3-state] in ``docs/design/zero3.md``)::

    SHARDED --mark_gathering--> GATHERING --mark_full--> FULL --mark_sharded--> SHARDED

Each transition asserts the state it starts from, so a wrong-state bug fails where it happens. What the shard
itself holds is a second, smaller state (:class:`ShardContent`): the values, or between a backward and its step
the parameter's gradient ([Note: parked grads] in ``deepspeed/_core/grads/parked.py``). The upstream
``ds_*`` attributes that integrations read (``ds_id``, ``ds_status``, ``ds_tensor``, ...) are read-only
properties of :class:`ZeroParameter`, the class :func:`attach_ds_view` gives the parameter; they all read the one
state object. Gathering itself is done by whoever built the state (a :class:`ParamGatherer` passed in, so this
module never depends on the schedule code to its right).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, cast

import torch
from torch import nn

from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.layout.flat_buffer import free_storage, storage_nbytes
from deepspeed._core.layout.shards import Range, Stage3ParamLayout


class ZeroParamStatus(enum.Enum):
    """Upstream's public view of a parameter's availability."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class ZeroParamType(enum.Enum):
    """Upstream's parameter kinds; every parameter converted here is ``PARTITIONED``."""

    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


class ShardedState(enum.Enum):
    """Internal state of a :class:`ZeroParam` (the transition table in [Note: zero3-state])."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    FULL = "full"


class ShardContent(enum.Enum):
    """What a :class:`ZeroParam`'s shard holds ([Note: parked grads]).

    ``VALUES``: the parameter's values. ``GRADIENT``: this window's gradient, until its holder evicts it (the values
    are the master's, put back on eviction). ``GRADIENT_INCOMING``: still the values, but a gradient waits to move
    in when the parameter is released (one rank: the gathered tensor is the shard and the module may read it).
    """

    VALUES = "values"
    GRADIENT_INCOMING = "gradient_incoming"
    GRADIENT = "gradient"


class ShardAccess(enum.Enum):
    """What a user of a swapped shard does with it ([Note: nvme params] in ``deepspeed/_core/params/swap.py``):
    ``READ`` only reads it, ``UPDATE`` reads and changes it (written back after), ``OVERWRITE`` replaces every
    element (nothing is read first, the result is written back)."""

    READ = "read"
    UPDATE = "update"
    OVERWRITE = "overwrite"


class ShardSwap(Protocol):
    """Who keeps a shard in a swap file: it puts the shard in host memory for the duration of a use."""

    def open(self, state: ZeroParam, access: ShardAccess) -> AbstractContextManager[torch.Tensor]:
        """``state.shard`` in host memory inside the block (written back after unless ``READ``)."""


class ShardGradHolder(Protocol):
    """Who parks gradients in parameter shards; registered once per parameter (:meth:`ZeroParam.hold_grads_with`)."""

    def released(self, state: ZeroParam) -> None:
        """``state`` just returned to ``SHARDED`` with a gradient incoming: store it in the shard now."""

    def evict(self, state: ZeroParam) -> None:
        """Move the gradient out of ``state``'s shard and put the values back (ending in ``VALUES``)."""


_STATUS_OF = {
    ShardedState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
    ShardedState.GATHERING: ZeroParamStatus.INFLIGHT,
    ShardedState.FULL: ZeroParamStatus.AVAILABLE,
}


class Persistence(enum.Enum):
    """``PERSISTENT`` params stay gathered between uses (small ones, ``stage3_param_persistence_threshold``)."""

    PARTITIONED = "partitioned"
    PERSISTENT = "persistent"


class FullStorage(enum.Enum):
    """Where a parameter's gathered values live.

    ``SEPARATE``: their own storage, allocated at each gather and freed at release. ``SHARD``: one rank, the
    shard on the compute device already *is* the whole parameter, so the gathered tensor is the shard itself
    and a gather costs no memory ([Note: zero3-single-rank] in ``docs/design/zero3.md``).
    """

    SEPARATE = "separate"
    SHARD = "shard"


class ParamGatherer(Protocol):
    """What a parameter's user-facing methods (``all_gather``, ``partition``, ``item``) delegate to."""

    def gather(self, states: Sequence[ZeroParam]) -> None:
        """Bring every state to ``FULL`` (one collective for all that are ``SHARDED``)."""

    def release(self, states: Sequence[ZeroParam]) -> None:
        """Return every unused, non-persistent ``FULL`` state to ``SHARDED``."""

    def commit(self, states: Sequence[ZeroParam]) -> None:
        """Write each ``FULL`` state's gathered values back into its local shard."""

    def partition(self, param: nn.Parameter, group: ShardGroup) -> ZeroParam:
        """Partition a further parameter over ``group`` (``convert_to_zero_parameters``)."""


class ZeroParam:
    """State of one partitioned parameter.

    Attributes:
        ds_id: process-wide unique id, identical on every rank (shared params share it).
        layout: the per-parameter split (``ceil(numel / world)`` per rank, trailing ranks zero-padded).
        shard: the local partition (``ds_tensor``), 1-D, ``layout.partition_numel`` elements; in the working
            dtype, or a view of the fp32 master when :attr:`shard_is_master` ([Note: zero3-master]).
        full: 1-D ``layout.padded_numel`` gathered storage; its storage is freed (0 bytes) unless gathered, and
            the object is reused across gathers so autograd's saved views see the regathered values.
        grad_shard: the reduced gradient shard the ZeRO-3 optimizer stores (see :meth:`receive_grad_shard`).
        shard_content: what :attr:`shard` holds (:class:`ShardContent`); anyone about to read the shard calls
            :meth:`restore_values` first.
        grad_holder: who may park gradients in the shard (``None``: nobody does).
        shard_is_master: the shard is this rank's slice of the optimizer's fp32 master (:meth:`adopt_master_shard`).
    """

    def __init__(
        self,
        param: nn.Parameter,
        ds_id: int,
        group: ShardGroup,
        shard: torch.Tensor,
        shape: Sequence[int],
        device: torch.device,
        gatherer: ParamGatherer,
        storage: FullStorage = FullStorage.SEPARATE,
    ) -> None:
        """Describe ``param`` (full ``shape``, computed on ``device``) by its local ``shard``.

        The shard may live elsewhere (offloaded); the caller swaps ``param.data`` for a placeholder.
        ``storage`` ``SHARD`` is honoured only where it can hold (one rank, shard on ``device``, no padding).
        """
        self._param = weakref.ref(param)
        self.ds_id = ds_id
        self.shape = tuple(int(d) for d in shape)
        self.layout = Stage3ParamLayout(int(torch.Size(self.shape).numel()), group.world_size)
        self.group = group
        self.shard = shard
        self.storage = self._honoured(storage, shard, device)
        if self.storage is FullStorage.SHARD:
            self.full = shard
        else:
            self.full = torch.empty(self.layout.padded_numel, dtype=shard.dtype, device=device)
            free_storage(self.full)
        self.gatherer = gatherer
        self.state = ShardedState.SHARDED
        self.persistence = Persistence.PARTITIONED
        self.active_modules: set[int] = set()
        self.context_holds = 0
        self.pending: Any = None
        self.external = False
        self.grad_shard: torch.Tensor | None = None
        self.shard_content = ShardContent.VALUES
        self.grad_holder: ShardGradHolder | None = None
        self.shard_is_master = False  # the shard is a view of the optimizer's fp32 master ([Note: zero3-master])
        self.swap: ShardSwap | None = None  # set when the shard lives in a swap file ([Note: nvme params])

    def _honoured(self, storage: FullStorage, shard: torch.Tensor, device: torch.device) -> FullStorage:
        """``storage``, or ``SEPARATE`` where ``SHARD`` cannot hold (several ranks, the shard elsewhere, padding)."""
        can_share = self.group.world_size == 1 and shard.device == device
        if storage is FullStorage.SHARD and can_share and shard.numel() == self.layout.padded_numel:
            return storage
        return FullStorage.SEPARATE

    # ---------------------------------------------------------------- derived facts
    @property
    def param(self) -> nn.Parameter | None:
        """The parameter this state describes (``None`` once it has been garbage-collected)."""
        return self._param()

    @property
    def numel(self) -> int:
        """Elements of the full (unpartitioned) parameter."""
        return self.layout.numel

    @property
    def local_range(self) -> Range:
        """This rank's real (unpadded) interval of the flattened parameter."""
        return self.layout.valid_range(self.group.rank)

    @property
    def status(self) -> ZeroParamStatus:
        """Upstream's public status for the current state."""
        return _STATUS_OF[self.state]

    @property
    def is_persistent(self) -> bool:
        """True when the parameter stays gathered between uses."""
        return self.persistence is Persistence.PERSISTENT

    @property
    def in_use(self) -> bool:
        """True while a module or a ``GatheredParameters`` context needs the gathered values."""
        return bool(self.active_modules) or self.context_holds > 0

    @property
    def holds_memory(self) -> bool:
        """True when gathered storage of its own is allocated (never when the gathered tensor is the shard)."""
        return not self.aliases_shard and storage_nbytes(self.full) > 0

    @property
    def aliases_shard(self) -> bool:
        """True when the gathered tensor is the shard itself (one rank): gathers and releases move no memory."""
        return self.storage is FullStorage.SHARD

    def full_view(self) -> torch.Tensor:
        """The gathered storage shaped like the parameter (valid in ``FULL``)."""
        return self.full.narrow(0, 0, self.numel).view(self.shape)

    @property
    def swapped(self) -> bool:
        """True when the shard lives in a swap file: :attr:`shard` is then a NaN placeholder of the right size
        outside :meth:`open_shard` ([Note: nvme params])."""
        return self.swap is not None

    def open_shard(self, access: ShardAccess) -> AbstractContextManager[torch.Tensor]:
        """The shard in memory for the block (a swapped one is read in, and written back unless ``READ``)."""
        if self.swap is None:
            return nullcontext(self.shard)
        return self.swap.open(self, access)

    def read_shard(self) -> torch.Tensor:
        """A host copy of the shard's values."""
        with self.open_shard(ShardAccess.READ) as shard:
            return shard.detach().to("cpu", copy=True)

    @property
    def holds_gradient(self) -> bool:
        """True while the shard holds this window's gradient instead of the values."""
        return self.shard_content is ShardContent.GRADIENT

    def _assert_state(self, *allowed: ShardedState) -> None:
        assert self.state in allowed, f"ds_id {self.ds_id}: in state {self.state.name}, expected one of " + ", ".join(
            s.name for s in allowed
        )

    # ---------------------------------------------------------------- transitions
    def mark_gathering(self, pending: Any) -> None:
        """SHARDED -> GATHERING: ``pending`` is the in-flight collective that will fill :attr:`full`."""
        self._assert_state(ShardedState.SHARDED)
        self.state = ShardedState.GATHERING
        self.pending = pending

    def mark_full(self) -> None:
        """GATHERING -> FULL: :attr:`full` holds the values; the parameter now shows them."""
        self._assert_state(ShardedState.GATHERING)
        assert self.holds_memory or self.aliases_shard or self.numel == 0, (
            f"ds_id {self.ds_id}: FULL without gathered storage"
        )
        self.state = ShardedState.FULL
        self.pending = None
        param = self.param
        if param is not None:
            param.data = self.full_view()

    def mark_sharded(self) -> None:
        """FULL -> SHARDED: the parameter shows an empty placeholder; the caller frees :attr:`full`."""
        self._assert_state(ShardedState.FULL)
        assert not self.in_use, f"ds_id {self.ds_id}: released while in use by {self.active_modules}"
        self.state = ShardedState.SHARDED
        param = self.param
        if param is not None:
            param.data = placeholder(self.full)
        if self.shard_content is ShardContent.GRADIENT_INCOMING:
            self._holder().released(self)  # nobody reads the values now: the waiting gradient moves in

    # ---------------------------------------------------------------- shard content ([Note: parked grads])
    def hold_grads_with(self, holder: ShardGradHolder | None) -> None:
        """Register ``holder`` as the one that may park gradients in this shard (``None``: unregister)."""
        assert self.shard_content is ShardContent.VALUES, f"ds_id {self.ds_id}: holder changed while holding a gradient"
        self.grad_holder = holder

    def _holder(self) -> ShardGradHolder:
        assert self.grad_holder is not None, f"ds_id {self.ds_id}: a gradient in the shard without a holder"
        return self.grad_holder

    def mark_gradient_incoming(self) -> None:
        """VALUES -> GRADIENT_INCOMING: a gradient waits for the (gathered, shard-aliasing) parameter's release."""
        assert self.shard_content is ShardContent.VALUES, f"ds_id {self.ds_id}: shard holds {self.shard_content.name}"
        self._holder()  # only a registered holder may park here: it is the one that moves the gradient in
        self.shard_content = ShardContent.GRADIENT_INCOMING

    def mark_gradient(self) -> None:
        """VALUES or GRADIENT_INCOMING -> GRADIENT: the holder has stored this window's gradient in the shard."""
        assert self.shard_content is not ShardContent.GRADIENT, f"ds_id {self.ds_id}: gradient parked twice"
        self._holder()  # only a registered holder may park here: it is the one that evicts
        self.shard_content = ShardContent.GRADIENT

    def mark_values(self) -> None:
        """-> VALUES: the shard holds the values again (restored or rewritten), or the incoming gradient went
        elsewhere."""
        self.shard_content = ShardContent.VALUES

    def restore_values(self) -> None:
        """Before the shard is read: a gradient in it moves out and the values come back (no-op otherwise).

        An incoming gradient is not in the shard yet, so it stays where it waits.
        """
        if self.holds_gradient:
            self._holder().evict(self)
            assert not self.holds_gradient, f"ds_id {self.ds_id}: eviction left a gradient"

    # ---------------------------------------------------------------- the shard as a master view
    def adopt_master_shard(self, view: torch.Tensor) -> None:
        """Make ``view`` (this parameter's 1-D slice of the optimizer's fp32 master) the shard ([Note: zero3-master]).

        The previous shard's storage is freed: from now on the master is the only persistent copy of the values,
        and a gather converts them to the working dtype on its way into the all-gather buffer. The gathered
        storage keeps the working dtype; where it was the shard itself (one rank) it becomes separate storage,
        unless ``view`` already has the working dtype (fp32 training), in which case it aliases the view. Calling
        it again with a new view of a moved master re-points the shard.
        """
        self._assert_state(ShardedState.SHARDED)
        assert self.shard_content is ShardContent.VALUES, f"ds_id {self.ds_id}: shard holds {self.shard_content.name}"
        if view.dim() != 1 or view.numel() != self.layout.partition_numel:
            raise ValueError(
                f"ds_id {self.ds_id}: a master view of shape {tuple(view.shape)}, expected "
                f"({self.layout.partition_numel},)"
            )
        old, was_view = self.shard, self.shard_is_master
        working = self.full.dtype
        if self.aliases_shard and view.dtype != working:
            self.storage = FullStorage.SEPARATE
            self.full = torch.empty(self.layout.padded_numel, dtype=working, device=old.device)
            free_storage(self.full)
        elif self.aliases_shard:
            self.full = view
        view.ds_numel = self.layout.partition_numel  # type: ignore[attr-defined]  # upstream: ds_tensor.ds_numel
        self.shard = view
        self.shard_is_master = True
        param = self.param
        if param is not None:
            param.data = placeholder(self.full)  # SHARDED: the placeholder of the (possibly new) gathered storage
        if not was_view and old.untyped_storage().data_ptr() != view.untyped_storage().data_ptr():
            free_storage(old)  # nothing reads the 16-bit copy any more; holders of it see an empty storage
        # A previous view is only dropped: its storage is the moved master's old one, freed by its last holder
        # (possibly pinned or still read by a non-blocking copy, so never resized here).

    # ---------------------------------------------------------------- shard <-> full values
    def write_shard_from(self, full_values: torch.Tensor, keep_unchanged: bool = False) -> None:
        """Copy this rank's slice of ``full_values`` (any shape with ``numel`` elements) into :attr:`shard`.

        ``keep_unchanged``: where the shard is wider than the values (a master view), elements whose value did
        not change at the values' precision keep the shard's extra precision instead of being rounded.
        """
        self.restore_values()  # a parked gradient moves out first; the write then replaces the values
        if self.swap is not None:
            with self.open_shard(ShardAccess.UPDATE if keep_unchanged else ShardAccess.OVERWRITE):
                self._write_local(full_values, keep_unchanged)
            return
        self._write_local(full_values, keep_unchanged)

    def _write_local(self, full_values: torch.Tensor, keep_unchanged: bool) -> None:
        flat = full_values.reshape(-1)
        if self.aliases_shard and flat.data_ptr() == self.shard.data_ptr():
            return  # the values already are the shard
        local = self.local_range
        mine, new = self.shard.narrow(0, 0, local.size), flat[local.as_slice()]
        if keep_unchanged and self.shard.dtype != flat.dtype and mine.device == new.device:
            changed = mine.to(new.dtype) != new
            mine[changed] = new[changed].to(mine.dtype)
        else:
            mine.copy_(new)  # may be device -> host (offload), or working dtype -> fp32 master
        if local.size < self.shard.numel():
            self.shard.narrow(0, local.size, self.shard.numel() - local.size).zero_()

    def receive_grad_shard(self, grad_shard: torch.Tensor) -> None:
        """Optimizer seam: store the reduced gradient shard (``partition_numel`` elements) for this rank."""
        if grad_shard.numel() != self.layout.partition_numel:
            raise ValueError(
                f"ds_id {self.ds_id}: grad shard has {grad_shard.numel()} elements, "
                f"expected {self.layout.partition_numel}"
            )
        self.grad_shard = grad_shard

    def summary(self) -> dict[str, Any]:
        """A small dict describing the state (``ds_summary``)."""
        param = self.param
        return {
            "id": self.ds_id,
            "status": self.status.name,
            "numel": 0 if param is None else param.numel(),
            "ds_numel": self.numel,
            "shape": None if param is None else tuple(param.shape),
            "ds_shape": self.shape,
            "requires_grad": None if param is None else param.requires_grad,
            "persist": self.is_persistent,
            "active_sub_modules": set(self.active_modules),
            "ds_tensor.shape": tuple(self.shard.shape),
        }


def placeholder(like: torch.Tensor) -> torch.Tensor:
    """The 0-element tensor a partitioned parameter shows (upstream's ``param.data`` when not available)."""
    return torch.empty(0, dtype=like.dtype, device=like.device)


class _CompletedGather:
    """Handle returned by ``param.all_gather(...)``: the gather has already completed."""

    def wait(self) -> None:
        """Nothing to wait for."""


class MultipleAllGatherHandles:
    """Several gather handles waited on as one (upstream's name, ``partition_parameters.MultipleAllGatherHandles``).

    Args:
        handles: anything with ``wait()``: the handles ``param.all_gather(...)`` returns, or collective work.
    """

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)

    def wait(self, handle_dependency: Any = True) -> None:
        """Wait on every handle in order (``handle_dependency``: accepted for upstream's signature; the order is
        always kept)."""
        for handle in self.handles:
            handle.wait()


def _states(param: ZeroParameter, param_list: Sequence[nn.Parameter] | None) -> list[ZeroParam]:
    params = [param] if param_list is None else list(param_list)
    return [cast(ZeroParameter, p)._ds_state for p in params]


class ZeroParameter(nn.Parameter):
    """An ``nn.Parameter`` whose upstream ``ds_*`` attributes are read-only views of its :class:`ZeroParam`.

    Only :func:`attach_ds_view` creates these (by switching the class of an existing parameter), so identities
    held by modules and optimizers never change.
    """

    _ds_state: ZeroParam

    ds_id = property(lambda self: self._ds_state.ds_id, doc="Unique id shared by all ranks.")
    ds_status = property(lambda self: self._ds_state.status, doc="A :class:`ZeroParamStatus`.")
    ds_shape = property(lambda self: torch.Size(self._ds_state.shape), doc="Full (unpartitioned) shape.")
    ds_numel = property(lambda self: self._ds_state.numel, doc="Full (unpartitioned) element count.")
    ds_tensor = property(lambda self: self._ds_state.shard, doc="This rank's 1-D partition.")
    ds_param_type = property(lambda self: ZeroParamType.PARTITIONED, doc="Always ``PARTITIONED``.")
    ds_persist = property(lambda self: self._ds_state.is_persistent, doc="Stays gathered between uses.")
    ds_active_sub_modules = property(
        lambda self: self._ds_state.active_modules,
        doc="Ids of the modules currently using the gathered values (mutable set).",
    )
    is_external_param = property(lambda self: self._ds_state.external, doc="Registered as an external param.")
    ds_process_group = property(lambda self: self._ds_state.group.handle, doc="The sharding process group.")
    ds_zero_partition_rank = property(lambda self: self._ds_state.group.rank, doc="This rank in the group.")
    ds_zero_partition_world_size = property(lambda self: self._ds_state.group.world_size, doc="Group size.")
    ds_secondary_tensor = property(lambda self: None, doc="No secondary (hpZ) partition: always ``None``.")
    nvme_swapper = property(
        lambda self: self._ds_state.swap, doc="The NVMe parameter swapper of a swapped partition, else ``None``."
    )

    def all_gather(
        self, param_list: Sequence[nn.Parameter] | None = None, async_op: bool = False, hierarchy: int = 0
    ) -> _CompletedGather:
        """Gather this parameter (or ``param_list``) so its full value is visible on every rank."""
        states = _states(self, param_list)
        states[0].gatherer.gather(states)
        return _CompletedGather()

    def all_gather_coalesced(
        self, params: Sequence[nn.Parameter], safe_mode: bool = False, quantize: bool = False
    ) -> _CompletedGather:
        """Gather ``params`` with one collective."""
        return self.all_gather(list(params))

    def partition(
        self,
        param_list: Sequence[nn.Parameter] | None = None,
        hierarchy: int = 0,
        has_been_updated: bool = False,
        free_data: bool = True,
    ) -> None:
        """Return to the partitioned state; with ``has_been_updated`` the gathered values become the shard."""
        states = _states(self, param_list)
        if has_been_updated:
            states[0].gatherer.commit(states)
        states[0].gatherer.release(states)

    def convert_to_zero_parameters(self, param_list: Sequence[nn.Parameter]) -> None:
        """Partition ``param_list`` over this parameter's group with the same gatherer."""
        state = self._ds_state
        for param in param_list:
            if zero_state(param) is None:
                state.gatherer.partition(param, state.group)

    def aligned_size(self) -> int:
        """Full element count padded to a multiple of the world size."""
        return self._ds_state.layout.padded_numel

    def padding_size(self) -> int:
        """Padding elements added to reach :meth:`aligned_size`."""
        return self._ds_state.layout.padding

    def partition_numel(self) -> int:
        """Elements each rank stores."""
        return self._ds_state.layout.partition_numel

    def ds_summary(self) -> dict[str, Any]:
        """A dict describing this parameter's ZeRO-3 state."""
        return self._ds_state.summary()

    def item(self) -> Any:
        """The Python scalar of a one-element parameter, gathering it first when needed."""
        state = self._ds_state
        if state.state is ShardedState.FULL:
            return super().item()
        state.gatherer.gather([state])
        try:
            return super().item()
        finally:
            state.gatherer.release([state])


def attach_ds_view(param: nn.Parameter, state: ZeroParam) -> ZeroParameter:
    """Give ``param`` the upstream ``ds_*`` view over ``state`` (the only place these attributes are set)."""
    if not isinstance(param, nn.Parameter):
        raise TypeError(f"expected an nn.Parameter, got {type(param).__name__}")
    if type(param) is not nn.Parameter and not isinstance(param, ZeroParameter):
        raise TypeError(f"cannot partition a parameter subclass {type(param).__name__}")
    param.__class__ = ZeroParameter
    view = cast(ZeroParameter, param)
    view._ds_state = state
    return view


def zero_state(param: torch.Tensor) -> ZeroParam | None:
    """The :class:`ZeroParam` of ``param``, or ``None`` when it is not partitioned."""
    return param.__dict__.get("_ds_state") if isinstance(param, ZeroParameter) else None


def is_zero_param(param: Any) -> bool:
    """True for a parameter partitioned by ZeRO-3 (upstream ``is_zero_param``)."""
    return isinstance(param, ZeroParameter) and "_ds_state" in param.__dict__
