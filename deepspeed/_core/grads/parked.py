"""Gradients parked in their parameters' own shards between the backward and the step (ZeRO-3, optimizer offload).

[Note: parked grads]
With the optimizer on the host, a reduced gradient shard used to be copied into host chunks of the group's
gradient shard: 2 bytes per owned parameter of host memory on top of the fp32 master and moments (12), until the
step. The clipping norm needs every gradient before any update, so the gradient must live somewhere until then.

It can live in the parameter's shard. In a window of one micro-step, a parameter's shard is not read again after
its gradient arrived: that gradient is final only once every use of the parameter has been differentiated
(``AccumulateGrad`` runs after the last one), the next read is the next forward's gather, and the step rewrites
every shard from the fp32 master anyway (the shard is always ``master`` rounded to the working dtype). So the
first fold of such a region copies the reduced gradient into the shard (same dtype, same numel, on the device or
in pinned host memory with ``offload_param``) and no host chunk is allocated for it.

The parameter's state says so: a parked region's ``ZeroParam.shard_content`` is ``ShardContent.GRADIENT``, and
:class:`ParkedGrads`, registered once per managed parameter as its ``grad_holder``, owns the moves. Every read of
the shard before the step goes through an eviction: a gather (``Gatherer.start_gather``) and a shard write
(``ZeroParam.write_shard_from``) ask ``ZeroParam.restore_values``, which calls the holder's ``evict``;
``safe_get_*`` of the gradient evicts directly. A second fold into the same region (a tied parameter's other use)
is added in the shard where the first waits, when both are on one device (``add_in_place``); otherwise it evicts
too. The eviction copies the gradient
into its ordinary accumulator region and restores the shard from the master, so the parameter's values and the
gradient are both what they would have been; only the memory saving of that region is lost. An overflow skip or
``zero_grad`` restores every parked shard the same way. With one rank the gathered tensor is the shard itself, so
a gradient that arrives while its parameter is still gathered waits (held as the reduced piece, the shard
``GRADIENT_INCOMING``) until ``ZeroParam.mark_sharded`` releases the parameter and hands it to the holder's
``released``.

Eligible: window of one micro-step, gradient dtype equal to the shard's, a parameter that no
``GatheredParameters`` context holds. Persistent parameters (small, always gathered) keep theirs in a side tensor
of their own instead, so that they do not bring back a host accumulator chunk; each parameter's side tensor is
kept for the next steps and, with ``pin_memory``, page-locked, so its copy down does not block the backward. Switch:
``zero_optimization.lean_grads_in_param_shards``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.comm.pinned_pool import Pinning
from deepspeed._core.comm.streams import record_current
from deepspeed._core.grads.accumulator import ChunkedGradShard
from deepspeed._core.grads.convert import Coef, convert_scaled
from deepspeed._core.params.param import ShardedState, ZeroParam


@dataclass
class Parked:
    """One region whose gradient waits outside the accumulator: in its parameter's shard, or (``side``) in a
    small host tensor of its own."""

    state: ZeroParam
    group: int
    offset: int  # start of the state's shard inside the group's flat shard
    side: torch.Tensor | None = None

    def grad(self) -> torch.Tensor:
        """The flat gradient (``partition_numel`` elements)."""
        return self.state.shard.reshape(-1) if self.side is None else self.side


class ParkedGrads:
    """Which regions hold their gradient in their parameter's shard (or a side tensor), and the moves in and out:
    the :class:`~deepspeed._core.params.param.ShardGradHolder` of the parameters it may park in (:meth:`hold`).

    Persistent parameters (small, always gathered: with one rank the gathered tensor is their shard) keep their
    gradient in a side tensor of their own, so that they do not make the host allocate an accumulator chunk.

    Args:
        master_of: group index -> the group's fp32 master (flat, on the host).
        accumulator_of: group index -> the group's gradient shard (``ChunkedGradShard``), created on demand.
        copy_to_host: ``(target, piece)``: an asynchronous device-to-host copy (the optimizer's transfer ring).
        drain: wait for those copies.
        side_dtype: dtype of the side tensors (the accumulator's).
        restore: ``(shard, values)``: write a master slice back into a shard on another device, converting on
            the way (``None``: a plain ``copy_``).
        pinning: whether side tensors on the host are page-locked (then filled without blocking through
            ``copy_to_host``) or pageable.
    """

    def __init__(
        self,
        master_of: Callable[[int], torch.Tensor],
        accumulator_of: Callable[[int], ChunkedGradShard],
        copy_to_host: Callable[[torch.Tensor, torch.Tensor], None],
        drain: Callable[[], None],
        side_dtype: torch.dtype,
        restore: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        pinning: Pinning = Pinning.PAGEABLE,
    ) -> None:
        self._master_of = master_of
        self._restore_into = restore
        self._pin_side = pinning is Pinning.PAGE_LOCKED
        self._side_buffers: dict[int, torch.Tensor] = {}  # ds_id -> that parameter's side tensor, reused
        self._accumulator_of = accumulator_of
        self._copy_to_host = copy_to_host
        self._drain = drain
        self._side_dtype = side_dtype
        self.parked: dict[int, Parked] = {}  # ds_id -> region
        self._waiting: dict[int, tuple[Parked, torch.Tensor]] = {}  # one rank: reduced piece held until release
        # Told ``(state)`` once a gradient held until its parameter's release is stored ([Note: final gradient
        # count] waits for it), and before a parked or held gradient moves (evict) while something may read it.
        self.on_stored: Callable[[ZeroParam], None] | None = None
        self.on_move: Callable[[ZeroParam], None] | None = None

    def __len__(self) -> int:
        return len(self.parked)

    def hold(self, states: list[ZeroParam]) -> None:
        """Become the gradient holder of ``states`` (once, when parking is enabled)."""
        for state in states:
            state.hold_grads_with(self)

    def let_go(self, states: list[ZeroParam]) -> None:
        """Stop holding ``states``' gradients; nothing of them may be parked any more."""
        for state in states:
            if state.grad_holder is self:
                state.hold_grads_with(None)

    @staticmethod
    def can_park(state: ZeroParam, piece: torch.Tensor) -> bool:
        """True when ``piece`` (a region's first, final gradient of the window) may wait outside the accumulator."""
        if piece.numel() != state.shard.numel():
            return False
        return state.is_persistent or (state.context_holds == 0 and piece.dtype == state.shard.dtype)

    def park(self, state: ZeroParam, group: int, offset: int, piece: torch.Tensor) -> None:
        """Store ``piece`` in ``state``'s shard (or hold it until the one-rank parameter is released)."""
        region = Parked(state, group, offset)
        if state.is_persistent:
            self._store_aside(region, piece)
        elif state.aliases_shard and state.state is not ShardedState.SHARDED:
            # One rank: the gathered tensor is the shard and the module may still read it.
            state.mark_gradient_incoming()
            self._waiting[state.ds_id] = (region, piece)
        else:
            self._store(region, piece)

    def _store(self, region: Parked, piece: torch.Tensor) -> None:
        shard = region.state.shard.reshape(-1)
        if shard.device == piece.device:
            shard.copy_(piece)
        else:
            self._copy_to_host(shard, piece)
        region.state.mark_gradient()
        self.parked[region.state.ds_id] = region

    def _store_aside(self, region: Parked, piece: torch.Tensor) -> None:
        side = self._side_buffers.get(region.state.ds_id)
        device = self._master_of(region.group).device
        if side is None or side.numel() != piece.numel() or side.device != device:
            pin = self._pin_side and device.type == "cpu" and piece.device.type != "cpu"
            side = torch.empty(piece.numel(), dtype=self._side_dtype, device=device, pin_memory=pin)
            self._side_buffers[region.state.ds_id] = side
        region.side = side
        if side.is_pinned() and side.dtype == piece.dtype:
            # Page-locked: an ordered copy that does not block; flush() and evict() wait for it. A pageable copy
            # down waits for the device queue, once per persistent parameter in every backward.
            self._copy_to_host(side, piece)
        else:
            side.copy_(piece)
        self.parked[region.state.ds_id] = region

    def add_in_place(self, state: ZeroParam, piece: torch.Tensor) -> bool:
        """A later gradient of a region parked in its own shard on ``piece``'s device (a tied parameter's second
        use): add it there and return ``True``; ``False`` (nothing done) for any other region.

        Moving the gradient to the accumulator instead (:meth:`evict`) allocated host chunks for it, copied it down,
        restored the shard's values from the host master and added the new piece on the host: about 0.2 s per step
        for the 3B model's tied embedding on the H100. Parking requires the accumulator's dtype, so the sum is the
        same single rounding either way.
        """
        region = self.parked.get(state.ds_id)
        if region is None or region.side is not None or state.ds_id in self._waiting:
            return False
        shard = state.shard.reshape(-1)
        if shard.device != piece.device or shard.dtype != piece.dtype or shard.numel() != piece.numel():
            return False
        with torch.no_grad():
            shard.add_(piece.reshape(-1))
        return True

    def released(self, state: ZeroParam) -> None:
        """The parameter manager released ``state``: a gradient waiting for it can move in now."""
        waiting = self._waiting.pop(state.ds_id, None)
        if waiting is not None:
            self._store(*waiting)
            if self.on_stored is not None:
                self.on_stored(state)

    def waiting(self, state: ZeroParam) -> bool:
        """Whether ``state``'s gradient is held until its parameter is released (not in place yet)."""
        return state.ds_id in self._waiting

    def settle(self) -> None:
        """End of the backward: gradients still waiting (their parameter stayed gathered) go to side tensors."""
        for region, piece in self._waiting.values():
            region.state.mark_values()
            self._store_aside(region, piece)
        self._waiting.clear()

    def evict(self, state: ZeroParam) -> None:
        """Move ``state``'s gradient into its accumulator region and put the parameter values back (no-op when
        nothing of ``state`` is parked)."""
        if self.on_move is not None and (state.ds_id in self.parked or state.ds_id in self._waiting):
            self.on_move(state)
        waiting = self._waiting.pop(state.ds_id, None)
        if waiting is not None:
            incoming, piece = waiting
            self._accumulator_of(incoming.group).write(incoming.offset, piece)
        region = self.parked.pop(state.ds_id, None)
        if region is None:
            state.mark_values()
            return
        self._drain()  # a copy into a host shard may still be in flight
        self._accumulator_of(region.group).write(region.offset, region.grad())
        if region.side is None:
            self._restore(region)
        state.mark_values()

    def _restore(self, region: Parked) -> None:
        shard = region.state.shard.reshape(-1)
        values = self._master_of(region.group)[region.offset : region.offset + shard.numel()]
        with torch.no_grad():
            if self._restore_into is not None and values.device != shard.device:
                # A host master into a device shard: one plain copy_ converted the whole slice on the host and sent
                # it from pageable memory, blocking (157 ms for the 3B model's tied embedding on the H100).
                self._restore_into(shard, values)
            else:
                shard.copy_(values)

    def in_group(self, group: int) -> list[Parked]:
        """The parked regions of ``group``, by offset."""
        return sorted((r for r in self.parked.values() if r.group == group), key=lambda r: r.offset)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding parked gradients (for the clipping norm)."""
        return [r.grad() for r in self.parked.values()]

    def restore_all(self) -> None:
        """Drop every parked gradient and put the parameter values back (overflow skip, ``zero_grad``)."""
        self._drain()
        for region in self.parked.values():
            if region.side is None:
                self._restore(region)
        self.forget()

    def forget(self) -> None:
        """After a step wrote every shard from the master: nothing is parked any more."""
        for region in self.parked.values():
            region.state.mark_values()
        for region, _ in self._waiting.values():
            region.state.mark_values()
        self.parked.clear()
        self._waiting.clear()


class ParkedWindow:
    """A group's gradient for :func:`~deepspeed._core.optim.chunked_step.step_in_chunks`: the parked regions plus
    the accumulator (or zeros) in between, assembled one step chunk at a time.

    Two reused buffers alternate: while the host steps one chunk, the device-resident parked gradients of the next
    chunk are already being copied into the other buffer (non-blocking, page-locked under ``pin_memory``), so the
    step does not wait on those reads. Host-resident pieces (side tensors, shards offloaded with
    ``offload_param``, the accumulator) are read when their chunk is asked for: converted straight into the
    step's fp32 buffer (:meth:`convert_into`) when the chunk has no device-resident piece.
    """

    def __init__(
        self,
        accumulator: ChunkedGradShard,
        regions: list[Parked],
        buffers: list[torch.Tensor],
        chunk_numel: int,
        numel: int,
    ) -> None:
        """``buffers``: two tensors of at least ``chunk_numel`` elements in the accumulator's dtype, on the
        master's device; ``numel``: the group's flat size (the chunks are ``[k * chunk_numel, ...)``)."""
        self.accumulator = accumulator
        self.regions = regions
        self.buffers = buffers
        self.chunk_numel = chunk_numel
        self.numel = numel
        self._next = 0  # which buffer the next window uses
        self._prefetched: dict[int, tuple[int, Any]] = {}  # window start -> (buffer index, completion event)

    def _overlapping(self, start: int, end: int) -> list[Parked]:
        return [r for r in self.regions if r.offset < end and r.offset + r.state.shard.numel() > start]

    def _copy_device_pieces(self, start: int, end: int, out: torch.Tensor) -> Any:
        """Start copying the device-resident parked pieces of ``[start, end)``; returns an event or ``None``."""
        issued = False
        for region in self._overlapping(start, end):
            grad = region.grad()
            if grad.device.type == "cpu":
                continue
            lo, hi = max(start, region.offset), min(end, region.offset + grad.numel())
            out[lo - start : hi - start].copy_(grad[lo - region.offset : hi - region.offset], non_blocking=True)
            issued = True
        if not issued:
            return None
        return record_current()

    def window(self, start: int, end: int) -> torch.Tensor:
        """The gradient of ``[start, end)``."""
        if not self._overlapping(start, end):
            return self.accumulator.window(start, end)
        staged = self._staged(start, end)  # the device-resident pieces are in it already
        self._fill(start, end, staged, lambda dst, src: dst.copy_(src))
        return staged

    def convert_into(self, start: int, end: int, out: torch.Tensor, coef: Coef) -> bool:
        """Write the gradient of ``[start, end)`` times ``coef`` into ``out`` (the step's conversion buffer), each
        piece converted from where it lies: one pass over host-resident pieces (shards offloaded with
        ``offload_param``, side tensors) instead of a copy and a conversion.

        Returns ``False`` (nothing written) for a range without parked regions, or with any on the device: those
        go through :meth:`window`'s staged, prefetched buffers (the path measured on the H200, ``parked/``)."""
        overlapping = self._overlapping(start, end)
        if not overlapping or any(r.grad().device.type != "cpu" for r in overlapping):
            return False
        self._fill(start, end, out, lambda dst, src: convert_scaled(dst, src, coef))
        return True

    def _staged(self, start: int, end: int) -> torch.Tensor:
        """The buffer holding ``[start, end)``'s device-resident pieces, copied (or being copied) in; the next
        range's copies are issued, into the other buffer, before this one's are waited for."""
        prefetched = self._prefetched.pop(start, None)
        if prefetched is not None:
            index, event = prefetched
        else:
            index = self._next
            event = self._copy_device_pieces(start, end, self.buffers[index])
        self._next = 1 - index
        nxt = min(end + self.chunk_numel, self.numel)
        if end < self.numel and self._overlapping(end, nxt):
            self._prefetched[end] = (self._next, self._copy_device_pieces(end, nxt, self.buffers[self._next]))
        if event is not None:
            event.synchronize()
        return self.buffers[index][: end - start]

    def _fill(
        self, start: int, end: int, out: torch.Tensor, put: Callable[[torch.Tensor, torch.Tensor], object]
    ) -> None:
        """``put(out_piece, source_piece)`` for the host-resident regions of ``[start, end)`` and for the gaps (from
        the accumulator, which holds evicted regions, else zeros). Device-resident regions are left alone: only
        :meth:`window` has them, already staged into ``out``."""
        held = self.accumulator.holds(start, end)
        cursor = start
        for region in self._overlapping(start, end) + [None]:
            lo = end if region is None else max(start, region.offset)
            if lo > cursor:
                gap = out[cursor - start : lo - start]
                if held:
                    put(gap, self.accumulator.window(start, end)[cursor - start : lo - start])
                else:
                    gap.zero_()
            if region is None:
                break
            grad = region.grad()
            hi = min(end, region.offset + grad.numel())
            if grad.device.type == "cpu":
                put(out[lo - start : hi - start], grad[lo - region.offset : hi - region.offset])
            cursor = hi

    def release(self, start: int, end: int) -> None:
        """Stepped: the accumulator's chunks inside ``[start, end)`` may go."""
        self.accumulator.release(start, end)


__all__ = ["Parked", "ParkedGrads", "ParkedWindow"]
