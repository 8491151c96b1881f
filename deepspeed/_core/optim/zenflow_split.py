"""Where ZenFlow's two paths sit in a flat partition: a weight's columns, as indices and as per-column sums.

[Note: zenflow split] Which elements each of ZenFlow's paths owns ([Note: zenflow]) is kept as column indices,
not as a boolean mask over the partition: on the host ``masked_scatter_`` runs on one thread and
``masked_select`` costs several elementwise passes over the whole partition, and the every-step path packs and
unpacks four tensors each step. A :class:`ColumnSplit` packs the elements a mask would select, in the same
order, from the selected column indices: a
weight's whole rows as one ``index_select`` along its columns, the partial rows at a partition's cut through short
index lists, and everything outside the 2-D weights as slices. Each gather or scatter then costs about one
elementwise pass of the elements it moves. The same indices, copied to the device, let a step that changed
only the every-step path publish only those elements (:meth:`ZenFlowUpdate.stepped_values`, used by the ZeRO-1/2
optimizer's write-back): the other elements' working copies already hold their masters' rounded values.
The split is pure data computed from the pieces and the selected columns; it gathers and scatters whatever
tensor is laid out like the partition (the master, a moment, a gradient, or the working weights on the device),
and builds the boolean mask only where one is stored (a checkpoint's update in flight).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepspeed._core.grads.convert import Coef, scales


@dataclass(frozen=True)
class ColumnPiece:
    """This rank's piece of one 2-D weight: ``numel`` elements from ``local`` in the partition, starting at element
    ``first`` of the weight (row-major, ``cols`` columns), its norms at ``norm_offset`` of the norm vector."""

    local: int
    first: int
    numel: int
    cols: int
    norm_offset: int


@dataclass(frozen=True)
class _PieceIndex:
    """Where one weight piece's selected (``[0]``) and other (``[1]``) elements sit: positions in the partial row
    before its first whole row (``head``), columns of its whole rows, positions in the partial row after them."""

    piece: ColumnPiece
    head: tuple[torch.Tensor, torch.Tensor]
    rows: int
    columns: tuple[torch.Tensor, torch.Tensor]
    tail: tuple[torch.Tensor, torch.Tensor]

    @property
    def head_len(self) -> int:
        return int(self.head[0].numel() + self.head[1].numel())

    @property
    def tail_len(self) -> int:
        return int(self.tail[0].numel() + self.tail[1].numel())


def _positions(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return keep.nonzero().flatten(), (~keep).nonzero().flatten()


class ColumnSplit:
    """One partition's split between the every-step path (*selected*) and the late one, as column indices
    ([Note: zenflow split]). :meth:`take` packs a path's elements in ascending element order, the order of
    ``tensor[mask]`` under the group's mask; :meth:`put_` writes them back; :meth:`fill_` sets them.

    Args:
        numel: the partition's length.
        pieces: its 2-D weights' pieces, in ascending order.
        keeps: the selected columns of each piece's weight (``None`` for every piece: nothing selected yet,
            every element is stepped every step).
    """

    def __init__(self, numel: int, pieces: Sequence[ColumnPiece], keeps: Sequence[torch.Tensor] | None) -> None:
        self.numel = numel
        self.pieces, self.keeps = tuple(pieces), None if keeps is None else tuple(keeps)
        self.parts: list[_PieceIndex] = []
        if keeps is None:
            self.counts = (numel, 0)
            return
        selected = numel
        for piece, keep in zip(pieces, keeps, strict=True):
            start = piece.first % piece.cols
            head = min(piece.numel, (piece.cols - start) % piece.cols)
            rows = (piece.numel - head) // piece.cols
            tail = piece.numel - head - rows * piece.cols
            part = _PieceIndex(
                piece, _positions(keep[start : start + head]), rows, _positions(keep), _positions(keep[:tail])
            )
            self.parts.append(part)
            selected -= part.head[1].numel() + rows * part.columns[1].numel() + part.tail[1].numel()
        self.counts = (selected, numel - selected)

    def _walk(self, tensor: torch.Tensor, selected: bool):
        """Yield ``(kind, view, index)`` over ``tensor`` in element order for the ``selected`` path: ``"span"``
        (a whole slice), ``"pos"`` (positions in a 1-D slice) or ``"cols"`` (columns of a rows x cols view)."""
        which = 0 if selected else 1
        cursor = 0
        for part in self.parts:
            piece = part.piece
            if selected and piece.local > cursor:
                yield "span", tensor[cursor : piece.local], None
            seg = tensor[piece.local : piece.local + piece.numel]
            head, body = part.head_len, part.rows * piece.cols
            if head and part.head[which].numel():
                yield "pos", seg[:head], part.head[which]
            if part.rows and part.columns[which].numel():
                yield "cols", seg[head : head + body].view(part.rows, piece.cols), part.columns[which]
            if part.tail_len and part.tail[which].numel():
                yield "pos", seg[head + body :], part.tail[which]
            cursor = piece.local + piece.numel
        if selected and cursor < self.numel:
            yield "span", tensor[cursor : self.numel], None

    def take(self, tensor: torch.Tensor, selected: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """``tensor``'s elements on the ``selected`` path (``tensor[mask]`` or ``tensor[~mask]``), in a new 1-D
        tensor or in ``out``."""
        if out is None:
            out = tensor.new_empty(self.counts[0 if selected else 1])
        offset = 0
        for kind, view, index in self._walk(tensor, selected):
            if kind == "span":
                n = view.numel()
                out[offset : offset + n].copy_(view)
            elif kind == "pos":
                n = index.numel()
                torch.index_select(view, 0, index, out=out[offset : offset + n])
            else:
                n = view.shape[0] * index.numel()
                torch.index_select(view, 1, index, out=out[offset : offset + n].view(view.shape[0], index.numel()))
            offset += n
        return out

    def put_(self, tensor: torch.Tensor, values: torch.Tensor, selected: bool) -> None:
        """Write :meth:`take`'s packed ``values`` back into ``tensor`` (``tensor.masked_scatter_(mask, values)``)."""
        offset = 0
        for kind, view, index in self._walk(tensor, selected):
            if kind == "span":
                n = view.numel()
                view.copy_(values[offset : offset + n])
            elif kind == "pos":
                n = index.numel()
                view.index_copy_(0, index, values[offset : offset + n])
            else:
                n = view.shape[0] * index.numel()
                view.index_copy_(1, index, values[offset : offset + n].view(view.shape[0], index.numel()))
            offset += n

    def window(self, start: int, end: int) -> tuple[int, ColumnSplit]:
        """The split of the partition's elements ``[start, end)`` alone, and where their selected elements begin
        in :meth:`take`'s packed order (for a partition stored in several pieces: a segmented flat buffer)."""
        if self.keeps is None:
            return start, ColumnSplit(end - start, (), None)
        before = ColumnSplit(start, *_clipped(self.pieces, self.keeps, 0, start))
        return before.counts[0], ColumnSplit(end - start, *_clipped(self.pieces, self.keeps, start, end))

    def to(self, device: torch.device) -> ColumnSplit:
        """The same split with its indices on ``device`` (to scatter into a device copy of the partition)."""
        out = ColumnSplit(self.numel, (), None)
        out.counts, out.pieces, out.keeps = self.counts, self.pieces, self.keeps
        out.parts = [
            dataclasses.replace(
                part,
                head=(part.head[0].to(device), part.head[1].to(device)),
                columns=(part.columns[0].to(device), part.columns[1].to(device)),
                tail=(part.tail[0].to(device), part.tail[1].to(device)),
            )
            for part in self.parts
        ]
        return out

    def mask(self, selected: bool = True) -> torch.Tensor:
        """The partition's boolean mask of one path's elements (built on demand: the steps never read it)."""
        out = torch.zeros(self.numel, dtype=torch.bool)
        self.fill_(out, True, selected)
        return out

    def fill_(self, tensor: torch.Tensor, value: float, selected: bool) -> None:
        """Set ``tensor``'s elements on the ``selected`` path to ``value``."""
        for kind, view, index in self._walk(tensor, selected):
            if kind == "span":
                view.fill_(value)
            else:
                view.index_fill_(0 if kind == "pos" else 1, index, value)


