"""Start an offloaded update while the boundary backward is still running, where that is exact.

[Note: early host step] The overlapped host step ([Note: overlapped host step]) normally starts after the
backward, because clipping, the fp16 loss scale and the overflow check need the global gradient norm before any
chunk may change. Without any of them (``gradient_clipping`` 0, no fp16, ``bf16.check_grad_overflow`` false)
the update of a step chunk depends only on that chunk's gradient, so the chunk may go to the host worker as soon
as all of its gradient has landed in host memory (host copies drained), while the backward continues on the
other layers. At ZeRO-1/2 each chunk of a rank's master waits on a known set of gradient buckets, the buckets
whose owned range overlaps it (:class:`LandingPlan`); at ZeRO-3 it waits on the parameters whose shards it
holds, each until its gradient is final ([Note: final gradient count]). The remaining chunks are submitted at
``step()``, and every chunk is published there (the working weights of layers still in the backward must not
change under it). :class:`EarlyUpdate` holds the update so started, the same for every stage. The chunk is
stepped by the same call on the same values as the synchronous loop, so the result is bit-identical; what moves
is only when it runs.

[Note: final gradient count] A ZeRO-3 parameter's gradient reaches its shard in one or more arrivals per
backward: one when autograd accumulates it, one per routed use ([Note: routed grads]: tied weights, embedding
tables), none when the parameter took no part in the loss. Nothing tells, during the backward, that a given
arrival is the last one; :class:`ArrivalRecord` therefore counts. The first boundary backward only records each
parameter's arrivals (its update waits for ``step()``). From the next boundary on, a parameter whose arrivals
reach the recorded count is final, and a chunk all of whose parameters are final (and landed) is submitted. When
a backward differs from the record the rule stays exact in every case but one:

- fewer arrivals than recorded, or a parameter recorded with none: its chunks are not submitted early, they wait
  for ``step()``, which reads whatever arrived;
- an arrival beyond the record for a parameter whose chunks are not submitted yet: its chunks wait for ``step()``;
- an arrival beyond the record, a move of its parked gradient during the backward ([Note: parked grads]: another
  gather of the parameter), or a gradient written through ``safe_set_full_grad``, for a parameter whose chunk was
  already submitted: that chunk's update has read (or may be reading) the gradient as it was, and nothing can
  undo it. This is raised as an error naming the parameter, never stepped silently, and nothing starts early any
  more. Withdrawing a chunk the worker has not started would be exact, but whether it has started depends on each
  rank's timing; the error depends only on the sequence of arrivals and gathers, which every rank shares (each
  arrival is one reduce-scatter entry, each gather one all-gather), so every rank raises at the same point.

A parameter whose arrivals ever differed from the record is unstable: its chunks wait for ``step()`` in every
later step. A read of a parked gradient after the backward (``safe_get_full_grad``) waits for the submitted
chunks first. Only the boundary backward of an accumulation window counts and submits; its earlier micro-steps
have landed by then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.grads.convert import Coef
from deepspeed._core.grads.reducer import Bucket
from deepspeed._core.layout.shards import Range
from deepspeed._core.optim.chunked_step import chunk_ranges
from deepspeed._core.optim.host_step import GroupStep, OverlappedHostStep, StepRun
from deepspeed._foundation.logging import logger

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


def needs_no_norm(plan: Any, loss_scaler: Any, check_overflow: bool) -> bool:
    """Whether nothing needs the global gradient norm before a chunk may change ([Note: early host step]): no
    ``gradient_clipping``, no fp16 loss scale, no bf16 overflow check."""
    return plan.grads.clip_norm <= 0 and loss_scaler is None and not check_overflow


class EarlyUpdate:
    """This boundary's update when it may start during the backward ([Note: early host step]): opened on its first
    chunk, handed over to ``step()`` (:meth:`take`), or abandoned if no step takes it (:meth:`settle`).

    Args:
        host_step: the optimizer's overlapped host step.
        groups: opens every group's share of the update (called once per update, on its first chunk).
    """

    def __init__(self, host_step: OverlappedHostStep, groups: Callable[[], list[GroupStep]]) -> None:
        self.host_step = host_step
        self._groups = groups
        self.run: StepRun | None = None
        self.armed = False  # this backward may submit chunks
        self.chunks = 0  # for tests: chunks handed to the host worker before the backward ended

    def arm(self, armed: bool) -> None:
        """A new backward: settle any update left over, then listen (``armed``) or not."""
        self.settle()
        self.armed = armed

    def open(self) -> StepRun:
        """This boundary's update, opened on first use."""
        if self.run is None:
            self.run = self.host_step.begin(self._groups(), 1.0)
        return self.run

    def submit(self, keys: Iterable[ChunkKey]) -> None:
        """Hand the chunks ``keys`` (their gradients final and landed) to the host worker."""
        run = self.open()
        for group_index, start, end in keys:
            run.submit(group_index, start, end)
            self.chunks += 1

    def take(self, coef: Coef) -> StepRun:
        """``step()`` takes the update over (some chunks may be stepped already) and submits and publishes the
        rest; nothing listens any more."""
        if float(coef) != 1.0:  # arming rules out every coefficient but 1
            raise RuntimeError(f"an update started during the backward cannot take coefficient {float(coef)}")
        run = self.open()
        self.run, self.armed = None, False
        return run

    def settle(self) -> None:
        """An update started early that no step took over (the run is being torn down, or an error stopped the
        backward): wait for it and hand the optimizer its state back."""
        if self.run is not None:
            if self.run.jobs:
                logger.warning(
                    "the offloaded update started during the boundary backward was not completed by step(): the "
                    "host masters of its first chunks are updated, the working weights are not"
                )
            self.run.abandon()
            self.run = None


