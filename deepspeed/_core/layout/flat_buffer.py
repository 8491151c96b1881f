"""Contiguous storage for one flat parameter group, and the storage free/alloc trick.

A :class:`FlatBuffer` realises a :class:`~deepspeed._core.layout.shards.SegmentPlan`: one 1-D tensor per
segment, laid out exactly as the group's logical flat address space. With one segment it is the classic
single flat buffer; with several, each parameter still lives in one contiguous segment (so ``param.data`` can
be a view), while the group's partitions may span segments and are then reached as a list of pieces.
[Note: layout] explains why the in-place flatten builds several segments.

Freeing uses the storage-resize trick: the tensor object (and every view of it) stays valid metadata-wise,
while its untyped storage is resized to zero bytes and back, so the allocator gets the memory and the
identities held by modules, hooks and optimizers never change.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepspeed._core.layout.shards import (
    GroupLayout,
    ParamSlot,
    Range,
    SegmentPlan,
    plan_segments,
)


def storage_nbytes(tensor: torch.Tensor) -> int:
    """Bytes currently held by ``tensor``'s untyped storage (0 once freed)."""
    return tensor.untyped_storage().nbytes()


def _require_whole_storage(tensor: torch.Tensor) -> None:
    if tensor.storage_offset() != 0 or not tensor.is_contiguous():
        raise ValueError("free/alloc_storage needs a contiguous tensor starting at offset 0 of its storage")


