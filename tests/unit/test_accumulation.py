"""Accumulation-boundary state machine, including accelerate's explicit-boundary protocol."""

from __future__ import annotations

import pytest

from deepspeed._core.engine.accumulation import AccumulationState


def test_counting_boundary() -> None:
    acc = AccumulationState(3)
    seen = []
    for _ in range(6):
        seen.append(acc.is_boundary())
        acc.on_backward()
        acc.on_step()
    assert seen == [False, False, True, False, False, True]


def test_accelerate_style_explicit_boundaries() -> None:
    # accelerate: set_boundary(False), backward, set_boundary(True), backward, step (only at the boundary).
    acc = AccumulationState(2)
    acc.set_boundary(False)
    acc.on_backward()
    acc.set_boundary(True)
    acc.on_backward()
    with pytest.raises(RuntimeError, match="step"):
        acc.on_backward()  # a second backward at the boundary would double-count reduced gradients
    acc.on_step()
    acc.on_backward()  # fine again after the step


def test_gas_must_be_positive() -> None:
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        AccumulationState(0)
