"""Micro-batch / gradient-accumulation boundary bookkeeping.

The engine counts micro-steps; a step at the accumulation boundary applies the optimizer. Callers that
own the boundary themselves (accelerate) set it explicitly before each backward.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Where the current micro-step is, so misuse is caught at the call that causes it."""

    IDLE = "idle"  # no backward since the last step()
    ACCUMULATING = "accumulating"  # backward(s) ran inside the window, not at its boundary (accelerate skips step())
    BACKWARD_DONE = "backward_done"  # backward ran at the boundary; step() comes next


class AccumulationState:
    """Tracks micro-steps and the accumulation boundary.

    Args:
        gradient_accumulation_steps: micro-steps per optimizer step (``>= 1``).
    """

    def __init__(self, gradient_accumulation_steps: int) -> None:
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
        self.gas = gradient_accumulation_steps
        self.micro_steps = 0
        self.boundary_override: bool | None = None
        self.phase = Phase.IDLE

    def is_boundary(self) -> bool:
        """True when the current micro-step ends an accumulation window."""
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self.gas == 0

    def set_boundary(self, is_boundary: bool | None) -> None:
        """Force (or, with ``None``, stop forcing) the boundary decision."""
        self.boundary_override = is_boundary

    def on_backward(self) -> None:
        """Record a backward; a second backward at the boundary without ``step()`` is an error.

        Two backwards inside one accumulation window are legitimate only when the caller
        accumulates on purpose (not at the boundary): at the boundary the gradients are reduced,
        so a second backward would double-count them.
        """
        if self.phase is Phase.BACKWARD_DONE:
            raise RuntimeError(
                "backward() was called twice at a gradient-accumulation boundary without step() in between; "
                "call engine.step() after each engine.backward()"
            )
        self.phase = Phase.BACKWARD_DONE if self.is_boundary() else Phase.ACCUMULATING

    def on_step(self) -> None:
        """Advance one micro-step."""
        self.micro_steps += 1
        self.phase = Phase.IDLE
