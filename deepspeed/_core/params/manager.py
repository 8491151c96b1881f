"""The ZeRO-3 parameter manager: partitions a module's parameters and drives fetch/release from the hooks.

``ZeroParamManager`` is the one object the engine (and the ZeRO-3 optimizer) talks to for the parameter side:
it owns the :class:`~deepspeed._core.params.gather.Gatherer`, one
:class:`~deepspeed._core.params.gather.FetchUnit` per module, the prefetch
:class:`~deepspeed._core.params.prefetch.StepTrace` and the :class:`~deepspeed._core.params.hooks.ModuleHooks`.
See [Note: zero3-manager] in ``docs/design/zero3.md`` for the optimizer seam.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from torch import nn

from deepspeed._core.comm import dist
from deepspeed._core.comm.codec import IDENTITY_CODEC, ShardCodec
from deepspeed._core.comm.streams import StreamSet
from deepspeed._core.config.plan import (
    AioPolicy,
    LeanPolicy,
    OffloadDevice,
    OffloadPolicy,
    ParamOffloadPolicy,
    Stage3Policy,
)
from deepspeed._core.params.gather import (
    FetchUnit,
    Gatherer,
    ParamTarget,
    ReleaseMode,
    UnitState,
)
from deepspeed._core.params.grad_route import backward_reads_no_params, routed_keys
from deepspeed._core.params.hooks import ModuleHooks
from deepspeed._core.params.leaf_policy import report_leaf_selection, select_leaf_modules, subtree_numel
from deepspeed._core.params.param import (
    FullStorage,
    Persistence,
    ShardedState,
    ShardGroup,
    ZeroParam,
    zero_state,
)
from deepspeed._core.params.placement import ShardPlacement, arena_segments, arena_shards
from deepspeed._core.params.prefetch import PrefetchBudget, StepTrace
from deepspeed._core.params.swap import ParamSwapper

Z3_LEAF_ATTR = "_z3_leaf"
"""Module attribute marking a ZeRO-3 leaf: its whole subtree is fetched as one unit (``set_z3_leaf_modules``)."""
EXTERNAL_PARAMS_ATTR = "_external_params"
"""Module attribute (dict keyed by ``id``) of parameters registered with ``register_external_parameter``."""

GradReadyCallback = Callable[[nn.Parameter, ZeroParam, torch.Tensor], None]
BackwardEndCallback = Callable[[], None]


def is_z3_leaf(module: nn.Module) -> bool:
    """True when ``module`` is fetched as one unit together with all its descendants."""
    # Read from the instance dict (where setattr puts a bool), then the class: ``getattr`` on a module without the
    # attribute goes through ``nn.Module.__getattr__`` and a raised AttributeError, on every hook call.
    flag = module.__dict__.get(Z3_LEAF_ATTR)
    return bool(getattr(type(module), Z3_LEAF_ATTR, False) if flag is None else flag)


def _externals(module: nn.Module) -> dict:
    """``module``'s registry of external parameters (``register_external_parameter`` keeps it in the instance
    dict; a plain dict read avoids ``nn.Module.__getattr__``'s exception path on every hook call)."""
    return module.__dict__.get(EXTERNAL_PARAMS_ATTR, {})


def mark_config_leaves(module: nn.Module, stage3: Stage3Policy, block_units: bool = False) -> list[nn.Module]:
    """Mark the leaves ``stage3.leaf_module`` and ``stage3.module_granularity_threshold`` select in ``module``'s
    tree, and with ``block_units`` its repeated blocks of at most ``stage3.max_live_parameters`` elements (rules:
    ``leaf_policy.py``); log entries that match nothing. Returns the newly marked modules."""
    selection = select_leaf_modules(
        module,
        stage3.leaf_module,
        stage3.module_granularity_threshold,
        is_z3_leaf,
        stage3.max_live_parameters if block_units else None,
    )
    report_leaf_selection(module, selection, stage3.module_granularity_threshold)
    for _, sub in selection.modules:
        setattr(sub, Z3_LEAF_ATTR, True)
    return [sub for _, sub in selection.modules]


