"""Activation checkpointing: recompute a function's forward in backward instead of keeping its activations.

The façade ``deepspeed.runtime.activation_checkpointing.checkpointing`` owns the upstream module-level API; the
algorithm and the one process-wide :class:`ActivationCheckpointState` live here.

What a checkpointed call keeps between forward and backward:

* its positional inputs, one entry per argument. Non-tensors are kept as they are. With partitioning on and a
  model-parallel group of size ``mp > 1``, each floating-point tensor is flattened, padded to a multiple of ``mp``
  and only this rank's ``ceil(numel / mp)`` elements are cloned and kept: the full tensor is referenced by nobody
  once forward returns, which is the whole point. With CPU checkpointing a partition is kept on
  the host; without partitioning, each floating-point input that requires grad goes to the activation offloader
  ([Note: activation offload] in :mod:`deepspeed._core.engine.activation_offload`), which copies it to a pooled
  host buffer asynchronously and brings it back ahead of the recomputation.
* a snapshot of the RNG streams (CPU generator, device generator, every tracker stream) taken before the forward
  ran, so the recomputation draws the same dropout masks.

Backward all-gathers the partitions (every model-parallel rank holds an identical replica of its activations, so
the gathered tensor equals the original), recomputes with grad enabled under the saved RNG state, backpropagates
through the recomputed graph and returns the input gradients. The caller's own tensors go through
``save_for_backward`` (so in-place edits are detected); private copies (partitions, host copies) ride on the
autograd node and are dropped at the start of its backward, or with the graph if no backward ever runs.

``non_reentrant_checkpoint`` keeps inputs the same way but builds the forward graph normally, replacing every
tensor autograd saves by an index (saved-tensor hooks) and recomputing on first unpack; it therefore also works
with ``torch.autograd.grad``.

Contiguous mode writes the partitions of successive checkpoints into one preallocated arena per argument slot
(``number_checkpoints`` entries) instead of separate allocations, to avoid allocator fragmentation. The arena is
rewound when a forward starts with no checkpoint awaiting its backward; ``reset()`` releases it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from deepspeed._core.comm.collectives import gather_rows
from deepspeed._core.engine.activation_offload import ActivationOffloader, OffloadHandle, PinnedHostPool
from deepspeed._foundation.logging import log_dist, logger
from deepspeed.accelerator import get_accelerator

FACADE_MODULE = "deepspeed.runtime.activation_checkpointing.checkpointing"
MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
# Host buffers the activation offloader may hold: enough for the inputs of every layer of deep models; beyond it
# inputs simply stay on the device.
OFFLOAD_POOL_BUFFERS = 64
# Offset between the data-parallel seed and the model-parallel stream seed. It is a compatibility fact, not a
# tuning knob: the same seed must give the same dropout masks as upstream-trained runs.
TP_SEED_OFFSET = 2718


# ---------------------------------------------------------------------- policy and model-parallel view
@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """Resolved switches of the ``activation_checkpointing`` block (after config file and explicit overrides)."""

    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int | None = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False

    def validate(self) -> None:
        """Raise ``ValueError`` when contiguous mode lacks what it needs (before any collective runs)."""
        if self.contiguous_checkpointing and not self.partition_activations:
            raise ValueError(
                "contiguous_memory_optimization (contiguous_checkpointing) requires partition_activations=True"
            )
        if self.contiguous_checkpointing and self.num_checkpoints is None:
            raise ValueError(
                "contiguous_memory_optimization (contiguous_checkpointing) requires "
                "number_checkpoints (num_checkpoints) or set_num_layers(n)"
            )


@dataclasses.dataclass(frozen=True)
class ModelParallelView:
    """This rank's place in the tensor/model-parallel group that activations are partitioned over."""

    rank: int = 0
    world_size: int = 1
    group: Any = None


