"""ZenFlow's ``update_interval: "auto"`` rule ([Note: zenflow]): when the accumulated rest has caught up."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class AutoInterval:
    """``update_interval: "auto"``: a weight is due once the mean column norm accumulated in its unselected
    columns since the last host update reaches the mean norm of its selected columns per step (averaged over the
    same steps); the host update runs once at least ``auto_ratio`` of the 2-D weights are due."""

    def __init__(self, ratio: float, weights: int) -> None:
        self.ratio, self.weights = ratio, weights
        self.selected = torch.zeros(weights, dtype=torch.float64)
        self.rest = torch.zeros(weights, dtype=torch.float64)
        self.steps = 0

    def observe(self, norms: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> None:
        """One step's column norms and selections, one per 2-D weight."""
        for i, (norm, chosen) in enumerate(zip(norms, masks, strict=True)):
            self.selected[i] += norm[chosen].mean().double() if chosen.any() else 0.0
            self.rest[i] += norm[~chosen].mean().double() if (~chosen).any() else 0.0
        self.steps += 1

    def due(self) -> bool:
        """Whether enough weights are due for a host update."""
        if not self.weights or not self.steps:
            return False
        ready = int((self.rest >= self.selected / self.steps).sum())
        return ready >= max(1, math.ceil(self.ratio * self.weights))

    def reset(self) -> None:
        """A host update was applied."""
        self.selected.zero_()
        self.rest.zero_()
        self.steps = 0

    def state_dict(self) -> dict:
        """The sums observed since the last host update (the same on every rank)."""
        return {"selected": self.selected.clone(), "rest": self.rest.clone(), "steps": self.steps}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore :meth:`state_dict` (``None``, e.g. saved with a fixed interval: start counting afresh)."""
        if state is None or state["selected"].numel() != self.weights:
            self.reset()
            return
        self.selected.copy_(state["selected"])
        self.rest.copy_(state["rest"])
        self.steps = int(state["steps"])
