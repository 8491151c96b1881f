"""Prefetch trace logic with fake unit sizes (no tensors, no process group)."""

from __future__ import annotations

from deepspeed._core.config.plan import Stage3Policy
from deepspeed._core.params.prefetch import PrefetchBudget, StepTrace, TraceMode

SIZES = {0: 10, 1: 10, 2: 10, 3: 10, 4: 30}


def _run_step(trace: StepTrace, order: list[int]) -> None:
    trace.begin_step()
    for unit in order:
        trace.observe(unit)


def _trace(prefetch: int, live: int = 10**9, reuse: int = 10**9) -> StepTrace:
    return StepTrace(
        PrefetchBudget.from_policy(
            Stage3Policy(prefetch_bucket_size=prefetch, max_live_parameters=live, max_reuse_distance=reuse)
        )
    )


def test_record_then_complete_then_invalidate_on_new_order() -> None:
    trace = _trace(20)
    assert trace.mode is TraceMode.INVALID
    _run_step(trace, [0, 1, 2, 2, 1, 0])
    assert trace.mode is TraceMode.RECORD and trace.order == [0, 1, 2, 2, 1, 0]
    _run_step(trace, [0, 1, 2, 2, 1, 0])
    assert trace.mode is TraceMode.COMPLETE and trace.invalidations == 0
    _run_step(trace, [0, 2])
    assert trace.mode is TraceMode.INVALID and trace.invalidations == 1
    trace.begin_step()
    assert trace.mode is TraceMode.RECORD and trace.order == []


def test_running_past_the_end_of_the_trace_invalidates() -> None:
    trace = _trace(20)
    _run_step(trace, [0, 1])
    _run_step(trace, [0, 1, 2])
    assert trace.mode is TraceMode.INVALID


def test_candidates_fill_the_window_counting_gathered_units() -> None:
    trace = _trace(20)
    _run_step(trace, [0, 1, 2, 3, 4])
    trace.begin_step()
    trace.observe(0)
    assert trace.prefetch_candidates(SIZES.get, lambda u: False, 0) == [1, 2]
    # An upcoming unit that is already gathered still occupies the window.
    assert trace.prefetch_candidates(SIZES.get, lambda u: u == 1, 0) == [2]
    assert _trace(0).prefetch_candidates(SIZES.get, lambda u: False, 0) == []


def test_candidates_respect_max_live_parameters() -> None:
    trace = _trace(100, live=25)
    _run_step(trace, [0, 1, 2, 3])
    trace.begin_step()
    trace.observe(0)
    assert trace.prefetch_candidates(SIZES.get, lambda u: False, 10) == [1]


def test_no_prefetch_while_recording() -> None:
    trace = _trace(100)
    trace.begin_step()
    trace.observe(0)
    assert trace.prefetch_candidates(SIZES.get, lambda u: False, 0) == []


def test_reuse_is_bounded_by_the_prefetch_window_not_max_reuse_distance() -> None:
    trace = _trace(20, reuse=10**9)
    assert trace.budget.reuse_numel == 20
    _run_step(trace, [0, 1, 0, 2, 3, 1])
    trace.begin_step()
    trace.observe(0)
    assert trace.reused_soon(0, SIZES.get)  # distance 10 (unit 1) + own 10 <= 20
    trace.observe(1)
    assert not trace.reused_soon(1, SIZES.get)  # 0, 2, 3 come first: 30 > 20
    small = _trace(20, reuse=5)
    assert small.budget.reuse_numel == 5


def test_live_count_is_evaluated_only_when_a_candidate_fits_the_window() -> None:
    trace = _trace(5)  # smaller than any unit: nothing ever fits
    _run_step(trace, [0, 1, 2])
    trace.begin_step()
    trace.observe(0)
    calls = []
    assert trace.prefetch_candidates(SIZES.get, lambda u: False, lambda: calls.append(1) or 0) == []
    assert calls == []
    wide = _trace(100, live=25)
    _run_step(wide, [0, 1, 2, 3])
    wide.begin_step()
    wide.observe(0)
    assert wide.prefetch_candidates(SIZES.get, lambda u: False, lambda: calls.append(1) or 10) == [1]
    assert calls == [1]  # evaluated once, then tracked locally


def _whole_unit_trace(prefetch: int, whole_unit: int, live: int = 10**9) -> StepTrace:
    policy = Stage3Policy(prefetch_bucket_size=prefetch, max_live_parameters=live, max_reuse_distance=10**9)
    return StepTrace(PrefetchBudget.from_policy(policy, whole_unit_numel=whole_unit))


def test_a_window_smaller_than_the_next_leaf_unit_still_prefetches_that_unit() -> None:
    """Units are gathered whole: with leaf units larger than the window, the next one is prefetched whole (one
    unit ahead, as FSDP2 does) instead of nothing; further units wait, and the window's other bounds hold."""
    sizes = {0: 50, 1: 50, 2: 50, 3: 200}
    order = [0, 1, 2, 3]
    for whole_unit, expected in ((0, []), (50, [1])):
        trace = _whole_unit_trace(10, whole_unit)
        _run_step(trace, order)
        trace.begin_step()
        trace.observe(0)
        assert trace.prefetch_candidates(sizes.get, lambda u: False, 0) == expected
    trace = _whole_unit_trace(10, 50)
    _run_step(trace, order)
    trace.begin_step()
    for unit in order[:3]:
        trace.observe(unit)
    # The next unit (200 elements) is larger than any leaf unit: the window rules as before.
    assert trace.prefetch_candidates(sizes.get, lambda u: False, 0) == []
    # Prefetch off stays off, and the live cap still binds.
    for trace in (_whole_unit_trace(0, 50), _whole_unit_trace(10, 50, live=60)):
        _run_step(trace, order)
        trace.begin_step()
        trace.observe(0)
        assert trace.prefetch_candidates(sizes.get, lambda u: False, 20) == []