def _mpu_query(mpu: Any, what: str) -> Any:
    # Megatron renamed get_model_parallel_* to get_tensor_model_parallel_*; accept either spelling.
    for name in (f"get_tensor_model_parallel_{what}", f"get_model_parallel_{what}"):
        fn = getattr(mpu, name, None)
        if fn is not None:
            return fn()
    raise AttributeError(
        f"mpu {type(mpu).__name__} has neither get_tensor_model_parallel_{what}() nor get_model_parallel_{what}()"
    )


def model_parallel_view(mpu: Any) -> ModelParallelView:
    """Read rank, size and group from a Megatron-style ``mpu`` (``None`` means no model parallelism)."""
    if mpu is None:
        return ModelParallelView()
    return ModelParallelView(
        rank=int(_mpu_query(mpu, "rank")), world_size=int(_mpu_query(mpu, "world_size")), group=_mpu_query(mpu, "group")
    )


# ---------------------------------------------------------------------- RNG
def _device_has_own_generator() -> bool:
    # On the CPU accelerator the "device" generator is the CPU generator; saving it twice would be harmless but
    # restoring it twice in the wrong order would not.
    return get_accelerator().device_name() != "cpu"


class CudaRNGStatesTracker:
    """Named RNG streams for the accelerator generator (upstream name; works on CPU with the CPU generator).

    ``add(name, seed)`` creates a stream; ``fork(name)`` runs a block with the generator switched to that stream
    and stores the advanced stream back, so e.g. model-parallel dropout draws from its own sequence while the
    default stream stays in step across data-parallel ranks.
    """

    __module__ = FACADE_MODULE

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every stream and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name → generator-state map (the states themselves are immutable snapshots)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams with ``states`` (as returned by :meth:`get_states`)."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; both must be new. The current generator is untouched."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the RNG tracker")
        self.seeds_.add(seed)
        accel = get_accelerator()
        saved = accel.get_rng_state()
        accel.manual_seed(seed)
        self.states_[name] = accel.get_rng_state()
        accel.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block on stream ``name``; the advanced stream is stored back and the caller's state restored."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not added to the tracker (known: {sorted(self.states_)})")
        accel = get_accelerator()
        saved = accel.get_rng_state()
        accel.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accel.get_rng_state()
            accel.set_rng_state(saved)


@dataclasses.dataclass(frozen=True)
class RngSnapshot:
    """Every generator state a checkpointed forward may draw from."""

    cpu: torch.Tensor
    device: torch.Tensor | None
    tracker: dict[str, torch.Tensor]


def capture_rng(tracker: CudaRNGStatesTracker) -> RngSnapshot:
    """Snapshot the CPU, device and tracker generator states."""
    device = get_accelerator().get_rng_state() if _device_has_own_generator() else None
    return RngSnapshot(cpu=torch.get_rng_state(), device=device, tracker=tracker.get_states())


def restore_rng(snapshot: RngSnapshot, tracker: CudaRNGStatesTracker) -> None:
    """Put every generator back to ``snapshot``."""
    torch.set_rng_state(snapshot.cpu)
    if snapshot.device is not None:
        get_accelerator().set_rng_state(snapshot.device)
    tracker.set_states(snapshot.tracker)


@contextlib.contextmanager
def replay_rng(snapshot: RngSnapshot, tracker: CudaRNGStatesTracker) -> Iterator[None]:
    """Run the block from ``snapshot``'s generator states, then return to the states current on entry.

    Restoring afterwards matters: recomputation happens in backward, in the middle of the training step, and must
    not shift the random streams that later forwards (or other checkpoints) draw from.
    """
    current = capture_rng(tracker)
    restore_rng(snapshot, tracker)
    try:
        yield
    finally:
        restore_rng(current, tracker)


# ---------------------------------------------------------------------- saving inputs
class SlotKind(enum.Enum):
    """How one positional input is kept for backward."""

    CONST = "const"  # a non-tensor, kept as is
    WHOLE = "whole"  # the caller's tensor itself, through save_for_backward (so in-place edits are caught)
    HOST_COPY = "host_copy"  # the tensor handed to the activation offloader (an OffloadHandle)
    PARTITION = "partition"  # a private copy of this rank's padded share of the flattened tensor


