"""One optimizer group's gradient shard, held as fixed-size chunks that exist only once a gradient lands in them.

[Note: lazy grad shard] ZeRO-3 reduces gradients layer by layer, last layer first. A shard allocated whole at
the first reduction sits there as zeros from the start of the backward pass, which is exactly when the
logits, their gradient, the loss's fp32 temporaries and a tied embedding's full gradient are alive: on the
H200 that is where the Qwen2-3B step peak was (docs/benchmarks.md), with the whole shard counted in it.
Allocating chunk by chunk as reductions reach them moves most of the shard to the end of the backward, by
which point those activations are gone. FSDP2 gets the same effect by creating each sharded gradient at its
reduce-scatter. Chunks are as large as one optimizer step chunk ([Note: chunked step]), so the step reads
each chunk in place; a chunk no gradient reached is stepped as zeros, as a zero-filled shard would be.

[Note: kept host chunks] With the optimizer offloaded the shard lives in host memory, where freeing buys no
peak (the host holds it at every step's end anyway) and reallocating costs: a fresh host tensor is
page-faulted in by the kernel on first touch, every step. On the 2-core development CPU one backward's folds
into 128M bf16 elements took 0.15 s into fresh chunks and 0.06-0.07 s into kept ones (``fill_fresh`` /
``fill_kept`` of ``benchmarks/offload_step_cpu.py``). Kept chunks therefore
turns "released" into "stale": the storage stays, is zeroed when the next window first writes to it, and counts
as allocated only while it holds this window's values.

ZeRO-1/2 hold their partition gradient and lean ZeRO-1's full-size accumulator in shards of one chunk
(:meth:`ChunkedGradShard.whole`): the step gets the tensor itself, and the keep-storage policy lives only here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkStorage:
    """How a shard's chunks are held.

    Attributes:
        kept: keep each chunk's storage across windows ([Note: kept host chunks]).
        pinned: allocate host chunks page-locked, so device copies can land in them directly.
    """

    kept: bool = False
    pinned: bool = False


FREED_CHUNKS = ChunkStorage()
"""Chunks are freed at each window's end (the default, for shards on the device)."""
KEPT_CHUNKS = ChunkStorage(kept=True)
"""Chunks keep their storage across windows, pageable."""