def unit_externals(module: nn.Module) -> dict:
    """The external parameters ``module``'s unit fetches: its own registry, and for a leaf every registry in its
    subtree (no hook runs below a leaf, so a descendant's externals are the leaf's to fetch)."""
    if not is_z3_leaf(module):
        return _externals(module)
    merged: dict = {}
    for sub in module.modules():
        merged.update(_externals(sub))
    return merged


def unit_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters fetched for ``module``: its own (the whole subtree for a leaf) plus external ones."""
    own = module.parameters() if is_z3_leaf(module) else module.parameters(recurse=False)
    found: dict[int, nn.Parameter] = {id(p): p for p in own}
    for param in unit_externals(module).values():
        found.setdefault(id(param), param)
    return list(found.values())


def _external_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(str(key), param) for key, param in _externals(module).items()]


def _all_parameters(module: nn.Module) -> Iterable[nn.Parameter]:
    yield from module.parameters(recurse=False)
    for _, param in _external_parameters(module):
        yield param


def register_external(module: nn.Module, parameter: Any) -> None:
    """Record that ``module``'s forward uses ``parameter`` although another module owns it."""
    if not isinstance(parameter, nn.Parameter):  # upstream raises RuntimeError here, not TypeError
        raise RuntimeError(
            f"register_external_parameter: parameter is not a torch.nn.Parameter (got {type(parameter).__name__})"
        )
    if EXTERNAL_PARAMS_ATTR not in module.__dict__:
        module.__dict__[EXTERNAL_PARAMS_ATTR] = {}
        setattr(module, "ds_external_parameters", MethodType(_external_parameters, module))  # noqa: B010
        setattr(module, "all_parameters", MethodType(_all_parameters, module))  # noqa: B010
    module.__dict__[EXTERNAL_PARAMS_ATTR][id(parameter)] = parameter
    state = zero_state(parameter)
    if state is not None:
        state.external = True


def unregister_external(module: nn.Module, parameter: Any) -> None:
    """Undo :func:`register_external` (no-op when it was not registered)."""
    if not isinstance(parameter, nn.Parameter):  # upstream raises RuntimeError here, not TypeError
        raise RuntimeError(
            f"unregister_external_parameter: parameter is not a torch.nn.Parameter (got {type(parameter).__name__})"
        )
    registry = module.__dict__.get(EXTERNAL_PARAMS_ATTR, {})
    registry.pop(id(parameter), None)


def release_mode_of(lean: LeanPolicy) -> ReleaseMode:
    """``STREAM_ORDERED`` for the lean switch on, the upstream-like ``DEFERRED`` baseline when off."""
    return ReleaseMode.STREAM_ORDERED if lean.stream_ordered_release else ReleaseMode.DEFERRED


@dataclass(frozen=True)
class GatheredCounts:
    """Gathered memory at one instant (non-persistent parameters only).

    Attributes:
        event: which hook took the sample (``pre_forward``, ``post_backward``, ...).
        module: qualified name of the module at the boundary.
        units_alive: units holding any gathered memory (in flight, gathered, or freed but not yet returned).
        units_active: units currently in use by a forward/backward call.
        params_alive: parameters holding gathered memory.
        numel_alive: elements of those parameters.
    """

    event: str
    module: str
    units_alive: int
    units_active: int
    params_alive: int
    numel_alive: int


class _CallbackHandle:
    def __init__(self, registry: list, callback: Callable, on_change: Callable[[], None] | None = None) -> None:
        self._registry = registry
        self._callback = callback
        self._on_change = on_change

    def remove(self) -> None:
        """Unsubscribe."""
        if self._callback in self._registry:
            self._registry.remove(self._callback)
        if self._on_change is not None:
            self._on_change()