@dataclasses.dataclass(frozen=True)
class SavedSlot:
    """One positional input's record: its kind, the constant, or the metadata needed to rebuild the tensor."""

    kind: SlotKind
    value: Any = None  # the constant, or the private tensor of HOST_COPY / PARTITION
    shape: torch.Size | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    requires_grad: bool = False


class ContiguousArena:
    """One preallocated flat buffer per argument slot; partitions of successive checkpoints are views into it."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.offsets: dict[int, int] = {}

    def take(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device, count: int) -> torch.Tensor:
        """A ``numel``-element view of slot ``slot``'s buffer (sized for ``count`` partitions on first use)."""
        buf = self.buffers.get(slot)
        if buf is None or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel * count, dtype=dtype, device=device)
            self.buffers[slot] = buf
            self.offsets[slot] = 0
        start = self.offsets.get(slot, 0)
        if start + numel > buf.numel():
            raise RuntimeError(
                f"contiguous activation buffer for argument {slot} is full: more checkpointed "
                f"forwards than number_checkpoints ({count}) before a backward; raise "
                "number_checkpoints or call deepspeed.checkpointing.reset() after forwards "
                "that have no backward"
            )
        self.offsets[slot] = start + numel
        return buf.narrow(0, start, numel)

    def rewind(self) -> None:
        """Reuse the buffers from the start (nothing written so far is still needed)."""
        self.offsets = {}

    def release(self) -> None:
        """Drop the buffers."""
        self.buffers = {}
        self.offsets = {}


class ArenaUse(enum.Enum):
    """Whether saved partitions may go into the contiguous arena."""

    AS_CONFIGURED = "as_configured"
    NEVER = "never"  # callers that cannot report when their backward has run, so cannot take part in rewinding


def is_activation_to_checkpoint(item: Any, mp_size: int) -> bool:
    """True for tensors worth partitioning: floating point and at least one element per model-parallel rank."""
    return torch.is_tensor(item) and item.is_floating_point() and item.numel() >= mp_size


def partition_numel(numel: int, mp_size: int) -> int:
    """Elements each rank keeps of a ``numel``-element tensor (the last rank's share is zero-padded)."""
    return math.ceil(numel / mp_size)


