"""The pipeline data contract: each micro-batch is ``(inputs, labels)``; the first stage uses the inputs, the
last stage the labels, and every reading stage of a replica reads the same iterator position.

A wrong item (not a pair, an exhausted iterator, no iterator at all) is found on the reading stages, which are
only some of the ranks. :func:`agree_or_raise` makes every rank raise the same clear error, before the schedule
issues its first point-to-point transfer, so no rank is left waiting for a peer that gave up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import sum_over


class DataFeed:
    """Reads the micro-batches of one call of ``train_batch`` / ``eval_batch``.

    Args:
        iterator: the data iterator (``None`` where this stage reads nothing, or when none was given).
        batch_fn: optional function applied to every item before the contract is checked.
        reads: how many micro-batches this stage's schedule loads (0 on middle stages).
    """

    def __init__(self, iterator: Iterator[Any] | None, batch_fn: Callable[[Any], Any] | None, reads: int) -> None:
        self.iterator = iterator
        self.batch_fn = batch_fn
        self.reads = reads
        self._items: list[tuple[Any, Any]] = []

    def prime(self) -> str | None:
        """Read and check every micro-batch of the call now; returns the problem, if any (``None`` when fine).

        Reading them all up front (they are the iterator's host-side items, moved to the device one at a time
        when loaded) lets a bad item anywhere in the batch fail every rank together ([Note: pipeline data]).
        """
        try:
            self._items = [self._read() for _ in range(self.reads)]
        except (TypeError, ValueError, StopIteration) as err:
            self._items = []
            return f"{type(err).__name__}: {err}"
        return None

    def next(self) -> tuple[Any, Any]:
        """The next micro-batch as ``(inputs, labels)``."""
        if not self._items:
            raise RuntimeError("the schedule loads more micro-batches than it announced (schedule bug)")
        return self._items.pop(0)

    def _read(self) -> tuple[Any, Any]:
        if self.iterator is None:
            raise ValueError(
                "this pipeline stage loads micro-batches but no data iterator was given: pass one to "
                "train_batch(data_iter=...) / eval_batch(data_iter), call set_dataiterator(), or give "
                "training_data to deepspeed.initialize"
            )
        try:
            item = next(self.iterator)
        except StopIteration:
            raise StopIteration("the pipeline data iterator is exhausted") from None
        if self.batch_fn is not None:
            item = self.batch_fn(item)
        return check_item(item)


def check_item(item: Any) -> tuple[Any, Any]:
    """``item`` as ``(inputs, labels)``, or a ValueError saying what the pipeline expects."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        kind = (
            f"{type(item).__name__} of length {len(item)}" if isinstance(item, (tuple, list)) else type(item).__name__
        )
        raise ValueError(
            f"a pipeline data iterator must yield (inputs, labels) pairs (inputs: a tensor or a tuple of tensors "
            f"for the first stage; labels: what loss_fn takes on the last stage); got a {kind}"
        )
    inputs, labels = item
    if not _is_tensor_tree(inputs):
        raise ValueError(
            f"pipeline micro-batch inputs must be a tensor or a tuple of tensors, got {type(inputs).__name__}"
        )
    return inputs, labels


def _is_tensor_tree(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and bool(value) and all(isinstance(v, torch.Tensor) for v in value)


def agree_or_raise(problem: str | None, device: torch.device) -> None:
    """Every rank learns whether any rank found a problem; if so, every rank raises the first rank's message.

    One one-element all-reduce over the world when all is well; the messages are only gathered on failure.
    """
    flag = torch.tensor([1 if problem else 0], dtype=torch.int64, device=device)
    sum_over(flag, None)
    if int(flag.item()) == 0:
        return
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, problem)
    rank, text = next((r, m) for r, m in enumerate(messages) if m)
    raise ValueError(f"pipeline data on rank {rank}: {text}")
