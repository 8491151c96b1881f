"""Start an offloaded ZeRO-1/2 update while the boundary backward is still running, where that is exact.

[Note: early host step] The overlapped host step ([Note: overlapped host step]) normally starts after the
backward, because clipping, the fp16 loss scale and the overflow check need the global gradient norm before any
chunk may change. Without any of them (``gradient_clipping`` 0, no fp16, ``bf16.check_grad_overflow`` false)
the update of a step chunk depends only on that chunk's gradient. Each chunk of a rank's master then waits on a
known set of gradient buckets, the buckets whose owned range overlaps it; once the last of them has landed in the
partition gradient (host copies drained), the chunk goes to the host worker while the backward continues on the
other layers. The remaining chunks are submitted at :meth:`step`, and every chunk is published there (the working
weights of layers still in the backward must not change under it). The chunk is stepped by the same call on the
same values as the synchronous loop, so the result is bit-identical; what moves is only when it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepspeed._core.grads.reducer import Bucket
from deepspeed._core.layout.shards import Range
from deepspeed._core.optim.chunked_step import chunk_ranges

ChunkKey = tuple[int, int, int]
"""``(group index, start, end)``: one step chunk of one group's master (master coordinates)."""


@dataclass(frozen=True)
class GroupSpan:
    """One flat group as the landing plan sees it: its index, this rank's partition (flat coordinates) and the
    master's element count."""

    index: int
    partition: Range
    master_numel: int


class LandingPlan:
    """Which step chunks wait on which gradient buckets, and how many buckets each still waits on this boundary.

    Args:
        groups: every flat group's span.
        buckets: the reducer's static bucket plan (each names its group and its range of the flat group).
        chunk_numel: elements per step chunk.
    """

    def __init__(self, groups: Sequence[GroupSpan], buckets: Sequence[Bucket], chunk_numel: int) -> None:
        self.waiters: dict[int, list[ChunkKey]] = {}
        self.needs: dict[ChunkKey, int] = {}
        spans = {g.index: g for g in groups}
        for bucket in buckets:
            span = spans.get(bucket.group)
            if span is None:
                continue
            owned = bucket.range.intersect(span.partition)
            if owned.is_empty:
                continue
            local = owned.shift(-span.partition.start)
            for start, end in chunk_ranges(span.master_numel, chunk_numel):
                if start < local.end and local.start < end:
                    key = (span.index, start, end)
                    self.waiters.setdefault(bucket.index, []).append(key)
                    self.needs[key] = self.needs.get(key, 0) + 1
        self.left: dict[ChunkKey, int] = {}
        self.reset()

    def reset(self) -> None:
        """A new boundary: every chunk waits on all of its buckets again."""
        self.left = dict(self.needs)

    def land(self, bucket_index: int) -> list[ChunkKey]:
        """Bucket ``bucket_index`` has landed; returns the chunks that waited on it and on nothing else any more."""
        ready = []
        for key in self.waiters.get(bucket_index, ()):
            self.left[key] -= 1
            if self.left[key] == 0:
                ready.append(key)
        return ready


class LazyPartitionGrad:
    """A group's partition gradient resolved at each read: the step of an early chunk may be submitted before the
    group's gradient buffer exists; a range with no buffer behind it reads as zeros.

    Args:
        resolve: returns the group's partition gradient now, or ``None``.
        dtype: dtype of the zeros read where there is no gradient.
    """

    def __init__(self, resolve: Callable[[], torch.Tensor | None], dtype: torch.dtype) -> None:
        self.resolve = resolve
        self.dtype = dtype

    def window(self, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the gradient."""
        part = self.resolve()
        return torch.zeros(end - start, dtype=self.dtype) if part is None else part[start:end]