class ActivationCheckpointState:
    """Process-wide settings and bookkeeping behind ``deepspeed.checkpointing``.

    ``observers`` are called with every tensor created to be kept for backward (a partition or a host copy); tests
    and memory tooling use them to check sizes and lifetimes without patching this module.
    """

    def __init__(self) -> None:
        self.policy = CheckpointPolicy()
        self.mpu: Any = None
        self.configured = False
        self.tracker = CudaRNGStatesTracker()
        self.arena = ContiguousArena()
        self.pending_backwards = 0
        self.observers: list[Callable[[torch.Tensor], None]] = []
        self.timings: dict[str, float] = {}
        self._view: ModelParallelView | None = None
        self._offloader: ActivationOffloader | None = None

    def apply(self, policy: CheckpointPolicy, mpu: Any) -> None:
        """Install a validated policy and model-parallel unit; drops buffers built for the previous settings."""
        policy.validate()
        self.policy, self.mpu, self.configured = policy, mpu, True
        self._view = None
        self.release_buffers()
        if self._offloader is not None:
            self._offloader.pool.release()
            self._offloader = None

    def release_buffers(self) -> None:
        """Free the contiguous arena, drain the offloader and forget pending checkpoints (upstream ``reset()``)."""
        self.arena.release()
        self.pending_backwards = 0
        if self._offloader is not None:
            self._offloader.drain()

    def offloader(self) -> ActivationOffloader:
        """The activation offloader of CPU checkpointing (created on first use, shared by every checkpoint)."""
        if self._offloader is None:
            self._offloader = ActivationOffloader(PinnedHostPool(OFFLOAD_POOL_BUFFERS))
        return self._offloader

    def view(self) -> ModelParallelView:
        """The model-parallel view, read from the mpu on first use (its groups may not exist at configure time)."""
        if self._view is None:
            self._view = model_parallel_view(self.mpu)
        return self._view

    def boundary(self) -> None:
        """Synchronize the device at a checkpoint boundary when asked to (profiling aid)."""
        if self.policy.synchronize:
            get_accelerator().synchronize()

    def _observe(self, tensor: torch.Tensor) -> torch.Tensor:
        for observer in self.observers:
            observer(tensor)
        return tensor

    # -- saving
    def save_inputs(
        self,
        args: Sequence[Any],
        arena_use: ArenaUse = ArenaUse.AS_CONFIGURED,
    ) -> tuple[list[SavedSlot], list[torch.Tensor]]:
        """Decide how each input is kept; returns the slot layout and the tensors for ``save_for_backward``.

        Private copies (partitions, host copies) travel inside the layout rather than through
        ``save_for_backward``: nobody else can modify them, and contiguous partitions are views of one arena whose
        shared version counter would make autograd's in-place check fire on every later write to the arena.
        """
        view = self.view()
        split = self.policy.partition_activations and view.world_size > 1
        use_arena = split and self.policy.contiguous_checkpointing and arena_use is ArenaUse.AS_CONFIGURED
        if use_arena and self.pending_backwards == 0:
            self.arena.rewind()
        layout: list[SavedSlot] = []
        tensors: list[torch.Tensor] = []
        for slot, arg in enumerate(args):
            if not torch.is_tensor(arg):
                layout.append(SavedSlot(kind=SlotKind.CONST, value=arg))
                continue
            meta: dict[str, Any] = {
                "shape": arg.shape,
                "dtype": arg.dtype,
                "device": arg.device,
                "requires_grad": arg.requires_grad,
            }
            if split and is_activation_to_checkpoint(arg, view.world_size):
                arena = self.arena if use_arena else None
                part = self._observe(self._partition(slot, arg, view, arena))
                layout.append(SavedSlot(kind=SlotKind.PARTITION, value=part, **meta))
            elif self.policy.checkpoint_in_cpu and _offloadable(arg):
                handle = self.offloader().stash(arg.detach())
                layout.append(SavedSlot(kind=SlotKind.HOST_COPY, value=handle, **meta))
            else:
                layout.append(SavedSlot(kind=SlotKind.WHOLE, **meta))
                tensors.append(arg)
        return layout, tensors

    def _partition(
        self, slot: int, arg: torch.Tensor, view: ModelParallelView, arena: ContiguousArena | None
    ) -> torch.Tensor:
        flat = arg.detach().reshape(-1)
        size = partition_numel(flat.numel(), view.world_size)
        start = min(size * view.rank, flat.numel())
        mine = flat.narrow(0, start, min(size, flat.numel() - start))
        target_device = torch.device("cpu") if self.policy.checkpoint_in_cpu else flat.device
        if arena is not None:
            part = arena.take(slot, size, flat.dtype, target_device, int(self.policy.num_checkpoints or 1))
        else:
            part = torch.empty(size, dtype=flat.dtype, device=target_device)
        part.narrow(0, 0, mine.numel()).copy_(mine)
        # Zero the padding so the gathered buffer never holds uninitialised memory (it is sliced off anyway).
        part.narrow(0, mine.numel(), size - mine.numel()).zero_()
        return part

    # -- restoring
    def restore_inputs(self, layout: Sequence[SavedSlot], tensors: Sequence[torch.Tensor]) -> list[Any]:
        """Rebuild detached full inputs (gathering partitions) with their original ``requires_grad``."""
        view = self.view()
        pending = iter(tensors)
        inputs: list[Any] = []
        for slot in layout:
            if slot.kind is SlotKind.CONST:
                inputs.append(slot.value)
                continue
            if slot.kind is SlotKind.PARTITION:
                full = _gather(slot.value, slot, view)
            elif slot.kind is SlotKind.HOST_COPY:
                assert isinstance(slot.value, OffloadHandle)
                full = self.offloader().fetch(slot.value)
            else:
                full = next(pending)
            full = full.detach()
            full.requires_grad_(slot.requires_grad)
            inputs.append(full)
        return inputs