@dataclass(frozen=True)
class RegionSpan:
    """One parameter's shard in a group's master: ``key`` names the parameter, ``range`` its elements (master
    coordinates of group ``group``)."""

    key: int
    group: int
    range: Range


class ArrivalRecord:
    """Counts gradient arrivals per parameter and says which step chunks are final ([Note: final gradient count]).

    Args:
        regions: every parameter's shard (each element of each master belongs to one).
        master_numels: each group's master size.
        chunk_numel: elements per step chunk.
    """

    def __init__(self, regions: Sequence[RegionSpan], master_numels: Sequence[int], chunk_numel: int) -> None:
        self.chunks_of: dict[int, list[ChunkKey]] = {}
        self.keys_of: dict[ChunkKey, list[int]] = {}
        for region in regions:
            chunks = self.chunks_of.setdefault(region.key, [])
            for start, end in chunk_ranges(master_numels[region.group], chunk_numel):
                if start < region.range.end and region.range.start < end:
                    chunks.append((region.group, start, end))
                    self.keys_of.setdefault((region.group, start, end), []).append(region.key)
        self.record: dict[int, int] | None = None  # arrivals per parameter in the recorded backward
        self.unstable: set[int] = set()  # parameters whose arrivals differed from the record once
        self.counts: dict[int, int] = {}
        self.left: dict[ChunkKey, int] = {}  # parameters not final and landed yet; -1: never early this backward
        self.unlanded: set[int] = set()  # final, their gradient not in place yet
        self.sent: set[ChunkKey] = set()
        self.active = False

    def begin(self) -> None:
        """A boundary backward starts: count from zero; with a record, chunks may become final."""
        self.active = True
        self.counts = dict.fromkeys(self.chunks_of, 0)
        self.unlanded.clear()
        self.sent.clear()
        self.left = {
            chunk: len(keys) if all(self._eligible(k) for k in keys) else -1 for chunk, keys in self.keys_of.items()
        }

    def _eligible(self, key: int) -> bool:
        return self.record is not None and self.record.get(key, 0) >= 1 and key not in self.unstable

    def late(self, key: int) -> list[ChunkKey]:
        """Called before each arrival of ``key``: when the arrival goes beyond the record, ``key`` turns unstable
        and the chunks already submitted that it comes too late for are returned (empty: the arrival is safe)."""
        if not self.active or self.record is None or self.counts.get(key, 0) < self.record.get(key, 0):
            return []
        return self.disturbed(key)

    def disturbed(self, key: int) -> list[ChunkKey]:
        """``key``'s gradient is not what the record says (more arrives, or it moves): it turns unstable; returns
        its chunks already submitted."""
        self.unstable.add(key)
        for chunk in self.chunks_of.get(key, []):
            if chunk not in self.sent:
                self.left[chunk] = -1
        return [c for c in self.chunks_of.get(key, []) if c in self.sent]

    def arrive(self, key: int, landed: bool) -> list[ChunkKey]:
        """One arrival of ``key`` has been folded (``landed``: its gradient is in place, not held elsewhere until
        its parameter is released); returns the chunks that became final and landed with it."""
        if not self.active or key not in self.counts:
            return []
        self.counts[key] += 1
        if not self._eligible(key) or self.counts[key] != self.record.get(key, 0):  # type: ignore[union-attr]
            return []
        if not landed:
            self.unlanded.add(key)
            return []
        return self._final(key)

    def landed(self, key: int) -> list[ChunkKey]:
        """``key``'s final gradient, held until its parameter's release, is in place now."""
        if key not in self.unlanded:
            return []
        self.unlanded.discard(key)
        return self._final(key)

    def _final(self, key: int) -> list[ChunkKey]:
        ready = []
        for chunk in self.chunks_of[key]:
            if self.left[chunk] > 0:
                self.left[chunk] -= 1
                if self.left[chunk] == 0:
                    ready.append(chunk)
                    self.sent.add(chunk)
        return ready

    def stop(self) -> None:
        """Stop counting this backward without recording it (``zero_grad``, or a refused arrival)."""
        self.active = False

    def end(self) -> None:
        """The backward is over: the first one becomes the record; a parameter that differed turns unstable."""
        if not self.active:
            return
        self.active = False
        if self.record is None:
            self.record = dict(self.counts)
            return
        self.unstable.update(k for k, n in self.counts.items() if n != self.record.get(k, 0))