def _clipped(
    pieces: Sequence[ColumnPiece], keeps: Sequence[torch.Tensor], start: int, end: int
) -> tuple[list[ColumnPiece], list[torch.Tensor]]:
    """The pieces' parts inside the partition's elements ``[start, end)``, in that window's coordinates, with their
    weights' selected columns."""
    out: tuple[list[ColumnPiece], list[torch.Tensor]] = ([], [])
    for piece, keep in zip(pieces, keeps, strict=True):
        lo, hi = max(piece.local, start), min(piece.local + piece.numel, end)
        if hi > lo:
            moved = lo - piece.local
            out[0].append(dataclasses.replace(piece, local=lo - start, first=piece.first + moved, numel=hi - lo))
            out[1].append(keep)
    return out


def column_sq(piece: torch.Tensor, first: int, cols: int, coef: Coef = 1.0) -> torch.Tensor:
    """Per-column sums of squares of ``piece`` scaled by ``coef`` (in fp32), elements ``first..`` of a row-major
    weight of ``cols`` columns."""

    def scaled(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * coef if scales(coef) else x  # never in place: ``float()`` of an fp32 gradient is the gradient

    out = torch.zeros(cols, dtype=torch.float32)
    n, start = piece.numel(), first % cols
    head = min(n, (cols - start) % cols)
    out[start : start + head] += scaled(piece[:head]).square()
    rows = (n - head) // cols
    if rows:
        out += scaled(piece[head : head + rows * cols]).view(rows, cols).square().sum(0)
    tail = n - head - rows * cols
    if tail:
        out[:tail] += scaled(piece[n - tail :]).square()
    return out
