"""The torch.distributed backend behind ``deepspeed.comm``: the only module that imports torch.distributed.

Portability rules kept here so callers can use one verb on any backend:

* ``ReduceOp.AVG`` on backends without a native average (gloo, mpi) runs as SUM followed by a division by the
  group size. For async calls the division happens inside the returned handle's ``wait()``.
* ``reduce_scatter_tensor``, ``reduce_scatter``, ``all_gather_into_tensor`` and ``all_to_all`` first try the
  native collective; if the backend reports it unsupported, the verb is remembered as missing for that backend and
  a portable fallback (all-reduce then slice, all-gather into views, all-to-all-single) is used from then on.
  Unsupported-op errors are raised before any data moves and identically on every rank, so switching is safe.
* The ``fake`` backend (``torch.testing._internal.distributed.fake_pg``) simulates any world size in one process:
  collectives return immediately without moving data. Benchmarks use it to build large-world layouts on one GPU.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as _td

from deepspeed._core.comm.reduce_op import ReduceOp
from deepspeed._foundation.logging import logger

ProcessGroup = _td.ProcessGroup
Work = _td.Work

FAKE_BACKEND = "fake"
# Process-group backends that have no native AVG reduction.
_NO_NATIVE_AVG = frozenset({"gloo", "mpi"})
_UNSUPPORTED_MARKERS = ("does not support", "not supported", "not implemented", "unsupported")

# Newer torch renamed the flat-tensor collectives; prefer the new names to avoid deprecation warnings.
_all_gather_flat = getattr(_td, "all_gather_single", None) or _td.all_gather_into_tensor
_reduce_scatter_flat = getattr(_td, "reduce_scatter_single", None) or _td.reduce_scatter_tensor

# Run once a collective's work completes (copy-outs, host-side averaging); what it returns is ignored.
Post = Callable[[], object]


def is_available() -> bool:
    """True when torch was built with distributed support."""
    return _td.is_available()


def torch_dist_initialized() -> bool:
    """True when a default torch process group exists (ours or the user's)."""
    return _td.is_available() and _td.is_initialized()


def to_torch_op(op: Any) -> Any:
    """Convert a :class:`ReduceOp` to ``torch.distributed.ReduceOp``; torch ops pass through unchanged."""
    if isinstance(op, ReduceOp):
        if op is ReduceOp.UNUSED:
            raise ValueError("ReduceOp.UNUSED is a placeholder and cannot be used in a collective")
        return getattr(_td.ReduceOp, op.name)
    return op


def _is_avg(op: Any) -> bool:
    return op is ReduceOp.AVG or op == _td.ReduceOp.AVG


def _divide_(tensor: torch.Tensor, divisor: int) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(divisor)
    else:
        tensor.floor_divide_(divisor)


def _is_unsupported(err: Exception) -> bool:
    text = str(err).lower()
    return any(marker in text for marker in _UNSUPPORTED_MARKERS)


class PostWork:
    """Handle for async collectives that need a host-side step (divide, copy-out) once the transfer finishes.

    ``wait()`` waits for every underlying torch work object, then runs the step exactly once. ``is_completed()``
    reports the transfer only; call ``wait()`` before reading the result.
    """

    def __init__(self, works: Sequence[Any], post: Post | None) -> None:
        self._works = [w for w in works if w is not None]
        self._post = post

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective and its host-side step are done."""
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        if self._post is not None:
            post, self._post = self._post, None
            post()
        return True

    def is_completed(self) -> bool:
        """True when all underlying transfers have finished."""
        return all(work.is_completed() for work in self._works)

    def is_success(self) -> bool:
        """True when all underlying transfers finished without error."""
        return all(work.is_success() for work in self._works) if self._works else True


def _finish(works: Sequence[Any], async_op: bool, post: Post | None = None) -> Any:
    """Return a handle (async) or complete the call now (sync); sub-ops are always issued async."""
    if async_op:
        if post is None and len(works) == 1:
            return works[0]
        return PostWork(works, post)
    PostWork(works, post).wait()
    return None


def _then(first: Post | None, second: Post | None) -> Post | None:
    if first is None or second is None:
        return first or second

    def both() -> None:
        first()
        second()

    return both


def _init_fake_process_group(rank: int, world_size: int, timeout: timedelta) -> None:
    # Importing fake_pg registers the "fake" backend with torch; FakeStore needs no rendezvous.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = rank if rank >= 0 else int(os.environ.get("RANK", "0"))
    world_size = world_size if world_size > 0 else int(os.environ.get("WORLD_SIZE", "1"))
    _td.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size, timeout=timeout)


_teardown_registered = False


def _register_teardown() -> None:
    """Destroy the default group at interpreter exit (once): a group still alive then is torn down in arbitrary
    order and its worker threads can abort the process ("terminate called without an active exception", exit 134)
    after a successful run. This holds for a group another library created (HF Trainer's accelerate starts the
    gloo group before DeepSpeed does), which is how the abort still reached an HF Trainer test in 2 of 10 runs."""
    global _teardown_registered
    if not _teardown_registered:
        _teardown_registered = True
        atexit.register(_destroy_default_group_at_exit)


def _destroy_default_group_at_exit() -> None:
    """Destroy the default group if the program did not (local teardown, no collective)."""
    if torch_dist_initialized():
        try:
            _td.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort while the interpreter shuts down
            pass


class TorchBackend:
    """``deepspeed.comm`` backend over torch.distributed process groups."""

    def __init__(
        self,
        backend: str | None,
        timeout: timedelta,
        init_method: str | None,
        rank: int = -1,
        world_size: int = -1,
        name: str = "torch",
    ) -> None:
        self.name = name
        self.using_mpi = backend == "mpi"
        self.has_all_reduce_coalesced = True
        self.has_coalescing_manager = hasattr(_td, "_coalescing_manager")
        self._native: dict[tuple[str, str], bool] = {}
        if not torch_dist_initialized():
            self.init_process_group(backend, timeout, init_method, rank, world_size)
        _register_teardown()

    def init_process_group(
        self, backend: str | None, timeout: timedelta, init_method: str | None, rank: int, world_size: int
    ) -> None:
        """Create the default process group (``backend='fake'`` builds a simulated one, see module docstring)."""
        if backend == FAKE_BACKEND:
            _init_fake_process_group(rank, world_size, timeout)
            return
        _td.init_process_group(backend, init_method=init_method, timeout=timeout, rank=rank, world_size=world_size)
        _register_teardown()

    # ------------------------------------------------------------------ group queries
    def is_initialized(self) -> bool:
        """True while the default process group exists."""
        return torch_dist_initialized()

    def destroy_process_group(self, group: ProcessGroup | None = None) -> None:
        """Destroy ``group`` (the default group and all subgroups when ``None``)."""
        _td.destroy_process_group(group)

    def new_group(self, ranks: Sequence[int]) -> ProcessGroup:
        """Collective over the world group: every rank must call it with the same ``ranks``."""
        return _td.new_group(ranks=list(ranks))

    def get_backend(self, group: ProcessGroup | None = None) -> str:
        """Backend name of ``group`` (``'gloo'``, ``'nccl'``, ``'fake'``, ...)."""
        return str(_td.get_backend(group))

    def get_rank(self, group: ProcessGroup | None = None) -> int:
        """Rank of this process in ``group`` (-1 when not a member)."""
        return _td.get_rank(group)

    def get_world_size(self, group: ProcessGroup | None = None) -> int:
        """Number of ranks in ``group``."""
        return _td.get_world_size(group)

    def get_global_rank(self, group: ProcessGroup | None, group_rank: int) -> int:
        """Global rank of ``group_rank`` within ``group``."""
        if group is None or group is _td.group.WORLD:
            return group_rank
        return _td.get_global_rank(group, group_rank)

    def get_all_ranks_from_group(self, group: ProcessGroup | None = None) -> list[int]:
        """Global ranks of every member of ``group``, in group-rank order."""
        return list(_td.get_process_group_ranks(group if group is not None else _td.group.WORLD))

    def get_world_group(self) -> ProcessGroup:
        """The default (world) process group."""
        world = _td.group.WORLD
        if world is None:  # this backend exists only after init_process_group, so this means it was destroyed
            raise RuntimeError("the default process group is not initialised (or was destroyed)")
        return world

    def init_device_mesh(self, mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]) -> Any:
        """A torch ``DeviceMesh`` over the accelerator's device type."""
        from torch.distributed.device_mesh import init_device_mesh

        from deepspeed.accelerator import get_accelerator

        return init_device_mesh(get_accelerator().device_name(), mesh_shape, mesh_dim_names=mesh_dim_names)

    def has_all_gather_into_tensor(self) -> bool:
        """Always True: a fallback covers backends without the native verb."""
        return True

    def has_reduce_scatter_tensor(self) -> bool:
        """Always True: a fallback covers backends without the native verb."""
        return True

    # ------------------------------------------------------------------ helpers
    def _lacks_avg(self, group: ProcessGroup | None) -> bool:
        return self.get_backend(group) in _NO_NATIVE_AVG

    def _wire_op(self, op: Any, group: ProcessGroup | None) -> tuple[Any, bool]:
        """(op to send on the wire, whether AVG must be finished on the host)."""
        if _is_avg(op) and self._lacks_avg(group):
            return _td.ReduceOp.SUM, True
        return to_torch_op(op), False

    def _issue(
        self,
        verb: str,
        group: ProcessGroup | None,
        native: Callable[[], Any],
        fallback: Callable[[], tuple[Any, Post | None]],
    ) -> tuple[Any, Post | None]:
        key = (verb, self.get_backend(group))
        if self._native.get(key, True):
            try:
                return native(), None
            except (RuntimeError, NotImplementedError, ValueError) as err:
                if not _is_unsupported(err):
                    raise
                self._native[key] = False
                logger.warning(f"{key[1]} has no native {verb} ({err}); using the portable fallback")
        return fallback()

    # ------------------------------------------------------------------ reductions
    def all_reduce(
        self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        """In-place all-reduce of ``tensor``."""
        wire_op, host_avg = self._wire_op(op, group)
        work = _td.all_reduce(tensor, op=wire_op, group=group, async_op=True)
        post = (lambda: _divide_(tensor, self.get_world_size(group))) if host_avg else None
        return _finish([work], async_op, post)

    def inference_all_reduce(
        self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None
    ) -> None:
        """Blocking all-reduce (upstream routes this to a low-latency kernel; plain all-reduce here)."""
        return self.all_reduce(tensor, op, group, async_op=False)

    def all_reduce_coalesced(
        self,
        tensors: Sequence[torch.Tensor],
        op: Any = ReduceOp.SUM,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """All-reduce many tensors with one collective per dtype (flatten, reduce, copy back)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        works, posts = [], []
        for members in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in members])
            works.append(self.all_reduce(flat, op, group, async_op=True))
            posts.append(_copy_back_fn(flat, members))
        return _finish(works, async_op, _run_all(posts))

    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        op: Any = ReduceOp.SUM,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``tensor`` onto global rank ``dst``."""
        wire_op, host_avg = self._wire_op(op, group)
        work = _td.reduce(tensor, dst, op=wire_op, group=group, async_op=True)
        post = None
        if host_avg and _td.get_rank() == dst:
            post = lambda: _divide_(tensor, self.get_world_size(group))  # noqa: E731
        return _finish([work], async_op, post)

    def reduce_scatter_tensor(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        op: Any = ReduceOp.SUM,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``input_tensor`` (world_size * output numel) and keep this rank's slice in ``output_tensor``."""
        wire_op, host_avg = self._wire_op(op, group)

        def native() -> Any:
            return _reduce_scatter_flat(output_tensor, input_tensor, op=wire_op, group=group, async_op=True)

        def fallback() -> tuple[Any, Post]:
            # Costs a full-size scratch buffer; only backends without the native verb pay it.
            scratch = input_tensor.detach().clone().reshape(-1)
            work = _td.all_reduce(scratch, op=wire_op, group=group, async_op=True)
            start = self.get_rank(group) * output_tensor.numel()
            mine = scratch.narrow(0, start, output_tensor.numel()).view_as(output_tensor)
            return work, lambda: output_tensor.copy_(mine)

        work, copy_out = self._issue("reduce_scatter_tensor", group, native, fallback)
        avg = (lambda: _divide_(output_tensor, self.get_world_size(group))) if host_avg else None
        return _finish([work], async_op, _then(copy_out, avg))

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        op: Any = ReduceOp.SUM,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce the i-th entry of every rank's ``input_list`` into rank i's ``output``."""
        wire_op, host_avg = self._wire_op(op, group)

        def native() -> Any:
            return _td.reduce_scatter(output, list(input_list), op=wire_op, group=group, async_op=True)

        def fallback() -> tuple[Any, Post]:
            scratch = torch.cat([t.reshape(-1) for t in input_list])
            work = _td.all_reduce(scratch, op=wire_op, group=group, async_op=True)
            rank = self.get_rank(group)
            start = sum(t.numel() for t in input_list[:rank])
            mine = scratch.narrow(0, start, output.numel()).view_as(output)
            return work, lambda: output.copy_(mine)

        work, copy_out = self._issue("reduce_scatter", group, native, fallback)
        avg = (lambda: _divide_(output, self.get_world_size(group))) if host_avg else None
        return _finish([work], async_op, _then(copy_out, avg))

    # ------------------------------------------------------------------ gathers
    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Gather every rank's ``tensor`` into ``tensor_list``."""
        return _td.all_gather(tensor_list, tensor, group=group, async_op=async_op)

    def all_gather_into_tensor(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Concatenate every rank's ``input_tensor`` (rank order) into ``output_tensor``."""

        def native() -> Any:
            return _all_gather_flat(output_tensor, input_tensor, group=group, async_op=True)

        def fallback() -> tuple[Any, None]:
            rows = list(output_tensor.view(self.get_world_size(group), -1).unbind(0))
            return _td.all_gather(rows, input_tensor.reshape(-1), group=group, async_op=True), None

        work, _ = self._issue("all_gather_into_tensor", group, native, fallback)
        return _finish([work], async_op)

    def all_gather_coalesced(
        self,
        output_tensors: Sequence[torch.Tensor],
        input_tensors: Sequence[torch.Tensor],
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """``all_gather_into_tensor`` for each (output, input) pair, completed by one handle."""
        works = [
            self.all_gather_into_tensor(o, i, group, async_op=True)
            for o, i in zip(output_tensors, input_tensors, strict=True)
        ]
        return _finish(works, async_op)

    def all_gather_object(self, object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
        """Gather a picklable object from every rank."""
        return _td.all_gather_object(object_list, obj, group=group)

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list[torch.Tensor] | None = None,
        dst: int = 0,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Gather every rank's ``tensor`` into ``gather_list`` on global rank ``dst``."""
        return _td.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: list[torch.Tensor] | None = None,
        src: int = 0,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Send the i-th entry of ``scatter_list`` on ``src`` to rank i's ``tensor``."""
        return _td.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)

    # ------------------------------------------------------------------ all-to-all
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Split ``input`` across ranks and concatenate what each rank sent into ``output``."""
        return _td.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )

    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Send ``input_tensor_list[i]`` to rank i and receive rank i's tensor into ``output_tensor_list[i]``."""

        def native() -> Any:
            return _td.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=True)

        def fallback() -> tuple[Any, Post]:
            flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
            out_sizes = [t.numel() for t in output_tensor_list]
            flat_out = flat_in.new_empty(sum(out_sizes))
            in_sizes = [t.numel() for t in input_tensor_list]
            work = _td.all_to_all_single(flat_out, flat_in, out_sizes, in_sizes, group=group, async_op=True)
            return work, _copy_back_fn(flat_out, output_tensor_list)

        work, copy_out = self._issue("all_to_all", group, native, fallback)
        return _finish([work], async_op, copy_out)

    # ------------------------------------------------------------------ point-to-point and broadcast
    def broadcast(
        self, tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        """Copy ``tensor`` from global rank ``src`` to every rank of ``group``."""
        return _td.broadcast(tensor, src, group=group, async_op=async_op)

    def broadcast_object_list(
        self, object_list: list[Any], src: int, group: ProcessGroup | None = None, device: Any = None
    ) -> None:
        """Broadcast picklable objects from global rank ``src``."""
        return _td.broadcast_object_list(object_list, src, group=group, device=device)

    def send(self, tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
        """Blocking send to global rank ``dst``."""
        return _td.send(tensor, dst, group=group, tag=tag)

    def recv(
        self, tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0
    ) -> int:
        """Blocking receive; returns the sender's rank."""
        return _td.recv(tensor, src, group=group, tag=tag)

    def isend(self, tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> Any:
        """Non-blocking send; returns a work handle."""
        return _td.isend(tensor, dst, group=group, tag=tag)

    def irecv(
        self, tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0
    ) -> Any:
        """Non-blocking receive; returns a work handle."""
        return _td.irecv(tensor, src, group=group, tag=tag)

    def barrier(
        self, group: ProcessGroup | None = None, async_op: bool = False, device_ids: list[int] | None = None
    ) -> Any:
        """Block until every rank of ``group`` arrives."""
        return _td.barrier(group=group, async_op=async_op, device_ids=device_ids)

    def monitored_barrier(
        self, group: ProcessGroup | None = None, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> Any:
        """Barrier that names the missing ranks on timeout (gloo only; a plain barrier elsewhere)."""
        if self.get_backend(group) != "gloo":
            return _td.barrier(group=group)
        return _td.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def _copy_back_fn(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Post:
    def copy_back() -> None:
        offset = 0
        for t in tensors:
            t.copy_(flat.narrow(0, offset, t.numel()).view_as(t))
            offset += t.numel()

    return copy_back


def _run_all(posts: list[Post]) -> Post | None:
    if not posts:
        return None

    def run() -> None:
        for post in posts:
            post()

    return run