def free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory by resizing its storage to zero bytes; the tensor object stays usable.

    Every view of the same storage loses its data too: only call it on storage this code owns.
    """
    _require_whole_storage(tensor)
    storage = tensor.untyped_storage()
    if storage.nbytes() > tensor.numel() * tensor.element_size():
        # A view of a larger buffer (a shard cut from an arena): resizing would free its neighbours too.
        raise ValueError("free_storage needs a tensor that spans its whole storage, not a view of a larger one")
    if storage.nbytes() != 0:
        storage.resize_(0)


def alloc_storage(tensor: torch.Tensor) -> None:
    """Re-grow a storage freed by :func:`free_storage` to cover ``tensor`` (contents are uninitialised)."""
    _require_whole_storage(tensor)
    storage = tensor.untyped_storage()
    wanted = tensor.numel() * tensor.element_size()
    if storage.nbytes() == 0 and wanted:
        storage.resize_(wanted)
    elif storage.nbytes() != wanted:
        raise ValueError(f"storage holds {storage.nbytes()} bytes, expected 0 or {wanted}")


class FlatBuffer:
    """The flat storage of one parameter group: its segments, views of its params and of its partitions.

    Build one with :meth:`allocate`, :meth:`wrap` or the flatten functions in
    :mod:`deepspeed._core.layout.inplace_flatten`.
    """

    def __init__(self, plan: SegmentPlan, segments: Sequence[torch.Tensor]) -> None:
        """Adopt ``segments`` (one 1-D contiguous tensor per segment of ``plan``, same device and dtype)."""
        if len(segments) != len(plan.segments):
            raise ValueError(f"plan has {len(plan.segments)} segments, got {len(segments)} tensors")
        for segment, tensor in zip(plan.segments, segments, strict=True):
            if tensor.dim() != 1 or not tensor.is_contiguous() or tensor.numel() != segment.range.size:
                raise ValueError(f"segment {segment.index} needs a contiguous 1-D tensor of {segment.range.size}")
        if len({(t.device, t.dtype) for t in segments}) != 1:
            raise ValueError("all segments must share one device and dtype")
        self.plan = plan
        self.segments = tuple(segments)

    @classmethod
    def allocate(
        cls, layout: GroupLayout, device: torch.device, dtype: torch.dtype, plan: SegmentPlan | None = None
    ) -> FlatBuffer:
        """Fresh, uninitialised storage for ``layout`` (one segment unless ``plan`` says otherwise).

        The tail padding is zeroed so norms and reductions over whole partitions stay exact.
        """
        plan = plan if plan is not None else plan_segments(layout, None)
        segments = [torch.empty(s.range.size, device=device, dtype=dtype) for s in plan.segments]
        buffer = cls(plan, segments)
        buffer.zero_padding()
        return buffer

    @classmethod
    def wrap(cls, layout: GroupLayout, tensor: torch.Tensor) -> FlatBuffer:
        """View an existing 1-D tensor of ``layout.padded_numel`` elements as a single-segment buffer."""
        return cls(plan_segments(layout, None), [tensor])

    @property
    def layout(self) -> GroupLayout:
        """The group's logical layout."""
        return self.plan.layout

    @property
    def device(self) -> torch.device:
        """Device of every segment."""
        return self.segments[0].device

    @property
    def dtype(self) -> torch.dtype:
        """Element type of every segment."""
        return self.segments[0].dtype

    @property
    def is_contiguous(self) -> bool:
        """True when the whole group is one tensor (one segment)."""
        return len(self.segments) == 1

    @property
    def tensor(self) -> torch.Tensor:
        """The single flat tensor; only defined when :attr:`is_contiguous`."""
        if not self.is_contiguous:
            raise ValueError(f"this buffer has {len(self.segments)} segments; use pieces() or segments")
        return self.segments[0]

    def view(self, slot: ParamSlot) -> torch.Tensor:
        """A view of ``slot``'s elements shaped like the parameter."""
        segment = self.plan.segment_of(slot)
        local = slot.range.shift(-segment.range.start)
        return self.segments[segment.index][local.as_slice()].view(slot.shape)

    def pieces(self, rng: Range) -> list[torch.Tensor]:
        """1-D views whose concatenation is the group interval ``rng`` (one per segment it touches)."""
        return [self.segments[index][local.as_slice()] for index, local in self.plan.locate(rng)]

    def partition_pieces(self, rank: int) -> list[torch.Tensor]:
        """Views whose concatenation is ``rank``'s partition, padding included."""
        return self.pieces(self.layout.partition(rank))

    def partition_view(self, rank: int) -> torch.Tensor:
        """``rank``'s partition as one view; raises when it spans segments (use :meth:`partition_pieces`)."""
        pieces = self.partition_pieces(rank)
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return self.segments[-1][:0]
        raise ValueError(f"partition {rank} spans {len(pieces)} segments; use partition_pieces()")

    def copy_out(self, rng: Range, out: torch.Tensor) -> None:
        """Copy the group interval ``rng`` into the 1-D tensor ``out`` (copy-in for a collective)."""
        for piece, window in self._paired(rng, out):
            window.copy_(piece)

    def copy_in(self, rng: Range, src: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy the 1-D tensor ``src`` into the group interval ``rng`` (copy-out of a collective);
        ``non_blocking`` as for ``Tensor.copy_`` (page-locked host sources)."""
        for piece, window in self._paired(rng, src):
            piece.copy_(window, non_blocking=non_blocking)

    def _paired(self, rng: Range, flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if flat.dim() != 1 or flat.numel() != rng.size:
            raise ValueError(f"expected a 1-D tensor of {rng.size} elements, got shape {tuple(flat.shape)}")
        pairs = []
        start = 0
        for piece in self.pieces(rng):
            pairs.append((piece, flat[start : start + piece.numel()]))
            start += piece.numel()
        return pairs

    def zero_padding(self) -> None:
        """Fill the tail padding with zeros."""
        layout = self.layout
        for piece in self.pieces(Range(layout.numel, layout.padded_numel)):
            piece.zero_()

    def install_param_views(self, params: Sequence[torch.Tensor]) -> None:
        """Make each parameter's ``.data`` the buffer's view of its slot (params in slot order)."""
        slots = self.layout.slots
        if len(params) != len(slots):
            raise ValueError(f"layout has {len(slots)} slots, got {len(params)} params")
        for slot, param in zip(slots, params, strict=True):
            if tuple(param.shape) != slot.shape:
                raise ValueError(f"param {slot.index} has shape {tuple(param.shape)}, slot expects {slot.shape}")
            param.data = self.view(slot)

    def free_storage(self) -> None:
        """Release every segment's memory; views stay valid as metadata until :meth:`alloc_storage`."""
        for tensor in self.segments:
            free_storage(tensor)

    def alloc_storage(self) -> None:
        """Re-grow every segment's storage (contents uninitialised)."""
        for tensor in self.segments:
            alloc_storage(tensor)

    @property
    def is_allocated(self) -> bool:
        """True when every non-empty segment holds memory."""
        return all(storage_nbytes(t) or not t.numel() for t in self.segments)

    def nbytes(self) -> int:
        """Bytes held by the segments now."""
        return sum(storage_nbytes(t) for t in self.segments)
