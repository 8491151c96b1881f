"""Bucketed, backward-overlapped gradient all-reduce for plain data parallelism (stage 0).

Buckets are fixed once, in reverse parameter order (roughly the order autograd produces gradients).
On a boundary micro-step each parameter's post-accumulate-grad hook marks it ready; a bucket is
launched asynchronously when all its parameters are ready *and* every earlier bucket has been
launched, so every rank issues the same collectives in the same order. ``finish()`` launches what is
left (parameters that got no gradient contribute zeros), waits, scales and writes back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed import comm as dist
from deepspeed._core.grads.scaling import ReduceScaling


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    pending: int = 0
    flat: torch.Tensor | None = None
    handle: Any = None
    ready: set[int] = field(default_factory=set)


class BucketedAllReduce:
    """All-reduce gradients of ``params`` in buckets of at most ``bucket_numel`` elements.

    Args:
        params: trainable parameters in registration order.
        bucket_numel: bucket capacity in elements (a larger parameter gets a bucket of its own).
        comm_dtype: dtype the reduction runs in.
        scaling: pre/post factors.
        group: data-parallel process group (``None`` = world).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        bucket_numel: int,
        comm_dtype: torch.dtype,
        scaling: ReduceScaling,
        group: Any = None,
    ) -> None:
        self.comm_dtype = comm_dtype
        self.scaling = scaling
        self.group = group
        self.buckets = _make_buckets(list(reversed(params)), max(1, bucket_numel))
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._next_launch = 0
        self._armed = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def arm(self) -> None:
        """Reduce during the coming backward (call before a boundary micro-step's backward)."""
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.ready.clear()
        self._next_launch = 0
        self._armed = True

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        bucket = self.buckets[self._bucket_of[id(param)]]
        if id(param) in bucket.ready:
            return
        bucket.ready.add(id(param))
        bucket.pending -= 1
        self._launch_ready_prefix()

    def _launch_ready_prefix(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        pieces = []
        for p in bucket.params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            pieces.append(g.detach().reshape(-1).to(self.comm_dtype))
        bucket.flat = torch.cat(pieces)
        if self.scaling.pre != 1.0:
            bucket.flat.mul_(self.scaling.pre)
        bucket.handle = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch the remaining buckets, wait for all, and write the reduced gradients back."""
        if not self._armed:
            return
        for bucket in self.buckets[self._next_launch :]:
            self._launch(bucket)
        self._next_launch = len(self.buckets)
        for bucket in self.buckets:
            bucket.handle.wait()
            if self.scaling.post != 1.0:
                bucket.flat.mul_(self.scaling.post)
            _write_back(bucket)
            bucket.flat, bucket.handle = None, None
        self._armed = False

    def remove_hooks(self) -> None:
        """Detach every hook this object registered."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _make_buckets(params: list[torch.nn.Parameter], bucket_numel: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        if current and size + p.numel() > bucket_numel:
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        buckets.append(_Bucket(current))
    return buckets


def _write_back(bucket: _Bucket) -> None:
    offset = 0
    for p in bucket.params:
        n = p.numel()
        reduced = bucket.flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = reduced.to(p.dtype).clone()
        else:
            p.grad.copy_(reduced)
        offset += n
