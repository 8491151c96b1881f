"""Stage 0: every rank keeps whole gradients; the boundary backward all-reduces them bucket by bucket.

Gradients accumulate in ``.grad`` across micro-steps. On a boundary micro-step each parameter's
post-accumulate-grad hook reports it ready to the :class:`~deepspeed._core.grads.reducer.GradReducer`, which
starts each bucket's all-reduce once the buckets before it have started ([Note: launch order]). A bucket
concatenates its parameters' gradients at its start (zeros for a parameter that got none) and its reduced,
scaled values are copied back into ``.grad`` at the end of the backward.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed._core.grads.reducer import Bucket, GradReducer, ReduceMode, ReducePhase, ReducerConfig, plan_static
from deepspeed._core.grads.scaling import ReduceScaling
from deepspeed._core.layout.shards import Range, make_slots


class ReplicaGrads:
    """All-reduce the gradients of ``params`` in buckets of at most ``bucket_numel`` elements (a :class:`BucketIO`).

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
        self.params = list(params)
        self.group = group
        slots = make_slots([tuple(p.shape) for p in self.params])
        # Every bucket stays in flight until the end of the backward: stage 0 never bounded them.
        config = ReducerConfig(ReduceMode.ALL_REDUCE, bucket_numel, comm_dtype, scaling, max_in_flight=None)
        self.reducer = GradReducer(self, config, plan_static([slots], bucket_numel))
        self._where = {id(self.params[s]): (b.index, s) for b in self.reducer.buckets for s in b.slots}
        self.reducer.begin(ReducePhase.SKIP)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def arm(self) -> None:
        """Reduce during the coming backward (call before a boundary micro-step's backward)."""
        self.reducer.begin(ReducePhase.REDUCE)

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not getattr(param, "ds_grad_is_ready", True):
            return  # a tile of a tiled function: the gradient is still accumulating ([Note: ds_grad_is_ready])
        self.reducer.mark_ready(*self._where[id(param)])

    def finish(self) -> None:
        """Start the remaining buckets, wait for all, and write the reduced gradients back."""
        self.reducer.finish()

    def remove_hooks(self) -> None:
        """Detach every hook this object registered."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # --- BucketIO -------------------------------------------------------------------------------------
    def wire(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's gradients, concatenated in bucket order in the wire dtype."""
        pieces = []
        for s in bucket.slots:
            p = self.params[s]
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            pieces.append(g.detach().reshape(-1).to(self.reducer.config.comm_dtype))
        return torch.cat(pieces)

    def owners(self, bucket: Bucket) -> list[tuple[int, Range]]:
        """Not used: stage 0 all-reduces."""
        raise NotImplementedError("stage-0 buckets are all-reduced")

    def process_group(self, bucket: Bucket) -> Any:
        """The data-parallel (or expert-data-parallel) group."""
        return self.group

    def kept(self, bucket: Bucket, reduced: torch.Tensor) -> torch.Tensor:
        """Every rank keeps the whole sum."""
        return reduced

    def deliver(self, bucket: Bucket, kept: torch.Tensor) -> None:
        """Copy each parameter's reduced gradient back into ``.grad``."""
        offset = 0
        for s in bucket.slots:
            p = self.params[s]
            n = p.numel()
            reduced = kept[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = reduced.to(p.dtype).clone()
            else:
                p.grad.copy_(reduced)
            offset += n
