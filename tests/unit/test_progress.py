"""The progress line appears every ``steps_per_print`` steps and carries the promised fields."""

from __future__ import annotations

import math

from deepspeed._core.engine.progress import ProgressReporter


def test_reports_on_the_period_only() -> None:
    rep = ProgressReporter(steps_per_print=2, train_batch_size=8)
    assert rep.maybe_report(1, 1.0, [0.1], 0.5) is None
    line = rep.maybe_report(2, 65536.0, [0.1, 0.01], 0.5)
    assert line is not None
    for field in (
        "step=2",
        "loss_scale=65536",
        "lr=0.1,0.01",
        "grad_norm=0.5",
        "samples/s=",
        "mem_alloc=",
        "mem_reserved=",
        "mem_peak=",
    ):
        assert field in line, field


def test_disabled_by_none_zero_or_infinity() -> None:
    for period in (None, 0, math.inf):
        rep = ProgressReporter(steps_per_print=period, train_batch_size=8)
        assert not rep.enabled()
        assert rep.maybe_report(10, 1.0, [0.1], None) is None
