"""ZenFlow's state between steps as a checkpoint holds it: the host update in flight and the keys it is saved
under ([Note: zenflow checkpoint] in ``zenflow.py``)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch


@dataclass
class PendingUpdate:
    """A host update computed in the background and applied at the next step: its job returns the new values of
    the masked-out elements, or, ``in_place``, has written them already ([Note: zenflow in-place host update]).
    An in-place one waits in ``due`` (its step count and hyperparameters) until it is started; one a load restored
    carries the ``working`` partitions to publish instead of the masters ([Note: zenflow checkpoint])."""

    job: Future | None
    in_place: bool = False
    due: tuple[int, list[dict]] | None = None
    working: list[torch.Tensor] | None = None


STATE_FORMAT = 1
ACCUMULATOR = "accumulator"
PENDING_REST = "pending_rest"
PENDING_VALUES = "pending_values"
PENDING_STATE = "pending_state."
PENDING_WORKING = "pending_working"


def copied(scalars: dict) -> dict:
    """A step-count dict whose tensors are copies."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}


def unpacked(mask: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``packed`` (the values under ``mask``) written into zeros shaped like ``mask``."""
    return torch.zeros(mask.numel(), dtype=packed.dtype).masked_scatter_(mask, packed)


def restored_pending(parts: dict, counts: list[dict] | None) -> PendingUpdate | None:
    """The saved host update in flight, as an already finished job that the next step applies."""
    if counts is None:
        return None
    job: Future = Future()
    if PENDING_WORKING in parts:  # in place: the loaded master and moments hold it already
        job.set_result([(index, copied(scalars)) for index, scalars in enumerate(counts)])
        return PendingUpdate(job, in_place=True, working=parts[PENDING_WORKING])
    results = []
    for index, scalars in enumerate(counts):
        rest = parts[PENDING_REST][index].to(torch.bool)
        state = {k[len(PENDING_STATE) :]: v[index][rest] for k, v in parts.items() if k.startswith(PENDING_STATE)}
        results.append((index, parts[PENDING_VALUES][index][rest], state, copied(scalars)))
    job.set_result(results)
    return PendingUpdate(job)