def _offloadable(arg: torch.Tensor) -> bool:
    # The hidden states: floating point, on the accelerator, part of the graph. Masks and position tables need no
    # gradient and are usually one tensor shared by every layer; copying it out once per layer would free nothing.
    return arg.is_floating_point() and arg.requires_grad and get_accelerator().on_accelerator(arg)


def _gather(part: torch.Tensor, slot: SavedSlot, view: ModelParallelView) -> torch.Tensor:
    size = part.numel()
    gathered = torch.empty(size * view.world_size, dtype=part.dtype, device=slot.device)
    # In-place all-gather: our share is copied into its own place in the output and that view is the input.
    # Handing the kept partition itself to the backend would let the collective's work object (released
    # asynchronously by some backends) extend its life past backward; this way only the gathered buffer, which
    # recomputation needs anyway, is ever referenced by the backend. It also saves a host-to-device temporary.
    mine = gathered.narrow(0, size * view.rank, size)
    mine.copy_(part)
    gather_rows(gathered, mine, view.group)
    shape = slot.shape
    assert shape is not None, "a PARTITION slot records its tensor's shape"
    return gathered.narrow(0, 0, math.prod(shape)).view(shape)


_STATE = ActivationCheckpointState()


def current_state() -> ActivationCheckpointState:
    """The process-wide state the façade functions and :class:`CheckpointFunction` share."""
    return _STATE


# ---------------------------------------------------------------------- the autograd function
@contextlib.contextmanager
def _timed(state: ActivationCheckpointState, phase: str) -> Iterator[None]:
    if not state.policy.profile:
        yield
        return
    state.boundary()
    start = time.perf_counter()
    yield
    get_accelerator().synchronize()
    elapsed = time.perf_counter() - start
    state.timings[phase] = state.timings.get(phase, 0.0) + elapsed
    log_dist(f"activation checkpointing {phase}: {elapsed * 1e3:.3f} ms", ranks=[0], level=logging.DEBUG)


def _tensor_leaves(structure: Any) -> tuple[list[Any], Any]:
    leaves, spec = pytree.tree_flatten(structure)
    return leaves, spec


class CheckpointFunction(torch.autograd.Function):
    """Reentrant checkpoint: ``apply(run_function, all_outputs, *args)``.

    ``run_function(*args)`` runs without building a graph; whatever it returns (tensor, or any nesting of
    tuples/lists/dicts with tensor and non-tensor leaves) is appended to ``all_outputs`` and the tensor leaves are
    returned, in order, as the differentiable outputs.
    """

    __module__ = FACADE_MODULE

    @staticmethod
    def forward(ctx: Any, run_function: Callable[..., Any], all_outputs: list[Any], *args: Any) -> Any:
        """Run ``run_function`` without a graph and keep only what :meth:`backward` needs to recompute it."""
        state = current_state()
        ctx.run_function = run_function
        ctx.rng = capture_rng(state.tracker)
        with _timed(state, "forward"), torch.no_grad():
            state.boundary()
            outputs = run_function(*args)
            state.boundary()
        ctx.layout, saved = state.save_inputs(args)
        ctx.save_for_backward(*saved)
        state.pending_backwards += 1
        all_outputs.append(outputs)
        leaves = [leaf for leaf in _tensor_leaves(outputs)[0] if torch.is_tensor(leaf)]
        ctx.mark_non_differentiable(*[t for t in leaves if not t.is_floating_point()])
        return tuple(leaves)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        """Recompute the forward under the saved RNG state and backpropagate through it."""
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "activation checkpointing does not support torch.autograd.grad(); use .backward() instead"
            )
        state = current_state()
        state.boundary()
        inputs = state.restore_inputs(ctx.layout, ctx.saved_tensors)
        # Drop the partitions/host copies now, before recomputation allocates activations again.
        ctx.layout = None
        state.pending_backwards = max(0, state.pending_backwards - 1)
        with _timed(state, "recompute"), replay_rng(ctx.rng, state.tracker), torch.enable_grad():
            outputs = ctx.run_function(*inputs)
        tensors = [leaf for leaf in _tensor_leaves(outputs)[0] if torch.is_tensor(leaf)]
        pairs = [
            (out, grad) for out, grad in zip(tensors, grads, strict=True) if out.requires_grad and grad is not None
        ]
        if not pairs:
            raise RuntimeError(
                "none of the checkpointed function's outputs requires grad; checkpoint() is not "
                "needed around this function"
            )
        with _timed(state, "backward"):
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        state.boundary()
        input_grads = tuple(inp.grad if torch.is_tensor(inp) else None for inp in inputs)
        return (None, None) + input_grads