class ShardAllocation(enum.Enum):
    """How the manager allocates the shards of the parameters it partitions itself."""

    PER_PARAMETER = "per_parameter"  # each shard is its own allocation
    # One buffer per dtype and device, cut into the shards: for shards that stay for the whole run ([Note: shard
    # arena] in ``placement.py``).
    ARENA = "arena"


@dataclass(frozen=True)
class ParamStorage:
    """Where the manager keeps shards and gathered parameters.

    Attributes:
        offload_param: ``zero_optimization.offload_param``: new shards in (pinned) host memory ([Note:
            zero3-offload]).
        single_rank: ``FullStorage.SEPARATE`` keeps separate gathered storage on one rank too (tests of the
            release mechanics).
        shards: how the shards of parameters not yet partitioned are allocated.
    """

    offload_param: OffloadPolicy = OffloadPolicy()
    single_rank: FullStorage = FullStorage.SHARD
    shards: ShardAllocation = ShardAllocation.PER_PARAMETER
    aio: AioPolicy = AioPolicy()


DEFAULT_STORAGE = ParamStorage()


class ZeroParamManager:
    """Partition ``module``'s parameters over ``group`` and gather/release them around each use."""

    def __init__(
        self,
        module: nn.Module,
        group: ShardGroup,
        stage3: Stage3Policy,
        lean: LeanPolicy,
        streams: StreamSet | None = None,
        codec: ShardCodec = IDENTITY_CODEC,
        storage: ParamStorage = DEFAULT_STORAGE,
        target: ParamTarget = ParamTarget(),
    ) -> None:
        """Partition every parameter (adopting those ``zero.Init`` already partitioned) and install hooks.

        ``storage`` says where shards and gathered parameters are held (:class:`ParamStorage`); ``target`` is the
        compute device and working dtype of parameters not yet partitioned, which may still lie in host memory
        ([Note: zero3-init]).
        """
        # Leaves first: the hooks and units built below read the marks, and a bad policy fails here, before any
        # collective.
        self.config_leaves = mark_config_leaves(module, stage3, lean.block_fetch_units)
        self.module = module
        self.group = group
        self.policy = stage3
        self.target = target
        self.gatherer = Gatherer(
            streams if streams is not None else StreamSet(),
            codec,
            release_mode_of(lean),
            ShardPlacement.from_policy(storage.offload_param),
            storage.single_rank,
        )
        # Leaves are gathered whole: at several ranks the next one is prefetched even when the window is smaller
        # ([Note: zero3-prefetch]); one rank has no communication to overlap.
        whole = max((subtree_numel(m) for m in self.config_leaves), default=0) if group.world_size > 1 else 0
        self.trace = StepTrace(PrefetchBudget.from_policy(stage3, whole))
        self._init_registries(module)
        self._configure_swap(module, storage)
        # [Note: routed grads]: only the lean gradient path routes uses; off, every gradient reaches param.grad.
        self._route_grads = lean.eager_grad_release
        self._adopt_parameters(module.parameters(), storage.shards, own=lean.inplace_flatten)
        self._mark_persistent()
        self.hooks = ModuleHooks(self)
        self.register_module(module)

    def _init_registries(self, module: nn.Module) -> None:
        """Empty registries of units, states and callbacks, and the per-step bookkeeping the hooks keep."""
        self.units: dict[int, FetchUnit] = {}
        self._unit_by_module: dict[int, FetchUnit] = {}
        self._unit_states: dict[int, tuple[tuple, list[ZeroParam]]] = {}
        self._kept: set[int] = set()  # units released into UnitState.KEPT (left gathered for a near reuse)
        self._total_numel: tuple[int, int] = (-1, 0)  # (number of states, their elements), recomputed on change
        self._names = {id(m): name or "<root>" for name, m in module.named_modules()}
        self.states: dict[int, ZeroParam] = {}
        self._grad_callbacks: list[GradReadyCallback] = []
        self._backward_end_callbacks: list[BackwardEndCallback] = []
        self._unit_backward_callbacks: list[BackwardEndCallback] = []
        self.boundary_samples: list[GatheredCounts] | None = None
        self.in_backward = False
        self._forward_stack: list[nn.Module] = []
        self._quiet_backward: set[int] = set()  # modules whose backward runs without fetching (all uses routed)
        self._parked_persistent: list[ZeroParam] = []  # persistent, partitioned while offload_states holds shards

    # ---------------------------------------------------------------- setup
    def _configure_swap(self, module: nn.Module, storage: ParamStorage) -> None:
        """``offload_param.device: nvme``: the swapper, and a partition too large for its buffers refused before
        anything is partitioned ([Note: nvme params])."""
        policy = storage.offload_param
        if policy.device is not OffloadDevice.NVME:
            return
        assert isinstance(policy, ParamOffloadPolicy), "NVMe parameter offload needs the offload_param policy"
        rank = dist.get_rank() if dist.is_initialized() else 0
        gatherer = self.gatherer
        swapper = ParamSwapper(policy, storage.aio, rank, lambda state: gatherer.finish_gather([state]))
        swapper.check_partitions(self._partition_request(p) for p in module.parameters())
        gatherer.swapper = swapper

    def _partition_request(self, param: nn.Parameter) -> tuple[int, torch.dtype]:
        state = zero_state(param)
        if state is not None:
            return state.layout.partition_numel, state.shard.dtype
        numel, dtype, _ = self.gatherer.shard_request(param, self.group, self.target)
        return numel, dtype

    def _adopt(self, param: nn.Parameter, shard: torch.Tensor | None = None) -> ZeroParam:
        state = zero_state(param)
        if state is None:
            state = self.gatherer.partition(param, self.group, target=self.target, shard=shard)
        state.gatherer = self.gatherer
        if self.gatherer.swapper is not None:
            self.gatherer.swapper.adopt(state)  # partitioned by zero.Init: its host shard moves to its file
        self.states.setdefault(state.ds_id, state)
        return state

    def _adopt_parameters(
        self,
        params: Iterable[nn.Parameter],
        allocation: ShardAllocation = ShardAllocation.PER_PARAMETER,
        own: bool = False,
    ) -> None:
        """Adopt or partition every parameter, in order. With ``ShardAllocation.ARENA`` the new shards are cut from
        buffers per dtype and device, a segment at a time ([Note: shard arena]); with ``own``, on one rank, a
        parameter that already lies where and as its shard would keeps its own storage as its shard
        ([Note: own storage as shard])."""
        params = list(params)
        shards: dict[int, torch.Tensor] = {}
        segments: list[list[nn.Parameter]] = []
        if self.gatherer.placement.device is None:  # shards on the compute device, not offloaded
            if own and self.group.world_size == 1:
                shards = self._own_storage_shards(params)
            if allocation is ShardAllocation.ARENA:
                fresh = [p for p in params if zero_state(p) is None and id(p) not in shards]
                segments = arena_segments(fresh, lambda p: self.gatherer.shard_request(p, self.group, self.target))
        segment_of = {id(p): k for k, segment in enumerate(segments) for p in segment}
        for param in params:
            k = segment_of.pop(id(param), None)
            if k is not None and id(param) not in shards:
                # Cut when its first parameter comes up: the earlier segments' parameters have freed their full
                # storage by then ([Note: shard arena]).
                segment = segments[k]
                requests = [self.gatherer.shard_request(p, self.group, self.target) for p in segment]
                shards.update(zip([id(p) for p in segment], arena_shards(requests), strict=True))
            self._adopt(param, shards.pop(id(param), None))

    def _own_storage_shards(self, params: list[nn.Parameter]) -> dict[int, torch.Tensor]:
        """One rank: each parameter not yet partitioned whose data is already its shard in all but name (contiguous,
        on the shard's device, in the working dtype, alone in its storage) keeps that storage as its shard
        ([Note: own storage as shard] in ``placement.py``)."""
        by_storage: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for param in {id(p): p for p in params}.values():
            data = param.data
            if zero_state(param) is not None:
                continue
            numel, dtype, device = self.gatherer.shard_request(param, self.group, self.target)
            alone = data.storage_offset() == 0 and data.untyped_storage().nbytes() == data.numel() * data.element_size()
            if alone and data.is_contiguous() and (data.numel(), data.dtype, data.device) == (numel, dtype, device):
                by_storage.setdefault(data.data_ptr(), []).append((id(param), data.view(-1)))
        return {key: shard for owners in by_storage.values() if len(owners) == 1 for key, shard in owners}

    def _mark_persistent(self) -> None:
        budget = self.policy.model_persistence_threshold
        persistent = []
        for state in self.states.values():
            if state.numel <= self.policy.param_persistence_threshold and state.numel <= budget:
                budget -= state.numel
                persistent.append(state)
        self.gatherer.gather(persistent)
        for state in persistent:
            state.persistence = Persistence.PERSISTENT

    def register_module(self, module: nn.Module) -> None:
        """Install hooks on ``module``'s tree and give each hooked module a fetch unit (upstream
        ``_register_deepspeed_module``)."""
        for name, sub in module.named_modules():
            self._names.setdefault(id(sub), name or "<root>")
        self.hooks.register_module(module, is_z3_leaf)
        self.hooks.register_grad_hooks(p for p in module.parameters() if zero_state(p) is not None)
        stack = [module]
        while stack:
            sub = stack.pop()
            self._unit_of(sub)
            for param in unit_externals(sub).values():
                self._adopt(param).external = True
            if not is_z3_leaf(sub):
                stack.extend(reversed(list(sub.children())))
        self._plan_routing()

    def _plan_routing(self) -> None:
        """Decide which parameter uses are routed ([Note: routed grads]) over every hooked module."""
        if not self._route_grads:
            return
        keys = routed_keys(self.hooks.modules, lambda p: p.requires_grad and zero_state(p) is not None)
        self.hooks.route(keys)
        self._quiet_backward = {
            id(m) for m in self.hooks.modules if id(m) in keys and backward_reads_no_params(m) and not unit_externals(m)
        }

    def _update_routing(self) -> None:
        # Routed gradients bypass param.grad, so they are handed out only while someone receives them.
        self.hooks.routing = self._route_grads and bool(self._grad_callbacks)

    def _unit_of(self, module: nn.Module) -> FetchUnit:
        unit = self._unit_by_module.get(id(module))
        if unit is None:
            unit = FetchUnit(
                len(self.units),
                self._names.get(id(module), type(module).__name__),
                self.gatherer,
                lambda: self._states_of(module),
            )
            self.units[unit.unit_id] = unit
            self._unit_by_module[id(module)] = unit
        return unit

    def _states_of(self, module: nn.Module) -> list[ZeroParam]:
        """``module``'s unit states, rebuilt only when its parameter set changed.

        Adopting every parameter on every hook call dominated the hooks' Python time; the signature (the
        identities of the unit's parameters and externals) is cheap and catches replaced or added ones.
        """
        own = module.parameters() if is_z3_leaf(module) else dict.values(module._parameters)
        key = (tuple(id(p) for p in own if p is not None), tuple(unit_externals(module)))
        cached = self._unit_states.get(id(module))
        if cached is not None and cached[0] == key:
            return cached[1]
        states = [self._adopt(p) for p in unit_parameters(module)]
        self._unit_states[id(module)] = (key, states)
        return states

    # ---------------------------------------------------------------- fetch / release
    def fetch(self, module: nn.Module) -> None:
        """Make ``module``'s parameters available (and start prefetching what the trace says comes next)."""
        unit = self._unit_of(module)
        unit.refresh()
        self.gatherer.drain()
        if not unit.numel():
            # Nothing to gather (a container, or only persistent parameters): the trace does not record such
            # units, so prefetch decisions wait for the next unit that has something to move.
            unit.acquire()
            return
        self.trace.observe(unit.unit_id)
        unit.acquire()
        unit.unshard()
        if self.gatherer.swapper is not None:
            unit.wait_for_unshard()  # its swap buffers go back to the pool before the next reads start
            self._prefetch()
            return
        self._prefetch()
        unit.wait_for_unshard()

    def _prefetch(self) -> None:
        swapper = self.gatherer.swapper
        for unit_id in self.trace.prefetch_candidates(self._unit_numel, self._unit_gathered, self._live_numel):
            unit = self.units[unit_id]
            if swapper is not None and not all(swapper.in_buffer(s) for s in unit.managed_states() if s.swapped):
                break  # gathering it now would wait for the disk: its reads start below instead
            unit.unshard()
        if swapper is not None:
            # [Note: nvme params]: the next units' partitions are read into free swap buffers now, overlapping
            # this module's compute; their gathers find them there.
            swapper.read_ahead(self._upcoming_swapped())

    def _upcoming_swapped(self) -> Iterator[ZeroParam]:
        """Swapped, partitioned states of the units the trace says come next, in gather order."""
        seen: set[int] = set()
        for unit_id in self.trace.upcoming():
            if unit_id in seen:
                continue
            seen.add(unit_id)
            for state in self.units[unit_id].managed_states():
                if state.swapped and state.state is ShardedState.SHARDED:
                    yield state

    def _live_numel(self) -> int:
        # When the live cap exceeds the whole model it can never bind; skip the walk over every parameter.
        if self._total_numel[0] != len(self.states):
            self._total_numel = (len(self.states), sum(st.numel for st in self.states.values()))
        if self.trace.budget.max_live_numel >= self._total_numel[1]:
            return 0
        return sum(s.numel for s in self.states.values() if not s.is_persistent and s.state is not ShardedState.SHARDED)

    def _unit_numel(self, unit_id: int) -> int:
        return self.units[unit_id].numel()

    def _unit_gathered(self, unit_id: int) -> bool:
        return self.units[unit_id].is_gathered()

    def release(self, module: nn.Module) -> None:
        """One use of ``module`` ended; release its parameters when it was the last (unless reused soon)."""
        unit = self._unit_by_module.get(id(module))
        if unit is None or unit.refs == 0 or unit.drop() > 0 or not unit.numel():
            return  # still in use, or nothing gathered to release (kept units are swept at the next release)
        if self.trace.reused_soon(unit.unit_id, self._unit_numel):
            unit.keep()
            self._kept.add(unit.unit_id)
        else:
            unit.reshard()
        self._sweep_kept()

    def _sweep_kept(self) -> None:
        # Only units released into KEPT are candidates; walking every unit per release cost O(units²) a step.
        for unit_id in list(self._kept):
            unit = self.units[unit_id]
            if unit.state is not UnitState.KEPT:
                self._kept.discard(unit_id)  # fetched again since
            elif not self.trace.reused_soon(unit_id, self._unit_numel):
                unit.reshard()
                self._kept.discard(unit_id)

    def release_all(self) -> None:
        """Return every non-persistent parameter to the partitioned state (upstream ``empty_partition_cache``).

        Parameters held by an open ``GatheredParameters`` context stay gathered.
        """
        for unit in self.units.values():
            while unit.refs:
                unit.drop()
            unit.reshard()
        states = [s for s in self.states.values() if not s.is_persistent]
        self.gatherer.finish_gather(states)
        self.gatherer.release(states)

    def destroy(self) -> None:
        """Remove every hook, release gathered and persistent parameters, drop buffers and units."""
        self.release_all()
        self.hooks.remove()
        for state in self.states.values():
            if state.is_persistent:
                state.persistence = Persistence.PARTITIONED
                self.gatherer.release([state])
        self.gatherer.shutdown()
        self.units.clear()
        self._unit_by_module.clear()
        self._unit_states.clear()
        self._kept.clear()
        self._grad_callbacks.clear()
        self._update_routing()
        self._backward_end_callbacks.clear()
        self._unit_backward_callbacks.clear()

    def shards_for_offload(self) -> list[torch.Tensor]:
        """Partition every parameter, persistent ones included, and return the shards to park (``offload_states``).

        Raises:
            ValueError: a gradient waits in a shard (between a backward and its step), or a parameter is held by
                an open ``GatheredParameters`` context.
        """
        if any(s.holds_gradient for s in self.states.values()):
            raise ValueError(
                "offload_states: gradients of the current step wait in the parameter shards; call it "
                "after engine.step()"
            )
        self.release_all()
        self._parked_persistent = [s for s in self.states.values() if s.is_persistent]
        for state in self._parked_persistent:
            state.persistence = Persistence.PARTITIONED
        self.gatherer.release(self._parked_persistent)
        held = [s.ds_id for s in self.states.values() if s.state is not ShardedState.SHARDED]
        if held:
            raise ValueError(f"offload_states: parameters {held[:8]} are still gathered (open GatheredParameters?)")
        # A shard that is a view of the fp32 master moves with the master (``hp_params``) ([Note: zero3-master]).
        return [s.shard for s in self.states.values() if not s.shard_is_master]

    def restore_persistent(self) -> None:
        """After the shards are back: gather again the parameters :meth:`shards_for_offload` un-persisted."""
        persistent, self._parked_persistent = self._parked_persistent, []
        self.gatherer.gather(persistent)
        for state in persistent:
            state.persistence = Persistence.PERSISTENT

    def refresh_persistent(self) -> None:
        """Re-gather persistent parameters after the optimizer rewrote their shards (in place: the gathered
        tensors keep their storage)."""
        self.gatherer.refresh([s for s in self.states.values() if s.is_persistent])

    # ---------------------------------------------------------------- optimizer seam
    def on_grad_ready(self, callback: GradReadyCallback) -> _CallbackHandle:
        """Call ``callback(param, state, grad)`` for each full-shaped gradient of ``param`` a backward produces.

        ``grad`` is either ``param.grad`` once autograd accumulated it (the subscriber may reduce-scatter it and
        set ``param.grad = None``), or, for a routed use ([Note: routed grads]: tied parameters, embedding
        tables, with ``eager_grad_release``), that one use's gradient while ``param.grad`` stays untouched. A
        parameter may therefore arrive more than once per backward; the arrivals add up to its gradient.
        Routing is on only while at least one callback is subscribed.
        """
        self._grad_callbacks.append(callback)
        self._update_routing()
        return _CallbackHandle(self._grad_callbacks, callback, self._update_routing)

    def on_backward_end(self, callback: BackwardEndCallback) -> _CallbackHandle:
        """Call ``callback()`` once per backward pass, after every gradient hook ran (flush partial buckets)."""
        self._backward_end_callbacks.append(callback)
        return _CallbackHandle(self._backward_end_callbacks, callback)

    def on_unit_backward_end(self, callback: BackwardEndCallback) -> _CallbackHandle:
        """Call ``callback()`` after each post-backward of a hooked module (one call of a fetch unit is done).

        The autograd engine runs a parameter's gradient accumulation as soon as that gradient exists, ahead of
        other ready work, so the unit's parameters have normally reported by then; one that reports later (a
        parameter also used outside the unit) simply arrives after the call.
        """
        self._unit_backward_callbacks.append(callback)
        return _CallbackHandle(self._unit_backward_callbacks, callback)

    # ---------------------------------------------------------------- HookTarget
    def pre_forward(self, module: nn.Module) -> None:
        """Forward pre-hook: a root call starts a new step (trace replay, leftovers released)."""
        if module is self.module and not self.in_backward and self._unit_of(module).refs == 0:
            self.release_all()
            self.trace.begin_step()
            self._forward_stack.clear()
        self.fetch(module)
        self._forward_stack.append(module)
        self._sample("pre_forward", module)

    def post_forward(self, module: nn.Module) -> None:
        """Forward post-hook: release; a root forward without autograd (eval) releases everything."""
        if self._forward_stack and self._forward_stack[-1] is module:
            self._forward_stack.pop()
        self.release(module)
        if module is self.module and not self.in_backward and not torch.is_grad_enabled():
            self.release_all()
        self._sample("post_forward", module)

    def pre_backward(self, module: nn.Module) -> None:
        """Before one call's backward: fetch again, unless that backward reads no parameter values and every
        gradient it produces is routed (a plain embedding: [Note: routed grads])."""
        self.in_backward = True
        if not (self.hooks.routing and id(module) in self._quiet_backward):
            self.fetch(module)
        self._sample("pre_backward", module)

    def post_backward(self, module: nn.Module) -> None:
        """After one call's backward: release, then tell the subscribers the unit is done."""
        self.release(module)
        self._sample("post_backward", module)
        for callback in self._unit_backward_callbacks:
            callback()

    def backward_finished(self) -> None:
        """End of the backward pass: release what no post-backward reached, notify subscribers."""
        self.in_backward = False
        self.release_all()
        for callback in list(self._backward_end_callbacks):
            callback()

    def grad_ready(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: forward ``param.grad`` to the optimizer's subscribers."""
        if not getattr(param, "ds_grad_is_ready", True):
            return  # a tile of a tiled function: the gradient is still accumulating ([Note: ds_grad_is_ready])
        grad = param.grad  # read once: a subscriber may set param.grad = None
        if grad is None:
            return  # every use was routed: autograd ran the hook on nothing
        state = zero_state(param)
        if state is None:
            return  # not partitioned by this manager: nothing to reduce
        for callback in list(self._grad_callbacks):
            callback(param, state, grad)

    def grad_arrived(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """A routed use's gradient: forward it to the subscribers (``param.grad`` is not involved)."""
        state = zero_state(param)
        if state is None:
            return  # not partitioned by this manager: nothing to reduce
        for callback in list(self._grad_callbacks):
            callback(param, state, grad)

    def on_param_access(self, param: nn.Parameter) -> None:
        """A forward read a partitioned parameter its module did not fetch: make it an external parameter of
        the innermost running module and gather it now (later steps fetch it with that module)."""
        if not self._forward_stack:
            return
        module = self._forward_stack[-1]
        register_external(module, param)
        state = self._adopt(param)
        state.external = True
        unit = self._unit_of(module)
        unit.refresh()  # the unit's release must see the parameter it just acquired
        if unit.refs:
            state.active_modules.add(unit.unit_id)
        self.gatherer.cancel_pending_frees([state])
        self.gatherer.gather([state])

    # ---------------------------------------------------------------- instrumentation
    def count_gathered(self, event: str = "now", module: nn.Module | None = None) -> GatheredCounts:
        """How much gathered memory exists right now (see :class:`GatheredCounts`)."""
        pending = set(self.gatherer.deferred.pending_keys())
        alive = {
            s.ds_id: s
            for s in self.states.values()
            if not s.is_persistent and (s.state is not ShardedState.SHARDED or s.ds_id in pending)
        }
        units_alive = sum(1 for u in self.units.values() if any(s.ds_id in alive for s in u.managed_states()))
        units_active = sum(1 for u in self.units.values() if u.refs and u.numel())
        name = "" if module is None else self._names.get(id(module), type(module).__name__)
        return GatheredCounts(event, name, units_alive, units_active, len(alive), sum(s.numel for s in alive.values()))

    def _sample(self, event: str, module: nn.Module) -> None:
        if self.boundary_samples is not None:
            self.boundary_samples.append(self.count_gathered(event, module))