class FixedChunkGrads:
    """A group's gradient for an update whose chunks are submitted one at a time: each chunk reads the gradient
    object fixed for it at its submission, the chunks submitted at ``step()`` read :attr:`rest`. The host waits
    for the event recorded at submission before a chunk reads: host-resident pieces (side tensors) are filled by
    non-blocking copies from the device, which a stream wait cannot order for host code ([Note: worker stream]
    orders the device-resident ones)."""

    def __init__(self) -> None:
        self.fixed: dict[int, tuple[Any, Any]] = {}  # chunk start -> (gradient, event or None)
        self.rest: Any = None

    def fix(self, start: int, grad: Any, ready: Any) -> None:
        """Chunk ``[start, ...)`` reads ``grad``, after ``ready`` (an event, or ``None``)."""
        self.fixed[start] = (grad, ready)

    def _of(self, start: int) -> Any:
        entry = self.fixed.get(start)
        if entry is None:
            return self.rest
        grad, ready = entry
        if ready is not None:
            ready.synchronize()
            self.fixed[start] = (grad, None)
        return grad

    def window(self, start: int, end: int) -> torch.Tensor:
        """The gradient of ``[start, end)``."""
        grad = self._of(start)
        return grad.window(start, end) if hasattr(grad, "window") else grad[start:end]

    def convert_into(self, start: int, end: int, out: torch.Tensor, coef: Coef) -> bool:
        """As :meth:`~deepspeed._core.grads.parked.ParkedWindow.convert_into`, where the chunk's gradient can."""
        grad = self._of(start)
        return bool(grad.convert_into(start, end, out, coef)) if hasattr(grad, "convert_into") else False