class _KeywordCall:
    """Calls ``function`` with the trailing positional values re-bound to keyword names.

    ``autograd.Function.apply`` takes positional arguments only, so keyword tensors ride along as extra positional
    inputs (and get gradients like any other input).
    """

    def __init__(self, function: Callable[..., Any], n_positional: int, names: tuple[str, ...]) -> None:
        self.function, self.n_positional, self.names = function, n_positional, names

    def __call__(self, *values: Any) -> Any:
        head, tail = values[: self.n_positional], values[self.n_positional :]
        return self.function(*head, **dict(zip(self.names, tail, strict=True)))


def checkpoint(function: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Checkpoint ``function(*args, **kwargs)``; returns what ``function`` returns, tensors attached to the graph."""
    if not torch.is_grad_enabled():
        # Nothing can call backward: recomputation bookkeeping would be pure overhead (and would fill the
        # contiguous arena during evaluation).
        return function(*args, **kwargs)
    run = _KeywordCall(function, len(args), tuple(kwargs)) if kwargs else function
    all_outputs: list[Any] = []
    attached = CheckpointFunction.apply(run, all_outputs, *args, *kwargs.values())
    leaves, spec = _tensor_leaves(all_outputs[0])
    replacements = iter(attached)
    rebuilt = [next(replacements) if torch.is_tensor(leaf) else leaf for leaf in leaves]
    return pytree.tree_unflatten(rebuilt, spec)


# ---------------------------------------------------------------------- non-reentrant flavour
class _RecomputeFrame:
    """Saved-tensor hooks of one non-reentrant checkpointed call.

    Forward runs with the graph built normally, but every tensor autograd wants to save is replaced by its index.
    The first unpack in backward recomputes the function (same inputs, same RNG) with hooks that collect the
    tensors it saves, in the same order; each is handed out once and then dropped, so the recomputed activations
    live only while this segment's backward runs.
    """

    def __init__(self, state: ActivationCheckpointState, function: Callable[..., Any], args: Sequence[Any]) -> None:
        self.state, self.function = state, function
        self.rng = capture_rng(state.tracker)
        self.layout: list[SavedSlot] | None
        self.whole: list[torch.Tensor] | None
        self.layout, self.whole = state.save_inputs(args, ArenaUse.NEVER)
        self.count = 0
        self.recomputed: list[torch.Tensor] | None = None
        self.seen: set[int] = set()

    def pack(self, tensor: torch.Tensor) -> int:
        """Replace a tensor autograd would save by its position in the save order."""
        self.count += 1
        return self.count - 1

    def unpack(self, index: int) -> torch.Tensor:
        """Hand out the recomputed tensor for ``index`` (recomputing on first use)."""
        recomputed = self.recomputed if self.recomputed is not None else self._recompute()
        tensor = recomputed[index]
        self.seen.add(index)
        if len(self.seen) == self.count:
            # Every saved tensor has been consumed: the segment's backward is done, so its inputs (partitions)
            # and recomputed activations can go now rather than when the whole graph is freed.
            self.layout, self.whole, self.recomputed = None, None, None
        return tensor

    def _recompute(self) -> list[torch.Tensor]:
        if self.layout is None or self.whole is None:
            raise RuntimeError(
                "non_reentrant_checkpoint: backward through this segment already ran (its saved "
                "inputs were released); retain_graph=True is not supported here"
            )
        inputs = self.state.restore_inputs(self.layout, self.whole)
        collected: list[torch.Tensor] = []

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            collected.append(tensor)
            return tensor

        with (
            replay_rng(self.rng, self.state.tracker),
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(keep, _identity),
        ):
            self.function(*inputs)
        if len(collected) != self.count:
            raise RuntimeError(
                f"non_reentrant_checkpoint: recomputation saved {len(collected)} tensors but the "
                f"forward saved {self.count}; the function must be deterministic in its control flow"
            )
        self.recomputed = list(collected)
        return self.recomputed


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def non_reentrant_checkpoint(function: Callable[..., Any], args: Sequence[Any]) -> Any:
    """Checkpoint ``function(*args)`` through saved-tensor hooks (works with ``torch.autograd.grad``).

    Inputs are kept (partitioned / offloaded) exactly as :func:`checkpoint` keeps them, except that the contiguous
    arena is not used.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    frame = _RecomputeFrame(current_state(), function, args)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return function(*args)


# ---------------------------------------------------------------------- seeding
def model_parallel_seed(seed: int, tp_rank: int) -> int:
    """Seed of the model-parallel stream for tensor-parallel rank ``tp_rank``."""
    return seed + TP_SEED_OFFSET + tp_rank


def seed_model_parallel(state: ActivationCheckpointState, seed: int) -> None:
    """Seed the default generator with ``seed`` and a fresh model-parallel tracker stream per TP rank."""
    tp_rank = state.view().rank
    stream_seed = model_parallel_seed(seed, tp_rank)
    log_dist(
        f"model parallel seeds: tp rank {tp_rank}, data-parallel seed {seed}, model-parallel seed {stream_seed}",
        ranks=[0],
        level=logging.DEBUG,
    )
    state.tracker.reset()
    get_accelerator().manual_seed(seed)
    state.tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, stream_seed)