class ChunkedGradShard:
    """A 1-D gradient of ``numel`` elements in ``chunk_numel`` pieces, each allocated (zeroed) on first write.

    Args:
        numel: elements of the shard (the group's master partition).
        chunk_numel: elements per chunk (the last one may be shorter).
        dtype: element type (``grad_accum_dtype``).
        device: where the chunks live (the master's device: the accelerator, or the host when offloaded).
        storage: whether chunks are kept across windows and page-locked (:class:`ChunkStorage`).
    """

    def __init__(
        self,
        numel: int,
        chunk_numel: int,
        dtype: torch.dtype,
        device: torch.device | str,
        storage: ChunkStorage = FREED_CHUNKS,
    ) -> None:
        if numel < 0 or chunk_numel <= 0:
            raise ValueError(f"ChunkedGradShard: numel must be >= 0 and chunk_numel > 0 (got {numel}, {chunk_numel})")
        self.numel = numel
        self.chunk_numel = chunk_numel
        self.dtype = dtype
        self.device = torch.device(device)
        self.keep_storage = storage.kept
        self.pin_memory = storage.pinned and self.device.type == "cpu"
        # At least one chunk, so that a shard of one chunk (:meth:`whole`) exists even with no elements.
        self._chunks: list[torch.Tensor | None] = [None] * max(1, -(-numel // chunk_numel))
        self._live = [False] * len(self._chunks)  # holds this window's values (else zeros by definition)

    def bounds(self, index: int) -> tuple[int, int]:
        """``[start, end)`` of chunk ``index`` in shard coordinates."""
        start = index * self.chunk_numel
        return start, min(start + self.chunk_numel, self.numel)

    def _chunk(self, index: int) -> torch.Tensor:
        chunk = self._chunks[index]
        if chunk is None:
            start, end = self.bounds(index)
            if self.pin_memory:
                chunk = torch.zeros(end - start, dtype=self.dtype, pin_memory=True)
            else:
                chunk = torch.zeros(end - start, dtype=self.dtype, device=self.device)
            self._chunks[index] = chunk
        elif not self._live[index]:
            chunk.zero_()  # kept storage from an earlier window
        self._live[index] = True
        return chunk

    def _live_chunk(self, index: int) -> torch.Tensor | None:
        return self._chunks[index] if index < len(self._chunks) and self._live[index] else None

    def whole(self) -> torch.Tensor:
        """The shard as one writable tensor, allocated (zeroed) on the window's first use; the same tensor until
        the window ends. Only for a shard of one chunk (``chunk_numel >= numel``)."""
        self._check_single()
        return self._chunk(0)

    def whole_or_none(self) -> torch.Tensor | None:
        """The one-chunk shard's tensor while it holds this window's values, else ``None`` (nothing allocated)."""
        self._check_single()
        return self._live_chunk(0)

    def _check_single(self) -> None:
        if len(self._chunks) != 1:
            raise ValueError(f"a gradient shard of {len(self._chunks)} chunks has no single tensor")

    def pieces(self, offset: int, size: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Writable views covering ``[offset, offset + size)``, allocating the chunks they fall in.

        Yields ``(position inside the range, view)`` pairs in order; the views' lengths add up to ``size``.
        """
        if offset < 0 or offset + size > self.numel:
            raise IndexError(f"range [{offset}, {offset + size}) outside a gradient shard of {self.numel} elements")
        pos = 0
        while pos < size:
            index, inner = divmod(offset + pos, self.chunk_numel)
            chunk = self._chunk(index)
            length = min(size - pos, chunk.numel() - inner)
            yield pos, chunk[inner : inner + length]
            pos += length

    def add_(self, offset: int, values: torch.Tensor) -> None:
        """Add the 1-D ``values`` (any dtype, same device) into ``[offset, offset + len)``."""
        for pos, view in self.pieces(offset, values.numel()):
            view.add_(values[pos : pos + view.numel()].to(self.dtype))

    def write(self, offset: int, values: torch.Tensor) -> None:
        """Overwrite ``[offset, offset + len)`` with the 1-D ``values`` (any dtype or device)."""
        for pos, view in self.pieces(offset, values.numel()):
            view.copy_(values[pos : pos + view.numel()])

    def read(self, offset: int, size: int) -> torch.Tensor:
        """A new tensor with the values of ``[offset, offset + size)`` (zeros where no chunk exists yet)."""
        if offset < 0 or offset + size > self.numel:
            raise IndexError(f"range [{offset}, {offset + size}) outside a gradient shard of {self.numel} elements")
        out = torch.zeros(size, dtype=self.dtype, device=self.device)
        pos = 0
        while pos < size:
            index, inner = divmod(offset + pos, self.chunk_numel)
            start, end = self.bounds(index)
            length = min(size - pos, end - start - inner)
            chunk = self._live_chunk(index)
            if chunk is not None:
                out[pos : pos + length].copy_(chunk[inner : inner + length])
            pos += length
        return out

    def window(self, start: int, end: int) -> torch.Tensor:
        """``[start, end)`` for a step: the chunk itself (a view) when the range lies in one allocated chunk,
        otherwise a new tensor (zeros for a chunk no gradient reached)."""
        index, inner = divmod(start, self.chunk_numel)
        chunk = self._live_chunk(index)
        if chunk is not None and inner + (end - start) <= chunk.numel():
            return chunk[inner : inner + (end - start)]
        return self.read(start, end - start)

    def holds(self, start: int, end: int) -> bool:
        """True when a chunk holding this window's values overlaps ``[start, end)``."""
        first, last = start // self.chunk_numel, (max(start, end - 1)) // self.chunk_numel
        return any(self._live_chunk(i) is not None for i in range(first, min(last + 1, len(self._chunks))))

    def release(self, start: int, end: int) -> None:
        """Free the chunks lying wholly inside ``[start, end)`` (already consumed by the step); with
        ``keep_storage`` they only become stale."""
        first = -(-start // self.chunk_numel)
        for index in range(first, len(self._chunks)):
            if self.bounds(index)[1] > end:
                break
            self._live[index] = False
            if not self.keep_storage:
                self._chunks[index] = None

    def reset(self) -> None:
        """Start a new window: every chunk reads as zeros again (freed, or stale with ``keep_storage``)."""
        self.release(0, self.numel)

    def allocated(self) -> list[torch.Tensor]:
        """The chunks holding this window's values (for the norm: the others are zeros)."""
        return [c for c, live in zip(self._chunks, self._live, strict=False) if live and c is not None]

    @property
    def allocated_numel(self) -> int:
        """Elements holding this window's values."""
        return sum(c.numel() for c in self.allocated())

    @property
    def storage_numel(self) -> int:
        """Elements of storage held, stale chunks included."""
        return sum(c.numel() for c in self._chunks if c is not None)