def reseed_tensor_parallel(state: ActivationCheckpointState, seed: int) -> None:
    """Re-seed only the model-parallel stream (the default generator keeps its position)."""
    with state.tracker.fork():
        get_accelerator().manual_seed(model_parallel_seed(seed, state.view().rank))


# ---------------------------------------------------------------------- configuration check
CPU_CHECKPOINTING_KEY = "activation_checkpointing.cpu_checkpointing"


def cpu_checkpointing_problem(model: torch.nn.Module) -> str | None:
    """Why ``cpu_checkpointing`` cannot apply to ``model`` (``None`` when it can); warns where it applies elsewhere.

    The offload acts on ``deepspeed.checkpointing`` (configured, or used by a pipeline model). A model that only
    uses its own gradient checkpointing (Hugging Face ``gradient_checkpointing_enable``) is offloaded by the
    hidden-states context manager instead, which the warning names.
    """
    pipeline = int(getattr(model, "activation_checkpoint_interval", 0) or 0) > 0
    if current_state().configured or pipeline:
        return None
    own = bool(getattr(model, "is_gradient_checkpointing", False)) or any(
        getattr(m, "gradient_checkpointing", False) is True for m in model.modules()
    )
    if own:
        logger.warning(
            f"{CPU_CHECKPOINTING_KEY}=true applies to deepspeed.checkpointing; this model's own gradient "
            "checkpointing is offloaded inside deepspeed.runtime.activation_checkpointing.offload_activations."
            "get_checkpoint_hidden_states_offloading_ctx_manager() (wrap each step's forward and backward in it)"
        )
        return None
    return (
        f"{CPU_CHECKPOINTING_KEY}=true, but activation checkpointing is not in use, so nothing would be offloaded: "
        "call deepspeed.checkpointing.configure(mpu, deepspeed_config=...) and checkpoint layers with "
        "deepspeed.checkpointing.checkpoint, enable the model's gradient checkpointing, or set "
        f"{CPU_CHECKPOINTING_KEY} to false"
    )
